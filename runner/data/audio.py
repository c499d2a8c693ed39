"""Audio for audio-video trainers (``trainer=ltx2``): each clip sample's waveform, ``"audio"``: float32 ``[2, N]``
(stereo; mono is duplicated) at the trainer's rate, ``N = round(frames / fps * rate)``, for the same window as the
frames (it starts at the window's first frame).

Where it comes from: a video file's first audio track (PyAV, resampled), else a ``.wav`` (or .flac, .mp3, .ogg)
beside the clip with the same stem (``clip1.mp4`` + ``clip1.wav``; a frames folder ``clip1/`` + ``clip1.wav``).
A clip with neither is an error naming it and ``data.audio=false`` (never silence in its place); a track that ends
before the window does is padded with silence to the window's length (logged once per run). The built-in demo
clips get a tone per clip (:func:`demo_audio`), so the tiny default trains with audio.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runner.errors import UserError

log = logging.getLogger("runner")
AUDIO_EXTENSIONS: tuple[str, ...] = (".wav", ".flac", ".mp3", ".ogg")
_warned_short = False


def refuse_audio_keys(cfg: Any, name: str) -> None:
    """``data.audio=true`` or ``loss.audio_weight`` set for a trainer with no audio stream: refused, not ignored."""
    data = cfg.get("data") if hasattr(cfg, "get") else None
    if data is not None and hasattr(data, "get") and data.get("audio", None):
        raise UserError(f"data.audio=true: {name} has no audio stream; only trainer=ltx2 trains audio. Unset data.audio.")
    loss = cfg.get("loss") if hasattr(cfg, "get") else None
    if loss is not None and hasattr(loss, "get") and float(loss.get("audio_weight", 1.0)) != 1.0:
        raise UserError(f"loss.audio_weight={loss.get('audio_weight')!r}: {name} has no audio loss to weigh; only "
                        "trainer=ltx2 trains audio. Unset loss.audio_weight.")


def audio_beside(path: Path) -> Path | None:
    """The audio file with the clip's stem beside it (a frames folder's name is its stem)."""
    stem = path.stem if path.is_file() else path.name
    for ext in AUDIO_EXTENSIONS:
        candidate = path.parent / (stem + ext)
        if candidate.is_file():
            return candidate
    return None


def _has_audio_track(path: Path) -> bool:
    import av

    try:
        with av.open(str(path)) as container:
            return bool(container.streams.audio)
    except Exception:  # noqa: BLE001 - an unreadable file has no usable track; decode_frames reports it
        return False


def audio_source(kind: str, path: Path) -> Path | None:
    """The file a clip's audio is read from: its own track (a video file), else the audio file beside it."""
    if kind == "video" and _has_audio_track(path):
        return path
    return audio_beside(path)


def decode_audio(source: Path, rate: int, start_s: float, samples: int, shown: str) -> torch.Tensor:
    """``[2, samples]`` float32 of ``source``'s first audio track from ``start_s`` seconds, resampled to ``rate``."""
    global _warned_short
    import av

    skip = int(round(start_s * rate))
    chunks: list[np.ndarray] = []
    got = 0
    try:
        with av.open(str(source)) as container:
            resampler = av.AudioResampler(format="fltp", layout="stereo", rate=rate)
            for frame in container.decode(container.streams.audio[0]):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray())
                    got += chunks[-1].shape[1]
                if got >= skip + samples:
                    break
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray())
    except Exception as e:  # decoders raise many types; any of them means an unusable file
        raise UserError(f"data.path={shown!r}: cannot read the audio of {str(source)!r} ({type(e).__name__}: {e}). "
                        "Replace the file, or set data.audio=false to train video only.") from None
    wave = np.concatenate(chunks, axis=1)[:, skip:skip + samples] if chunks else np.zeros((2, 0), np.float32)
    if wave.shape[1] < samples:
        if not _warned_short:
            log.warning("data: the audio of %s ends %.2f s before its window; padded with silence (further short "
                        "tracks are padded without a warning)", source, (samples - wave.shape[1]) / rate)
            _warned_short = True
        wave = np.pad(wave, ((0, 0), (0, samples - wave.shape[1])))
    return torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))


def missing_audio(path: Path, shown: str) -> UserError:
    stem = path.stem if path.is_file() else path.name
    return UserError(f"data.path={shown!r}: clip {str(path)!r} has no audio track and no {stem}.wav beside it, and "
                     "this trainer trains audio (data.audio=true, the default of trainer=ltx2). Add the audio, or set "
                     "data.audio=false to train video only.")


def demo_audio(index: int, samples: int, rate: int) -> torch.Tensor:
    """A demo clip's ``[2, samples]`` track: a tone whose pitch and stereo balance follow the clip's index."""
    t = torch.arange(samples, dtype=torch.float64) / rate
    freq = 220.0 * 2 ** ((index % 12) / 12)
    tone = 0.3 * torch.sin(2 * math.pi * freq * t)
    pan = (index % 5) / 4
    return torch.stack([tone * (1 - 0.5 * pan), tone * (0.5 + 0.5 * pan)]).float()
