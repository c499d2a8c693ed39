"""SD1.5 / SD2.1: trainer.py, config.py (``trainer=sd15``), sampling.py (``StableDiffusionPipeline``).
architecture.py (U-Nets, VAE scaling; the CLIP towers from runner/families/common/model_configs.py).
"""
