"""Video training data: a folder of captioned clips (:class:`ClipFolderDataset`) or the built-in
moving-shape clips (:class:`runner.data.demo_video.DemoClips`), for video trainers (``trainer=wan``).

A sample is ``{"pixel_values": float32 [3, F, H, W] in [-1, 1], "caption": str, "index": int}``:
``F = data.frames`` frames of ``data.height`` x ``data.width`` pixels (both default to
``data.resolution``), the layout a video VAE encodes (channels, frames, height, width). An image
is a one-frame clip (``F = 1``).

Which frames (``data.frames``, ``data.fps``, ``data.frame_sampling``): the clip is read at
``data.fps`` (source frame ``round(k * source_fps / fps)`` for output frame ``k``: frames are
dropped or repeated to reach the rate; a folder of frames is taken to be at ``data.fps``) and
``F`` consecutive frames at that rate form the window. Where the window starts in a longer clip:

* ``start`` (default): at the first frame; ``middle``: centred;
* ``random``: at an offset hashed from the sample's index (like the per-index random crop): every
  clip gets its own start, the same one in every epoch, so its cached latents stay valid
  (``offload.park.cache_latents``); a window drawn anew at every visit would need a fresh VAE
  encode each time, which is exactly what the latent cache exists to avoid;
* ``slide``: every non-overlapping window of the clip is a sample of its own (a 10 s clip at
  16 fps gives 4 samples of 33 frames), so long clips are used whole.

Everything is a pure function of the sample index, as for images (see :mod:`runner.data`). A
clip too short for one window is skipped with a warning (the data summary counts them); a
folder in which nothing is long enough is an error that names the longest clip.

Frame size: each clip is resized to cover ``width x height`` (aspect kept) and cropped, the same
crop for all its frames (``data.center_crop``, else a per-index offset). ``data.random_flip`` is
the runner's, per visit (runner/data/flip.py): it mirrors every frame of a clip along the width.
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from runner.data.checks import _check_missing_caption, _get, check_index
from runner.data.clips import Clip, count_frames, decode_frames, find_clips
from runner.data.folder import _check_root, _read_caption
from runner.data.images import _SALT_CROP_X, _SALT_CROP_Y, _mix, _to_tensor
from runner.errors import UserError, valid_list

log = logging.getLogger("runner")

FRAME_SAMPLING: tuple[str, ...] = ("start", "middle", "random", "slide")
VIDEO_PIPELINE_VERSION = 1  # bump when decoding, resampling or cropping changes a sample's pixels
_SALT_WINDOW = 5
_RESAMPLE = Image.Resampling.LANCZOS

_PATH_HINT = ("Set data.path to a folder of clips, each with a same-named .txt caption beside it: a folder of "
              "frames (clip1/0001.png ... + clip1.txt), a video file (clip1.mp4 + clip1.txt; needs PyAV), an "
              "animated .gif, or an image (a one-frame clip); or leave data.path unset (null) for the built-in "
              "moving-shape clips.")


@dataclass(frozen=True)
class ClipSettings:
    """How a sample is cut from a clip; :func:`clip_settings` reads and checks it from ``cfg.data``."""

    frames: int
    fps: float | None
    width: int
    height: int
    sampling: str = "start"
    center_crop: bool = True
    audio_rate: int | None = None  # an audio-video trainer's sample rate: each sample has "audio" (runner/data/audio.py)

    def signature(self) -> dict[str, Any]:
        """What changes a sample's pixels (and audio), for encoder-cache keys."""
        sig = {"frames": self.frames, "fps": self.fps, "width": self.width, "height": self.height,
               "sampling": self.sampling, "center_crop": self.center_crop, "pipeline": VIDEO_PIPELINE_VERSION}
        if self.audio_rate is not None:
            sig["audio_rate"] = self.audio_rate
        return sig

    def audio_samples(self) -> int:
        """Waveform samples of one window: its duration at ``audio_rate``."""
        return round(self.frames / float(self.fps or 24.0) * int(self.audio_rate or 0))


