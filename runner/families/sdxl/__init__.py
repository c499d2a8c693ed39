"""SDXL: trainer.py, config.py (``trainer=sdxl``), sampling.py (``StableDiffusionXLPipeline``).
Architecture tables: runner/families/common/model_configs.py.
"""
