"""The built-in video demo set: procedurally drawn shapes moving across a plain background.

The video twin of :mod:`runner.data.demo`: the same shapes and colour pairs, each clip one shape
gliding in one of four directions, captioned e.g. "a red circle moving left on a blue
background". Needs no files or network; every frame is a pure function of (clip index, frame,
frame count, size), so the set is reproducible in any process and resumable like the image demo.
"""
from __future__ import annotations

from typing import Any

import torch
from PIL import Image, ImageDraw
from torch.utils.data import Dataset

from runner.data.checks import check_index
from runner.data.demo import _COLOURS, _article, cached_copy, demo_spec, draw_solid_shape
from runner.data.images import _mix
from runner.data.video import ClipSettings, frames_to_tensor

_SALT_MOTION = 6
DIRECTIONS = ("right", "left", "up", "down")


def demo_motion(index: int) -> str:
    """The direction clip ``index`` moves in (a hash of the index, so neighbours differ)."""
    return DIRECTIONS[_mix(index, _SALT_MOTION) % len(DIRECTIONS)]


def demo_clip_caption(index: int, flipped: bool = False) -> str:
    """E.g. "a red circle moving left on a blue background" or "white stripes moving up on ...";
    ``flipped``: the caption of the mirrored clip (left and right swap)."""
    shape, fg, bg = demo_spec(index)
    thing = f"{fg} stripes" if shape == "stripes" else f"{_article(fg)} {fg} {shape}"
    motion = demo_motion(index)
    if flipped:
        motion = {"left": "right", "right": "left"}.get(motion, motion)
    return f"{thing} moving {motion} on {_article(bg)} {bg} background"


def demo_frame(index: int, frame: int, frames: int, width: int, height: int) -> Image.Image:
    """Frame ``frame`` of demo clip ``index``: drawn at 2x and downsampled, as the image demo is."""
    shape, fg, bg = demo_spec(index)
    ss = 2
    w, h = width * ss, height * ss
    img = Image.new("RGB", (w, h), _COLOURS[bg])
    draw = ImageDraw.Draw(img)
    size = min(w, h) * (0.35 + 0.15 * ((_mix(index, 7) & 0xFF) / 255))
    half = size / 2
    p = frame / (frames - 1) if frames > 1 else 0.0  # 0 -> 1 over the clip
    direction = demo_motion(index)
    sign = 1.0 if direction in ("right", "down") else -1.0
    travel = 0.5 * (2 * p - 1) * sign  # -0.5 .. 0.5 of the free room, along the motion
    cx, cy = w / 2, h / 2
    if direction in ("right", "left"):
        cx += travel * (w - size)
    else:
        cy += travel * (h - size)
    colour = _COLOURS[fg]
    if not draw_solid_shape(draw, shape, cx, cy, half, colour):
        # stripes across the frame, perpendicular to the motion, shifting with it
        vertical = direction in ("right", "left")
        extent = w if vertical else h
        period = extent / 4
        shift = travel * period * 0.5  # half a period over the clip: the first and last frames differ
        x = -2 * period + shift
        while x < extent + period:
            if vertical:
                draw.rectangle((x, 0, x + period / 2 - 1, h), fill=colour)
            else:
                draw.rectangle((0, x, w, x + period / 2 - 1), fill=colour)
            x += period
    return img.resize((width, height), Image.Resampling.LANCZOS)


class DemoClips(Dataset):
    """``size`` procedurally drawn clips of ``settings.frames`` frames at ``width x height``."""

    def __init__(self, size: int, settings: ClipSettings) -> None:
        self.size = int(size)
        self.settings = settings
        self.frame_counts = [settings.frames]
        self._cache: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.size

    def caption(self, index: int) -> str:
        # data.random_flip mirrors a visit after this (runner/data/flip.py), so a mirrored visit's
        # caption keeps the unmirrored direction, as any flip augmentation of a captioned set does.
        return demo_clip_caption(index)

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = check_index(index, self.size, "demo clips")
        t = cached_copy(self._cache, index, self._draw)
        out = {"pixel_values": t, "caption": self.caption(index), "index": index}
        s = self.settings
        if s.audio_rate:  # an audio-video trainer: a tone per clip (runner/data/audio.py)
            from runner.data.audio import demo_audio

            out["audio"] = demo_audio(index, s.audio_samples(), s.audio_rate)
        return out

    def _draw(self, index: int) -> torch.Tensor:
        s = self.settings
        frames = [demo_frame(index, f, s.frames, s.width, s.height) for f in range(s.frames)]
        return frames_to_tensor(frames, False)

    def describe(self) -> str:
        s = self.settings
        return (f"{self.size} clips of {s.frames} frames at {s.width}x{s.height} from the built-in demo set "
                "(moving shapes)")
