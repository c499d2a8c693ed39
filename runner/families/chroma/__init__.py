"""Chroma (8.9 B, Flux-derived, T5 only): trainer.py, config.py (``trainer=chroma``), sampling.py (``ChromaPipeline``).
Architecture tables: runner/families/common/model_configs.py (shared with Flux's VAE and T5).
"""
