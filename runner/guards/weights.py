"""Weights that blew up: a step whose update made the trained weights grow past a bound is a
non-finite step (``train.max_weight_growth``).

Why: a finite loss does not mean finite progress. After ``optimizer.lr=1e30`` step 1's loss is
finite and its update is applied, so the weights reach ~1e30 and stay finite in float32; the loss
turns NaN steps later, and a checkpoint saved meanwhile holds those weights. So after each
update the loop measures the trained weights' RMS (their 2-norm over the root of their count) on
the card and reads that one number per step. The update blew the weights up when the RMS is not
finite or grew more than ``max_weight_growth``-fold in one step, measured from at least
``RMS_FLOOR`` (weights that start at zero, as adapters' may, can grow from nothing). Ordinary
training moves the RMS by well under 1 % a step; a learning rate many orders too high multiplies it.

The update is already applied and cannot be undone (that would take a copy of every weight), so
such a step always stops the run, saves nothing, and points at the last checkpoint whose weights
passed this check (every checkpoint this run saved, and the one it resumed from), or says there is none.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from runner.guards.nonfinite import NonFiniteStop, norms_by_group

log = logging.getLogger("runner")

RMS_FLOOR = 0.01  # the smallest RMS growth is measured from: zero-initialised weights may reach it in one step


class WeightsBlewUp(NonFiniteStop):
    """The last update blew the weights up; nothing is saved, the stop names the last sane checkpoint."""

    kept = "The last checkpoint whose weights are sane is step {steps}'s, in {checkpoint}"
    advice = "with a lower optimizer.lr"
    nothing_saved = ("No checkpoint with sane weights exists for this run (none was saved before this step), so "
                     "there is nothing to resume: start again with a lower optimizer.lr.")


def weight_rms(params: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The RMS of every element of ``params``, as a 0-dim float32 tensor on ``device`` (no host read).
    Parameters on several devices (streamed or host-offloaded ones) are summed per device first; under
    dist=fsdp each rank measures its own shards (and every rank stops if one sees a blow-up)."""
    if not params:
        return None
    local = [p.detach().to_local() if callable(getattr(p, "to_local", None)) else p.detach() for p in params]  # fsdp: shards
    squares = [torch.stack(norms).square().sum().to(device) for norms in norms_by_group(local)]
    count = sum(t.numel() for t in local)
    return (torch.stack(squares).sum() / max(count, 1)).sqrt()


class WeightGuard:
    """Reads the trained weights' RMS once per step and stops on a blow-up; see the module docstring."""

    def __init__(self, growth: float, params: Sequence[torch.Tensor], device: torch.device, lr: float | None = None,
                 agree: Callable[[bool], bool] = lambda ok: ok) -> None:
        self.growth = float(growth)
        self.lr = lr
        self.agree = agree  # several processes: every rank stops if one sees a blow-up (FSDP ranks hold shards)
        self.params = list(params)
        self.device = device
        self.rms: float | None = None  # the last step's (or the start's) weight RMS
        self.sane: tuple[Path, int] | None = None  # (checkpoint, step) of the last weights that passed

    @property
    def enabled(self) -> bool:
        return self.growth > 0 and bool(self.params)

    def start(self, resumed: Path | None, step: int) -> None:
        """The RMS before the first step (one read at setup); a resumed checkpoint is the first sane one."""
        if resumed is not None:
            self.sane = (resumed, step)
        if self.enabled:
            self.rms = float(weight_rms(self.params, self.device))
            log.info("train.max_weight_growth=%g: a step whose update grows the trained weights' RMS (now %.3g) more "
                     "than that in one step stops the run (0 turns the check off)", self.growth, self.rms)

    def saved(self, checkpoint: Path, step: int) -> None:
        self.sane = (checkpoint, step)

    def check(self, step: int) -> None:
        """After step ``step``'s update: raise :class:`WeightsBlewUp` if it blew the weights up."""
        if not self.enabled:
            return
        now = float(weight_rms(self.params, self.device))  # the step's one read of the weights
        before, self.rms = self.rms, now
        base = max(before or 0.0, RMS_FLOOR)
        if self.agree(math.isfinite(now) and now <= self.growth * base):
            return
        lr = f" (optimizer.lr={self.lr:g})" if self.lr is not None else ""
        raise WeightsBlewUp(
            f"Training stopped at step {step}: its update blew up the trained weights (their RMS went from "
            f"{before or 0.0:.3g} to {now:.3g}, past train.max_weight_growth={self.growth:g} times {base:.3g} in one "
            f"step), although its loss was finite. Likely cause: a learning rate too high for this model{lr}. The "
            "weights in memory are not saved.", step=step)