def clip_settings(data_cfg: Any, default_frames: int, default_fps: float | None,
                  audio_rate: int | None = None) -> ClipSettings:
    """The run's clip settings: ``data.frames``/``data.fps`` default to the trainer's values."""
    frames = _get(data_cfg, "frames", None)
    fps = _get(data_cfg, "fps", None)
    res = int(_get(data_cfg, "resolution", 64))
    return ClipSettings(
        frames=int(default_frames if frames is None else frames),
        fps=None if (fps if fps is not None else default_fps) is None else float(fps if fps is not None else default_fps),
        width=int(_get(data_cfg, "width", None) or res),
        height=int(_get(data_cfg, "height", None) or res),
        sampling=str(_get(data_cfg, "frame_sampling", "start")),
        center_crop=bool(_get(data_cfg, "center_crop", True)),
        audio_rate=audio_rate,
    )


def check_video_keys(data_cfg: Any) -> None:
    """``data.frames``, ``data.fps``, ``data.frame_sampling``, ``data.width``, ``data.height``: the
    checks that hold for any trainer (a video trainer adds its own multiples, e.g. Wan's 4k+1 frames)."""
    frames = _get(data_cfg, "frames", None)
    if frames is not None and (isinstance(frames, bool) or not isinstance(frames, int) or frames < 1):
        raise UserError(f"data.frames={frames!r} is not valid: it is the number of frames per video sample, a whole "
                        "number >= 1 (e.g. data.frames=33), or null for the trainer's default.")
    fps = _get(data_cfg, "fps", None)
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
        raise UserError(f"data.fps={fps!r} is not valid: it is the frame rate clips are sampled at, a number > 0 "
                        "(e.g. data.fps=16), or null for the trainer's default.")
    sampling = _get(data_cfg, "frame_sampling", "start")
    if sampling not in FRAME_SAMPLING:
        raise UserError(f"data.frame_sampling={sampling!r} is not valid. Valid values: "
                        f"{valid_list(str(sampling), FRAME_SAMPLING)} (start, middle: one window per clip; random: one "
                        "window per clip at a per-sample offset; slide: every window of a clip).")
    for key in ("width", "height"):
        value = _get(data_cfg, key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 8):
            raise UserError(f"data.{key}={value!r} is not valid: it is the video frame {key} in pixels, a positive "
                            f"multiple of 8 (e.g. data.width=832 data.height=480), or null for data.resolution.")


# ---- windows -----------------------------------------------------------------------------------------
def window_offsets(length: int, stride: float, frames: int) -> list[int] | None:
    """Source-frame offsets of one window (``frames`` frames ``stride`` source frames apart), or
    None when the clip has fewer than the window needs."""
    offsets = [int(round(k * stride)) for k in range(frames)]
    return offsets if offsets[-1] < length else None


