"""Qwen-Image-Edit (edit and plus): trainer.py (on the Qwen-Image trainer), config.py (``trainer=qwen_image_edit``),
images.py (the reference's size for Qwen2.5-VL), sampling.py. Qwen-Image's architecture tables.
"""
