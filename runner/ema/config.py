"""The ``ema.*`` schema and its checks, without torch (runner/ema/average.py is the average itself).

Split from runner/ema/average.py so that composing a run, ``--help`` and a config error never wait for
torch (runner/checks.py fast path).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.errors import UserError, valid_list

DEVICES = ("device", "cpu")
DTYPES = ("float32", "bfloat16")


@dataclass
class EMAConfig:
    """``ema.*``: an exponential moving average of the trained weights (module docstring)."""

    enabled: bool = False  # keep the average, save it in checkpoints, export it beside the weights
    decay: float = 0.9999  # per update: ema = decay * ema + (1 - decay) * weights
    warmup: bool = True  # the k-th update (k = 0, 1, ...) uses min(decay, (1 + k) / (10 + k))
    every: int = 1  # update after every N-th optimizer step
    start: int = 0  # the optimizer step after which the average starts (the copy is set to the weights there)
    device: str = "device"  # device: beside each trained weight | cpu: in host RAM (saves the device the copy)
    dtype: str = "float32"  # float32 | bfloat16 (only with model.train_dtype=bfloat16; see the module docstring)


def check_ema_config(cfg: Any) -> None:
    """Values of ``ema.*`` the schema cannot check; a UserError naming the key."""
    c = cfg.get("ema")
    if c is None or not c.enabled:
        return
    if str(c.device) not in DEVICES:
        raise UserError(f"ema.device={c.device!r} is not valid. Valid values: {valid_list(str(c.device), DEVICES)} "
                        "(device: beside each trained weight; cpu: in host RAM).")
    if str(c.dtype) not in DTYPES:
        raise UserError(f"ema.dtype={c.dtype!r} is not valid. Valid values: {valid_list(str(c.dtype), DTYPES)}.")
    if not 0.0 < float(c.decay) < 1.0:
        raise UserError(f"ema.decay={c.decay!r} is not valid: give a number between 0 and 1, exclusive (0.9999 "
                        "averages over about 10 000 updates, 0.999 over about 1 000).")
    if int(c.every) < 1:
        raise UserError(f"ema.every={c.every!r} is not valid: give the optimizer steps between updates, at least 1.")
    if int(c.start) < 0:
        raise UserError(f"ema.start={c.start!r} is not valid: give the optimizer step after which the average "
                        "starts, 0 or more (0: from the first step).")
    if int(c.start) >= int(cfg.train.steps):
        raise UserError(f"ema.start={c.start} is not before the last step (train.steps={cfg.train.steps}): the average "
                        "would never start. Give an earlier step, or 0 to average from the first step.")
    if str(c.dtype) == "bfloat16" and str(cfg.model.get("train_dtype", "float32")) != "bfloat16":
        raise UserError(
            f"ema.dtype=bfloat16 with model.train_dtype={cfg.model.get('train_dtype')}: an average in a lower "
            "precision than the weights it averages loses most updates (1 - decay is below bfloat16's resolution). "
            "Keep ema.dtype=float32, or train bfloat16 weights (model.train_dtype=bfloat16).")
