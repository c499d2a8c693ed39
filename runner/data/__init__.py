"""Training data: a folder of captioned images, or a built-in procedural demo set.

``build_dataset(cfg.data)`` returns a map-style :class:`torch.utils.data.Dataset` whose samples
are ``{"pixel_values": float32 [3, R, R] in [-1, 1], "caption": str, "index": int}``. The runner
owns sample order and batching (it calls ``ds[i]`` and :func:`collate`), so everything here is a
pure function of the index: the same index always yields the same tensor, in any process, in any
epoch. That is what makes runs resumable and micro-batch splits invisible, and it is why the
augmentations are *deterministic per index* rather than drawn from a global RNG.

The package: :mod:`runner.data.folder` (a folder of images with .txt captions),
:mod:`runner.data.demo` (the built-in coloured shapes), :mod:`runner.data.images` (decoding,
resize/crop, flips, per-index randomness) and :mod:`runner.data.checks` (``data.*`` values).

Errors a user can cause (missing folder, no images, missing or non-UTF-8 captions, unreadable
images, bad ``data.*`` values) raise :class:`runner.errors.UserError` naming the key and file.
"""
from __future__ import annotations


from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from runner.data.checks import _check_missing_caption, _check_resolution, _get
from runner.data.demo import DemoDataset
from runner.data.folder import FolderDataset
from runner.errors import UserError

__all__ = ["DemoDataset", "FolderDataset", "build_dataset", "build_video_dataset", "check_dataset", "collate",
           "describe_dataset"]


def build_dataset(data_cfg: Any) -> Dataset:
    """Build the training dataset described by ``cfg.data`` (a DataConfig or a DictConfig).

    ``data_cfg.path`` None -> :class:`DemoDataset` (no files, no download); otherwise
    :class:`FolderDataset`. All ``data.*`` values are validated here, before any file is read,
    so a typo fails in milliseconds.
    """
    resolution = _check_resolution(_get(data_cfg, "resolution", 64))
    missing_caption = _check_missing_caption(_get(data_cfg, "missing_caption", "error"))
    center_crop = bool(_get(data_cfg, "center_crop", True))
    random_flip = bool(_get(data_cfg, "random_flip", False))
    path = _get(data_cfg, "path", None)

    if path is None:
        demo_size = _get(data_cfg, "demo_size", 16)
        if isinstance(demo_size, bool) or not isinstance(demo_size, int) or demo_size < 1:
            raise UserError(
                f"data.demo_size={demo_size!r} is not valid: it is the number of images in the "
                "built-in demo set (used because data.path is unset) and must be a whole number "
                "of at least 1, e.g. data.demo_size=16."
            )
        return DemoDataset(demo_size, resolution, random_flip=random_flip)

    handed_over = _CHECKED.pop(_folder_key(data_cfg), None)
    if handed_over is not None:
        return handed_over
    return FolderDataset(path, resolution, center_crop=center_crop, random_flip=random_flip,
                         missing_caption=missing_caption)


def check_dataset(data_cfg: Any, video: Any = None) -> None:
    """Build the folder data set during validation, so that a broken image or caption fails before
    the plan and the model build, and hand it to the next :func:`build_dataset` of the same settings
    (the trainer's, seconds later) so the scan and header checks run once. Handed over once only:
    later builds read the folder again, so edits between runs of one process are seen.

    ``video``: a video trainer's ``(default_frames, default_fps)`` (its ``video_defaults``): the
    folder is read as clips (:func:`build_video_dataset`) instead of images."""
    from runner.data.video import check_video_keys

    check_video_keys(data_cfg)
    if _get(data_cfg, "path", None) is None:
        return
    _CHECKED.clear()
    if video is not None:
        _CHECKED[_folder_key(data_cfg, video)] = build_video_dataset(data_cfg, *video)
    else:
        _CHECKED[_folder_key(data_cfg)] = build_dataset(data_cfg)


def build_video_dataset(data_cfg: Any, default_frames: int, default_fps: float | None) -> Dataset:
    """The clips of ``cfg.data`` for a video trainer (runner/data/video.py): ``data.path``'s clips,
    or the built-in moving shapes. ``default_frames``/``default_fps``: the trainer's values for an
    unset ``data.frames``/``data.fps``."""
    from runner.data.demo_video import DemoClips
    from runner.data.video import ClipFolderDataset, check_video_keys, clip_settings

    check_video_keys(data_cfg)
    _check_resolution(_get(data_cfg, "resolution", 64))
    settings = clip_settings(data_cfg, default_frames, default_fps)
    path = _get(data_cfg, "path", None)
    if path is None:
        demo_size = _get(data_cfg, "demo_size", 16)
        if isinstance(demo_size, bool) or not isinstance(demo_size, int) or demo_size < 1:
            raise UserError(f"data.demo_size={demo_size!r} is not valid: it is the number of clips in the built-in "
                            "demo set (used because data.path is unset) and must be a whole number of at least 1.")
        return DemoClips(demo_size, settings)
    handed_over = _CHECKED.pop(_folder_key(data_cfg, (default_frames, default_fps)), None)
    if handed_over is not None:
        return handed_over
    return ClipFolderDataset(path, settings, missing_caption=_check_missing_caption(_get(data_cfg, "missing_caption",
                                                                                              "error")))


_CHECKED: dict[tuple, FolderDataset] = {}


def _folder_key(data_cfg: Any, video: Any = None) -> tuple:
    keys = ("path", "resolution", "center_crop", "random_flip", "missing_caption")
    if video is not None:
        keys += ("frames", "fps", "frame_sampling", "width", "height")
    return (*(str(_get(data_cfg, k, None)) for k in keys), str(video))


def collate(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Merge per-sample dicts into one batch dict.

    Tensors are stacked (they must share a shape), Python ints become an int64 tensor, and
    everything else (captions) stays a list in sample order. The runner adds ``sample_seed``.
    """
    if not samples:
        raise ValueError("collate() needs at least one sample")
    keys = list(samples[0])
    for s in samples[1:]:
        if set(s) != set(keys):
            raise ValueError(f"collate(): samples have different keys: {sorted(keys)} vs {sorted(s)}")
    batch: dict[str, Any] = {}
    for key in keys:
        values = [s[key] for s in samples]
        first = values[0]
        if isinstance(first, torch.Tensor):
            batch[key] = torch.stack(values)
        elif isinstance(first, int) and not isinstance(first, bool):
            batch[key] = torch.tensor(values, dtype=torch.int64)
        else:
            batch[key] = list(values)
    return batch


def describe_dataset(ds: Any) -> str:
    """One line for the run log: how many samples, at what resolution, from where."""
    describe = getattr(ds, "describe", None)
    if callable(describe):
        return describe()
    try:
        n = len(ds)
    except TypeError:
        n = "?"
    return f"{n} samples from {type(ds).__name__}"
