"""SDXL: trainer.py, config.py (``trainer=sdxl``), sampling.py (``StableDiffusionXLPipeline``).
architecture.py (the U-Net; the CLIP towers and the VAE from runner/families/common/model_configs.py).
"""
