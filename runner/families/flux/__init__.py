"""FLUX.1: trainer.py, config.py (``trainer=flux``), sampling.py (``FluxPipeline``).
Architecture tables: runner/families/common/model_configs.py (CLIP-L, T5-XXL and the VAE are shared).
"""
