"""FLUX.1: trainer.py, config.py (``trainer=flux``), sampling.py (``FluxPipeline``).
architecture.py (the transformer; CLIP-L, T5-XXL and the VAE from runner/families/common/model_configs.py),
dit.py (the transformer call FLUX.1, Kontext and Chroma share).
"""
