"""Lumina-Image 2.0: trainer.py, config.py (``trainer=lumina2``), architecture.py (tiny and full tables), sampling.py.
"""
