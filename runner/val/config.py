"""The ``val.*`` / ``data.val_*`` schema and checks, without torch (runner/val/holdout.py is the
held-out loss itself).

Split from runner/val/holdout.py so that composing a run, ``--help`` and a config error never wait
for torch; the scan of a ``data.val_path`` folder (which imports the data code) is
:func:`check_val_path`, called by runner/checks.py's ``check_run`` beside ``data.path``'s.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

from runner.errors import UserError


@dataclass
class ValConfig:
    """``val.*``: when and how the held-out loss of ``data.val_fraction`` / ``data.val_path`` is evaluated."""

    every: int = 0  # optimizer steps between evaluations; 0: only after the last step
    batch_size: Optional[int] = None  # held-out samples per forward; default: the training micro-batch
    seed: int = 0  # fixes the split and each held-out sample's noise and timestep, whatever train.seed


def val_source(cfg: Any) -> tuple[float, Optional[str]]:
    data = cfg.get("data")
    return float(data.get("val_fraction", 0.0) or 0.0), data.get("val_path")


def check_val_config(cfg: Any) -> None:
    """Values of ``data.val_*`` and ``val.*``; a UserError naming the key (the ``data.val_path``
    folder's contents: :func:`check_val_path`)."""
    fraction, path = val_source(cfg)
    v = cfg.get("val")
    if not 0.0 <= fraction < 1.0:
        raise UserError(f"data.val_fraction={fraction!r} is not valid: give the share of the data set to hold out "
                        "for the validation loss, from 0 (none) to below 1 (e.g. 0.1).")
    if fraction > 0 and path is not None:
        raise UserError(f"data.val_fraction={fraction} and data.val_path={path!r} are both set: hold out part of "
                        "data.path (data.val_fraction) or use a separate folder (data.val_path), not both.")
    if v is None:
        return
    if int(v.every) < 0:
        raise UserError(f"val.every={v.every} is not valid: give the optimizer steps between evaluations of the "
                        "validation loss (e.g. 100), or 0 for one evaluation after the last step.")
    if v.batch_size is not None and int(v.batch_size) < 1:
        raise UserError(f"val.batch_size={v.batch_size} is not valid: give the held-out samples per forward pass "
                        "(at least 1), or leave it unset for the training micro-batch.")
    if not 0 <= int(v.seed) < 2**63:
        raise UserError(f"val.seed={v.seed} is not valid: give a whole number >= 0.")
    if int(v.every) > 0 and fraction == 0 and path is None:
        raise UserError(f"val.every={v.every} asks for a validation loss, but no data is held out: set "
                        "data.val_fraction=0.1 (hold out 10 % of data.path) or data.val_path=<folder of images with "
                        "captions>.")


def check_val_path(cfg: Any) -> None:
    """``mode=train`` with ``data.val_path``: the folder is scanned and checked now, before any
    model is built (imports the data code, so runner/checks.py calls it in ``check_run``)."""
    path = val_source(cfg)[1]
    if path is not None and cfg.get("mode") == "train":
        from runner.data import build_dataset

        with as_val_path():
            build_dataset(_with_path(cfg.data, str(path)))  # the folder's checks, before any model is built


@contextmanager
def as_val_path() -> Iterator[None]:
    """The data folder's own messages, naming the key the folder came from (data.val_path)."""
    try:
        yield
    except UserError as e:
        text = str(e).replace("data.path", "data.val_path")
        raise UserError(text.replace("to use the built-in demo set", "to hold out nothing")) from None


def _with_path(data_cfg: Any, path: str) -> Any:
    data = copy.deepcopy(data_cfg)
    data.path = path
    if hasattr(data, "get") and data.get("demo_prior"):  # the demo's prior set is training data, not held out
        data.demo_prior = 0
    return data
