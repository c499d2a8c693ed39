"""``train.compile``: regional compilation of the denoiser's repeated blocks (``regional.py``; checks in ``config.py``)."""
