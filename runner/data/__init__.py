"""Training data: a folder of captioned images, or a built-in procedural demo set.

``build_dataset(cfg.data)`` returns a map-style :class:`torch.utils.data.Dataset` whose samples
are ``{"pixel_values": float32 [3, R, R] in [-1, 1], "caption": str, "index": int}``. The runner
owns sample order and batching (it calls ``ds[i]`` and :func:`collate`), so everything here is a
pure function of the index: the same index always yields the same tensor, in any process, in any
epoch. That is what makes runs resumable and micro-batch splits invisible, and it is why the
augmentations are *deterministic per index* rather than drawn from a global RNG.

The package: :mod:`runner.data.folder` (a folder of images with .txt captions),
:mod:`runner.data.demo` (the built-in coloured shapes), :mod:`runner.data.images` (decoding,
resize/crop, per-index randomness), :mod:`runner.data.checks` (``data.*`` values) and
:mod:`runner.data.flip` (``data.random_flip``: decided per visit by the runner, not per index).

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

__all__ = ["DemoDataset", "FolderDataset", "build_dataset", "check_dataset", "collate", "describe_dataset"]


def build_dataset(data_cfg: Any) -> Dataset:
    """Build the training dataset described by ``cfg.data`` (a DataConfig or a DictConfig).

    ``data_cfg.path`` None -> :class:`DemoDataset` (no files, no download); otherwise
    :class:`FolderDataset`. All ``data.*`` values are validated here, before any file is read,
    so a typo fails in milliseconds.
    """
    resolution = _check_resolution(_get(data_cfg, "resolution", 64))
    missing_caption = _check_missing_caption(_get(data_cfg, "missing_caption", "error"))
    center_crop = bool(_get(data_cfg, "center_crop", True))
    path = _get(data_cfg, "path", None)

    if path is None:
        demo_size = _get(data_cfg, "demo_size", 16)
        if isinstance(demo_size, bool) or not isinstance(demo_size, int) or demo_size < 1:
            raise UserError(
                f"data.demo_size={demo_size!r} is not valid: it is the number of images in the "
                "built-in demo set (used because data.path is unset) and must be a whole number "
                "of at least 1, e.g. data.demo_size=16."
            )
        return DemoDataset(demo_size, resolution)

    handed_over = _CHECKED.pop(_folder_key(data_cfg), None)
    if handed_over is not None:
        return handed_over
    return FolderDataset(path, resolution, center_crop=center_crop, missing_caption=missing_caption)


def check_dataset(data_cfg: Any) -> None:
    """Build the folder data set during validation, so that a broken image or caption fails before
    the plan and the model build, and hand it to the next :func:`build_dataset` of the same settings
    (the trainer's, seconds later) so the scan and header checks run once. Handed over once only:
    later builds read the folder again, so edits between runs of one process are seen."""
    if _get(data_cfg, "path", None) is None:
        return
    _CHECKED.clear()
    _CHECKED[_folder_key(data_cfg)] = build_dataset(data_cfg)


_CHECKED: dict[tuple, FolderDataset] = {}


def _folder_key(data_cfg: Any) -> tuple:
    return tuple(str(_get(data_cfg, k, None)) for k in ("path", "resolution", "center_crop", "missing_caption"))


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
