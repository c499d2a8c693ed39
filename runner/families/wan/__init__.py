"""Wan 2.1 / 2.2 video: trainer.py (text-to-video), i2v.py (image-to-video), experts.py (Wan 2.2 A14B's two
experts in one run), config.py (``trainer=wan``, ``wan22_a14b``, ``wan22_5b``), architecture.py (tiny and full
tables, image-to-video included), sampling.py and i2v_sampling.py (``WanPipeline``, ``WanImageToVideoPipeline``).
"""
