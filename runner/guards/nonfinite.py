"""A NaN or inf loss or gradient: skip the update, or stop with a clear reason (``train.on_nonfinite``).

Why a guard at all: one non-finite gradient turns every trained weight into NaN at the next
optimizer step, and from then on the run trains nothing while looking busy (and would end ``ok``
with a checkpoint in which every tensor is NaN). The guard looks at
the step's loss and its gradient norm before the optimizer steps:

* ``skip`` (the default): the update is not applied; the step still counts (its samples are
  consumed, the LR schedule advances), like a step the fp16 grad scaler skips, so the sample
  order and resume stay exact. After ``train.nonfinite_patience`` consecutive skipped steps the
  run stops: something is wrong with the data, the learning rate or the weights, not a one-off.
* ``stop``: the first non-finite step stops the run.

Either way the weights are those of the last good update, so the loop saves them and the run
ends with status ``nonfinite`` and exit code 4, naming the step and the likely causes.

The cost: the gradient norm. When clipping is on (``train.max_grad_norm>0``) it is computed
anyway and reused; with clipping off the guard computes it (one pass over the gradients).
With an fp16 grad scaler, inf gradients are routine (the scaler lowers its scale and skips the
step itself), so under fp16 the guard only counts non-finite losses and leaves skipping to the
scaler: calling the optimizer is what lets the scaler update.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch

from runner.compat import foreach_norm
from runner.constants import NONFINITE_POLICIES
from runner.errors import ResumableStop

log = logging.getLogger("runner")

NONFINITE_EXIT_CODE = 4
POLICIES = NONFINITE_POLICIES  # train.on_nonfinite (listed in runner/config/__init__.py: validation reads it without torch)


class NonFiniteStop(ResumableStop):
    """The run stopped on a non-finite loss, gradient or weight; exit status 4."""

    exit_code = NONFINITE_EXIT_CODE
    status = "nonfinite"
    kept = "The weights at step {steps} (finite: no non-finite update was applied) are saved in {checkpoint}"
    nothing_saved = "No good step had completed, so nothing was saved."


def likely_causes(lr: float | None, precision: str) -> str:
    causes = [f"a learning rate too high for this model (optimizer.lr={lr})" if lr is not None
              else "a learning rate too high for this model (optimizer.lr)"]
    if precision == "fp16":
        causes.append("fp16 overflow (train.mixed_precision=bf16 has fp32's range)")
    causes += ["a corrupt image, caption or encoder-cache entry",
               "non-finite values in the weights loaded from model.path"]
    return "; ".join(causes)


def norms_by_group(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each tensor's 2-norm in float32, grouped by device and dtype: one multi-tensor norm kernel per group,
    not a cast and a norm per tensor (and no float32 copy of a bf16 tensor)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return [foreach_norm(ts, 2.0, dtype=torch.float32) for ts in groups.values()]


def grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    """The total 2-norm of the gradients in float32 (None when no parameter has one)."""
    norms = [n for group in norms_by_group(p.grad for p in params if p.grad is not None) for n in group]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else None


class NonFiniteGuard:
    """Decides per step whether the update may be applied; see the module docstring."""

    def __init__(self, policy: str, patience: int, *, scaler_active: bool, lr: float | None, precision: str) -> None:
        self.policy = policy
        self.patience = max(1, int(patience))
        self.scaler_active = scaler_active
        self.causes = likely_causes(lr, precision)
        self.consecutive = 0
        self.total = 0  # steps whose update was skipped (or, under fp16, whose loss was non-finite)
        self.applied = True  # whether the last step's update was let through (runner/ema/average.py averages only those)

    @property
    def needs_grad_norm(self) -> bool:
        return not self.scaler_active

    def allow_update(self, step: int, loss: float, norm: torch.Tensor | float | None) -> bool:
        """True: apply this step's update. False: skip it. Raises :class:`NonFiniteStop`."""
        bad_loss = not math.isfinite(loss)
        bad_grad = self.needs_grad_norm and norm is not None and not math.isfinite(float(norm))
        self.applied = True
        if not (bad_loss or bad_grad):
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.total += 1
        what = f"the loss is {loss}" if bad_loss else f"the gradient norm is {float(norm)}"
        if self.policy == "stop" or self.consecutive >= self.patience:
            run_of = (f" ({self.consecutive} consecutive non-finite steps, train.nonfinite_patience={self.patience})"
                      if self.policy == "skip" else " (train.on_nonfinite=stop)")
            raise NonFiniteStop(
                f"Training stopped at step {step}: {what}{run_of}. Likely causes: {self.causes}. The update of "
                "this step was not applied, so the weights are finite.", step=step)
        if self.scaler_active:  # the fp16 scaler skips the step itself and lowers its scale
            log.warning("step %d: %s; the fp16 grad scaler skips this update", step, what)
            return True
        log.warning("step %d: %s; update skipped (%d in a row; the run stops at %d, train.nonfinite_patience)",
                    step, what, self.consecutive, self.patience)
        self.applied = False
        return False


def check_finite_weights(state: dict[str, torch.Tensor], step: int) -> None:
    """Refuse to save weights that hold NaN or inf: a checkpoint must be something to go back to."""
    bad = [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise NonFiniteStop(
            f"At step {step}, {len(bad)} trained parameters hold NaN or inf (e.g. {bad[:3]}), so they were not saved "
            "as a checkpoint. Likely causes: a learning rate too high, fp16 overflow, a corrupt input, or "
            "non-finite weights in model.path.", step=step)
