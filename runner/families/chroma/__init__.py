"""Chroma (8.9 B, Flux-derived, T5 only): trainer.py, config.py (``trainer=chroma``), sampling.py (``ChromaPipeline``).
architecture.py (the transformer; T5 and FLUX.1's VAE from runner/families/common/model_configs.py).
"""
