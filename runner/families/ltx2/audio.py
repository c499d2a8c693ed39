"""The log-mel spectrogram LTX-2's audio VAE encodes, in plain torch (no torchaudio).

LTX-2's trainer turns a stereo 16 kHz waveform into ``(B, 2, frames, mel_bins)`` with torchaudio's
``MelSpectrogram`` (n_fft 1024, hop = the VAE's ``mel_hop_length``, Hann window of n_fft, centred with reflect
padding, magnitude (power 1), Slaney mel scale and Slaney area norm, 0 Hz to Nyquist) and ``log(max(mel, 1e-5))``;
diffusers' ``LTX2Pipeline`` only decodes audio, so this is the encode side of its audio path.
"""
from __future__ import annotations

import math

import torch

_F_SP = 200.0 / 3  # Slaney: linear below 1 kHz (3 mels per 200 Hz), logarithmic above
_MIN_LOG_HZ, _LOG_STEP = 1000.0, math.log(6.4) / 27.0


def _hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    mel = f / _F_SP
    log_part = _MIN_LOG_HZ / _F_SP + torch.log(torch.clamp(f, min=_MIN_LOG_HZ) / _MIN_LOG_HZ) / _LOG_STEP
    return torch.where(f >= _MIN_LOG_HZ, log_part, mel)


def _mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    min_log_mel = _MIN_LOG_HZ / _F_SP
    return torch.where(m >= min_log_mel, _MIN_LOG_HZ * torch.exp(_LOG_STEP * (m - min_log_mel)), _F_SP * m)


def slaney_filterbank(n_fft: int, n_mels: int, sample_rate: int) -> torch.Tensor:
    """``(n_fft // 2 + 1, n_mels)`` triangular filters on the Slaney mel scale, area-normalised (float64 math).
    Not cached: a tensor made inside the planner is fake, and a cache would hand it to later real calls."""
    freqs = torch.linspace(0, sample_rate // 2, n_fft // 2 + 1, dtype=torch.float64)
    edges = _mel_to_hz(torch.linspace(float(_hz_to_mel(torch.tensor(0.0, dtype=torch.float64))),
                                      float(_hz_to_mel(torch.tensor(sample_rate / 2, dtype=torch.float64))),
                                      n_mels + 2, dtype=torch.float64))
    widths = edges[1:] - edges[:-1]
    slopes = edges[None, :] - freqs[:, None]
    down, up = -slopes[:, :-2] / widths[:-1], slopes[:, 2:] / widths[1:]
    fb = torch.clamp(torch.minimum(down, up), min=0.0)
    return (fb * (2.0 / (edges[2:] - edges[:-2]))[None, :]).float()


def log_mel(waveform: torch.Tensor, sample_rate: int, hop: int, n_mels: int, n_fft: int) -> torch.Tensor:
    """``(B, C, N)`` float waveform to ``(B, C, frames, n_mels)`` log-mel, ``frames = N // hop + 1``."""
    b, c, n = waveform.shape
    x = waveform.float().reshape(b * c, n)
    spec = torch.stft(x, n_fft, hop_length=hop, win_length=n_fft, window=torch.hann_window(n_fft, device=x.device),
                      center=True, pad_mode="reflect", normalized=False, onesided=True, return_complex=True).abs()
    mel = spec.transpose(1, 2) @ slaney_filterbank(n_fft, n_mels, sample_rate).to(x.device)
    return torch.log(torch.clamp(mel, min=1e-5)).reshape(b, c, -1, n_mels)


def audio_latent_frames(frames: int, fps: float, sample_rate: int, hop: int, compression: int = 4) -> int:
    """Audio latent frames of a clip of ``frames`` video frames at ``fps``: ``LTX2Pipeline``'s
    ``round(duration * sample_rate / hop / compression)``."""
    return round(frames / fps * (sample_rate / hop / float(compression)))
