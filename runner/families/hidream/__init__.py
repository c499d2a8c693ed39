"""HiDream-I1: trainer.py, config.py (``trainer=hidream``), architecture.py (tiny and full tables), sampling.py.
"""
