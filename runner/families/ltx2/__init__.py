"""LTX-2 (audio and video): trainer.py, config.py (``trainer=ltx2``), architecture.py (tiny and full tables),
audio.py (waveform to log-mel, as LTX-2's trainer computes it), sampling.py (``LTX2Pipeline``)."""
