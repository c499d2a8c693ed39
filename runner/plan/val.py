"""The planner's view of the held-out validation loss (``data.val_*``, ``val.*``; runner/val/holdout.py).

Can it raise the peak? The pass runs between optimizer steps, after the gradients are freed,
and is a forward without grad: the training step's own encode and forward at the same batch
keep at least everything a no-grad forward allocates (plus the saved activations and, in
backward, the gradients). So at a validation batch no larger than the training micro-batch it
cannot exceed the training step's peak, and it is not simulated (the plan says so). With
``val.batch_size`` above the micro-batch its activations may be larger: then one no-grad encode
and forward at that batch is simulated after the optimizer step, like the sampling pass
(runner/plan/sampling.py), with what lives between steps (weights, optimizer state, an EMA)
live during it; the phase ``validation`` joins ``Plan.phases`` and the plan's peak.

Not planned: the one-off encode of a ``data.val_path`` folder at start, which runs before the
plugins, one encode part's modules on the device at a time (below the training step's encode,
which holds all of them) when its batch is the micro-batch; its results are host RAM.
"""
from __future__ import annotations

from typing import Any

import torch

PHASE = "validation"


def _val_batch(sim: Any) -> int | None:
    """The validation micro-batch of ``sim``'s run, or None when nothing is held out."""
    cfg = sim.cfg
    data = cfg.get("data") if hasattr(cfg, "get") else None
    if data is None or (not float(data.get("val_fraction", 0.0) or 0.0) and data.get("val_path") is None):
        return None
    v = cfg.get("val")
    size = v.get("batch_size") if v is not None else None
    return int(size) if size is not None else sim.micro


class NoValidationPlan:
    """No held-out data, or a validation pass that cannot raise the peak (then ``report`` says why)."""

    def __init__(self, batch: int | None = None, micro: int | None = None) -> None:
        self.batch, self.micro = batch, micro

    def simulate(self) -> None:
        pass

    def report(self, plan: Any) -> None:
        if self.batch is None:
            return
        plan.validation = {
            "planned": False, "batch_size": self.batch, "training_micro_batch": self.micro,
            "why": "a no-grad forward between steps at a batch no larger than the training micro-batch stays below "
                   "the training step's peak",
        }


class ValidationPlan:
    """One no-grad encode + forward at ``val.batch_size``, between steps (see the module docstring)."""

    def __init__(self, sim: Any, batch: int) -> None:
        self.sim, self.batch = sim, batch
        self.between_steps = 0

    def simulate(self) -> None:
        self.sim.timed(PHASE, self._run)

    def _run(self) -> None:
        from runner.plan.batch import (
            encode_batch,
            example_batch,
            fake_batch,
            move_batch,
        )
        from runner.plan.target import DEVICE, HOST
        from runner.plan.known_values import known_values

        sim = self.sim
        tracker, ctx, trainer = sim.tracker, sim.ctx, sim.trainer
        tracker.reset_peaks()  # from what lives between steps
        self.between_steps = tracker.current_bytes(DEVICE.type)
        shapes = {part: {k: ((self.batch, *shape[1:]), dtype) for k, (shape, dtype) in per.items()}
                  for part, per in sim.part_shapes.items()}  # cached parts at the validation batch
        with known_values():  # masks keep their values from the move to the loss (runner/plan/known_values.py)
            batch = move_batch(fake_batch(example_batch(trainer, sim.raw, self.batch), HOST), DEVICE)
            tracker.track(batch, "other", module="(batch)")
            with tracker.phase(PHASE, category="activations"), torch.no_grad(), ctx.step_context(), \
                    ctx.accelerator.autocast():
                enc = encode_batch(trainer, ctx.models, batch, sim.cached, shapes) if sim.raw else batch
                trainer.loss(ctx.models, enc)
                del enc, batch
        sim.recorder.take(PHASE)

    def report(self, plan: Any) -> None:
        peak = plan.phases.get(PHASE)
        if peak is None:
            return
        plan.validation = {
            "planned": True, "batch_size": self.batch, "training_micro_batch": self.sim.micro, "peak_bytes": peak,
            "between_steps_bytes": self.between_steps,  # of peak_bytes: what lives anyway; the rest is validation's
        }


def plan_validation(sim: Any) -> ValidationPlan | NoValidationPlan:
    """The validation pass of ``sim``'s run when it can raise the peak, else a no-op that reports why."""
    batch = _val_batch(sim)
    if batch is None or batch <= sim.micro:
        return NoValidationPlan(batch, sim.micro)
    return ValidationPlan(sim, batch)
