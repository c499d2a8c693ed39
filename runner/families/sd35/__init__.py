"""SD3.5 Medium / Large: trainer.py, config.py (``trainer=sd35``), sampling.py (``StableDiffusion3Pipeline``).
Architecture tables: runner/families/common/model_configs.py.
"""