def windows(clip: Clip, settings: ClipSettings, first_index: int) -> list[list[int]]:
    """The frame indices of each sample ``clip`` gives (one, or several with ``slide``); [] if too short."""
    if clip.kind == "image":
        return [[0]]
    stride = clip.fps / settings.fps if (clip.fps and settings.fps) else 1.0
    offsets = window_offsets(clip.length, stride, settings.frames)
    if offsets is None:
        return []
    last_start = clip.length - 1 - offsets[-1]
    if settings.sampling == "start":
        starts = [0]
    elif settings.sampling == "middle":
        starts = [last_start // 2]
    elif settings.sampling == "random":
        starts = [_mix(first_index, _SALT_WINDOW) % (last_start + 1)]
    else:  # slide: back to back
        step = offsets[-1] + 1
        starts = list(range(0, last_start + 1, step))
    return [[s + o for o in offsets] for s in starts]


# ---- frames to a tensor --------------------------------------------------------------------------------
def fit_frames(frames: list[Image.Image], width: int, height: int, center: bool, index: int) -> list[Image.Image]:
    """Resize every frame to cover ``width x height`` (aspect kept) and crop it there, one crop for all."""
    w, h = frames[0].size
    scale = max(width / w, height / h)
    nw, nh = max(width, round(w * scale)), max(height, round(h * scale))
    if center:
        left, top = (nw - width) // 2, (nh - height) // 2
    else:
        left, top = _mix(index, _SALT_CROP_X) % (nw - width + 1), _mix(index, _SALT_CROP_Y) % (nh - height + 1)
    out = []
    for f in frames:
        if f.size != (w, h):  # a frames folder with mixed sizes: each is fitted on its own
            f = f.resize((w, h), _RESAMPLE)
        if (nw, nh) != (w, h):
            f = f.resize((nw, nh), _RESAMPLE, reducing_gap=3.0)
        if (left, top, nw, nh) != (0, 0, width, height):
            f = f.crop((left, top, left + width, top + height))
        out.append(f)
    return out


def frames_to_tensor(frames: list[Image.Image], flip: bool) -> torch.Tensor:
    """RGB frames -> float32 [3, F, H, W] in [-1, 1]."""
    if flip:
        frames = [f.transpose(Image.Transpose.FLIP_LEFT_RIGHT) for f in frames]
    return torch.stack([_to_tensor(f) for f in frames], dim=1).contiguous()


# ---- the folder data set --------------------------------------------------------------------------------
class ClipFolderDataset(Dataset):
    """Captioned clips (and images, as one-frame clips) from a folder tree; see the module docstring."""

    def __init__(self, path: str | os.PathLike[str], settings: ClipSettings, *, missing_caption: str = "error") -> None:
        self.settings = settings
        missing_caption = _check_missing_caption(missing_caption)
        self.root = _check_root(path)
        self._shown = shown = str(path)
        found, self.skipped = find_clips(self.root)
        if not found:
            raise UserError(f"data.path={shown!r} contains no clips or images. {_PATH_HINT}")
        clips: list[Clip] = []
        missing: list[Path] = []
        for kind, p, caption_file in found:
            if caption_file is None:
                missing.append(p)
            caption = _read_caption(caption_file, shown) if caption_file is not None else ""
            clips.append(Clip(kind, p, caption))
        if missing and missing_caption == "error":
            examples = ", ".join(f"{str(p)!r} needs {str(p.parent / ((p.stem if p.is_file() else p.name) + '.txt'))!r}"
                                 for p in missing[:3])
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise UserError(f"data.path={shown!r}: {len(missing)} of {len(found)} clips have no caption file: "
                            f"{examples}{more}. Each clip needs a same-named .txt caption beside it (a frames folder "
                            "clip1/ takes clip1.txt); or set data.missing_caption=empty.")
        self.missing_captions = len(missing)
        self.clips: list[Clip] = []
        self.samples: list[tuple[int, list[int]]] = []  # (clip, frame indices)
        too_short: list[Clip] = []
        for clip in clips:
            count_frames(clip, shown)
            wins = windows(clip, settings, len(self.samples))
            if not wins:
                too_short.append(clip)
                continue
            self.clips.append(clip)
            self.samples += [(len(self.clips) - 1, w) for w in wins]
        self.too_short = len(too_short)
        self.audio_files = self._find_audio() if settings.audio_rate else []
        if not self.samples:
            longest = max(too_short, key=lambda c: c.length)
            raise UserError(
                f"data.path={shown!r}: no clip is long enough for data.frames={settings.frames} at data.fps="
                f"{settings.fps}: the longest, {longest.relative(self.root)!r}, has {longest.length} frames"
                f"{f' at {longest.fps:g} fps' if longest.fps else ''}. Lower data.frames or data.fps.")
        if too_short:
            first = too_short[0]
            log.warning("data.path=%r: %d clip(s) shorter than one window of %d frames at %s fps are skipped "
                        "(first: %s, %d frames)", shown, len(too_short), settings.frames, settings.fps,
                        first.relative(self.root), first.length)
        self.frame_counts = sorted({len(w) for _, w in self.samples})

    def __len__(self) -> int:
        return len(self.samples)

    def caption(self, index: int) -> str:
        return self.clips[self.samples[index][0]].caption

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = check_index(index, len(self.samples), "clips")
        clip_i, frame_indices = self.samples[index]
        clip, s = self.clips[clip_i], self.settings
        frames = fit_frames(decode_frames(clip, frame_indices, self._shown), s.width, s.height, s.center_crop, index)
        pixels = frames_to_tensor(frames, False)
        out = {"pixel_values": pixels, "caption": clip.caption, "index": index}
        if s.audio_rate:
            from runner.data.audio import decode_audio

            start = frame_indices[0] / float(clip.fps or s.fps or 24.0)  # a frames folder is at data.fps
            out["audio"] = decode_audio(self.audio_files[clip_i], s.audio_rate, start, s.audio_samples(), self._shown)
        return out

    def _find_audio(self) -> list[Path]:
        """Each kept clip's audio source, checked before step 1: a clip without one is an error naming it."""
        from runner.data.audio import audio_source, missing_audio

        found = []
        for clip in self.clips:
            source = audio_source(clip.kind, clip.path)
            if source is None:
                raise missing_audio(clip.path, self._shown)
            found.append(source)
        return found

    def fingerprint(self, index: int) -> dict[str, Any]:
        """What sample ``index``'s pixels depend on, without decoding them (encoder-cache keys): the
        bytes of its file(s), which frames, and the settings."""
        clip_i, frame_indices = self.samples[index]
        clip, s = self.clips[clip_i], self.settings
        h = hashlib.sha256()
        for f in ([clip.files[i] for i in sorted(set(frame_indices))] if clip.kind == "frames" else [clip.path]):
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        fp: dict[str, Any] = {"sha256": h.hexdigest(), "frames": frame_indices, "settings": s.signature()}
        if not s.center_crop:
            fp["crop_index"] = index
        return fp

    def describe(self) -> str:
        s = self.settings
        kinds: dict[str, int] = {}
        for c in self.clips:
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
        extra = [", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))]
        if self.too_short:
            extra.append(f"{self.too_short} too short, skipped")
        skipped = [f"{n} {why}" for why, n in self.skipped.items() if n]
        if skipped:
            extra.append("skipped: " + ", ".join(skipped))
        if self.missing_captions:
            extra.append(f"{self.missing_captions} with empty captions")
        extra.append(f"frame_sampling={s.sampling}")
        rate = f" at {s.fps:g} fps" if s.fps else ""
        return (f"{len(self)} clip samples of {s.frames} frames{rate}, {s.width}x{s.height}, from folder "
                f"{str(self.root)!r} ({'; '.join(extra)})")


def trainer_class(cfg: Any) -> type | None:
    """The run's trainer class (not built); None if it cannot be imported (reported when it is built)."""
    from hydra.utils import get_class

    try:
        return get_class(str(cfg.trainer.get("_target_")))
    except Exception:  # noqa: BLE001 - an unimportable trainer is reported when it is built
        return None


def trainer_attribute(cfg: Any, name: str, default: Any) -> tuple[str, Any]:
    """The run's trainer class name and its class attribute ``name`` (``default`` if it has none)."""
    cls = trainer_class(cfg)
    return ("the trainer", default) if cls is None else (cls.__name__, getattr(cls, name, default))


def trainer_video_defaults(cfg: Any) -> tuple[Any, ...] | None:
    """``(frames, fps)`` defaults of the run's trainer when it trains on video (its class has
    ``video_defaults(cfg)``), else None: then ``data.path`` is read as images."""
    cls = trainer_class(cfg)
    fn = getattr(cls, "video_defaults", None)
    return fn(cfg) if callable(fn) else None


def check_frame_counts(dataset: Any, batch_size: int) -> None:
    """A batch stacks its samples, so they must share a frame count: one-frame images beside longer
    clips need ``train.batch_size=1`` (the runner does not group samples by frame count)."""
    counts = getattr(dataset, "frame_counts", None) or []
    if len(counts) > 1 and batch_size > 1:
        raise UserError(
            f"data.path={getattr(dataset, '_shown', '?')!r} mixes samples of {', '.join(map(str, counts))} frames "
            f"(images are one-frame clips), and train.batch_size={batch_size} would stack them into one batch. "
            "Use train.batch_size=1 (train.grad_accum cannot help: it splits a stacked batch), or train images and "
            "clips in separate runs.")
