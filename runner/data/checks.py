"""Checks of the ``data.*`` values, shared by :func:`runner.data.build_dataset` and the datasets.

Each bad value raises a :class:`runner.errors.UserError` that names the key and a valid example,
before any file is read, so a typo fails in milliseconds.
"""
from __future__ import annotations

from typing import Any

from runner.errors import UserError, valid_list


MISSING_CAPTION_MODES: tuple[str, ...] = ("error", "empty")


def _get(cfg: Any, key: str, default: Any) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _check_resolution(resolution: Any) -> int:
    ok = isinstance(resolution, int) and not isinstance(resolution, bool) and resolution > 0
    if ok and resolution % 8 == 0:
        return resolution
    if ok:
        lo, hi = resolution // 8 * 8, resolution // 8 * 8 + 8
        near = f"{hi}" if lo == 0 else f"{lo} or {hi}"
        hint = f", e.g. data.resolution={near}"
    else:
        hint = ", e.g. data.resolution=64 or 512"
    raise UserError(
        f"data.resolution={resolution!r} is not valid: it must be a positive whole number of "
        f"pixels that is a multiple of 8 (the VAE turns 8x8 pixels into one latent){hint}."
    )


def _check_missing_caption(value: Any) -> str:
    if value in MISSING_CAPTION_MODES:
        return value
    raise UserError(
        f"data.missing_caption={value!r} is not valid; valid values: "
        f"{valid_list(str(value), MISSING_CAPTION_MODES)} (error: stop when an image has no .txt "
        "caption; empty: use an empty caption for it)."
    )
