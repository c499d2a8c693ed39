"""FLUX.1 Kontext (edit): trainer.py (on the FLUX.1 trainer), config.py (``trainer=flux_kontext``),
sampling.py (``FluxKontextPipeline``). Flux's architecture tables.
"""
