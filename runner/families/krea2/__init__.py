"""Krea 2: trainer.py, config.py (``trainer=krea2``), architecture.py (tiny and full tables), sampling.py
(``Krea2Pipeline``).
"""
