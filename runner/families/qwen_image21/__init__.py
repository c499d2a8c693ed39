"""Qwen-Image 2.1: trainer.py, config.py (``trainer=qwen_image21``), architecture.py (tiny and full tables),
sampling.py (``QwenImage21Pipeline``).
"""
