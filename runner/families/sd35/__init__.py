"""SD3.5 Medium / Large: trainer.py, config.py (``trainer=sd35``), sampling.py (``StableDiffusion3Pipeline``).
architecture.py (transformers, VAE scaling; CLIP and T5 from runner/families/common/model_configs.py).
"""
