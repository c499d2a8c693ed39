"""Z-Image: trainer.py, config.py (``trainer=z_image``), architecture.py (tiny and full tables), sampling.py.
"""
