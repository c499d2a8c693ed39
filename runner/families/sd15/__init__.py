"""SD1.5 / SD2.1: trainer.py, config.py (``trainer=sd15``), sampling.py (``StableDiffusionPipeline``).
Architecture tables: runner/families/common/model_configs.py.
"""
