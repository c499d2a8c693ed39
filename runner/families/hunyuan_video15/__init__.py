"""HunyuanVideo 1.5: trainer.py, config.py (``trainer=hunyuan_video15``), architecture.py (tiny and full tables),
sampling.py (``HunyuanVideo15Pipeline``).
"""
