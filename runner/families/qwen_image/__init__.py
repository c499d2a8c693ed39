"""Qwen-Image: trainer.py, config.py (``trainer=qwen_image``), architecture.py (tiny and full tables; Wan's VAE
is defined here), sampling.py (``QwenImagePipeline``).
"""
