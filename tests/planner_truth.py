"""The planner's truth check, shared by test_planner.py and test_any_trainer.py: a plan against a real step.

Not a test module (no ``test_`` prefix); pytest puts tests/ on ``sys.path``, so test files import it
by name. On tiny models the planner's steady-state peak is compared with a LiveBytesTracker on a
real CPU run of the same step (the loop's own forward_backward, same plugins, same batch), over
the second step, when optimizer state exists as it does for the rest of a run. One copy, so a
trainer the planner was not written for is held to exactly the bar of the built-in ones.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from runner.parts import build_plugins, build_trainer, make_context, prepare_models
from runner.loop import forward_backward
from runner.memory.live_bytes import LiveBytesTracker
from runner.optim.build import build_optimizer
from runner.plan import plan_step
from runner.resolved import resolve
from runner.session import make_accelerator


class _Phases:
    """The profiler interface runner.loop.forward_backward expects, backed by a tracker."""

    def __init__(self, tracker: LiveBytesTracker) -> None:
        self.tracker = tracker

    def phase(self, name: str) -> Any:
        return self.tracker.phase(name)


def prepared_step(cfg: Any, trainer: Any = None, configure_process: bool = False) -> tuple[Any, list, dict, int]:
    """The loop's setup of a real run (models, plugins, optimizer) and the step's raw batch."""
    run = resolve(cfg)
    trainer = trainer if trainer is not None else build_trainer(cfg, run)
    ctx = make_context(cfg, run, build_plugins(cfg, run), None)
    if configure_process:
        ctx.run_phase("configure_process")
    ctx.trainer = trainer
    torch.manual_seed(0)
    ctx.models = prepare_models(trainer.build_models("cpu"), cfg.model, run)  # dtypes, LoRA: as runner/__main__
    ctx.accelerator = make_accelerator(run)
    ctx.apply_setup_phases()
    params = list(ctx.models.trainable_parameters())
    ctx.optimizer = build_optimizer(cfg.optimizer, params)
    ctx.run_phase("wrap_optimizer")
    for name, m in ctx.models.items():
        m.train(name in ctx.models.trained)
    batch, micro = run.batch_size, run.micro_batch
    raw_fn = getattr(trainer, "example_raw_batch", None)
    raw = raw_fn(batch, "cpu") if callable(raw_fn) else trainer.example_batch(batch, "cpu")
    return ctx, params, raw, micro


def tracked_steps(ctx: Any, params: list, raw: dict, max_grad_norm: float, passes: Callable[[Any], None],
                  set_to_none: bool = True) -> LiveBytesTracker:
    """Two optimizer steps under a LiveBytesTracker, its peaks reset for the second; then teardown.

    ``passes(phases)`` runs one step's forward and backward passes (the loop's
    ``forward_backward``, directly or inside the distributed agreement), ``phases`` being the
    profiler interface it expects. Shared with tests/dist_truth.py.
    """
    tracker = LiveBytesTracker()
    for name, m in ctx.models.items():
        tracker.track(m, "weights", module=name)
    tracker.track({k: v for k, v in raw.items() if isinstance(v, torch.Tensor)}, "other")
    try:
        with tracker:
            for step in range(2):
                if step == 1:
                    tracker.reset_peaks()
                passes(_Phases(tracker))
                with tracker.phase("optimizer"):
                    if max_grad_norm > 0:
                        ctx.accelerator.clip_grad_norm_(params, max_grad_norm)
                    ctx.optimizer.step()
                ctx.optimizer.zero_grad(set_to_none=set_to_none)
    finally:
        ctx.teardown()
    return tracker


def real_step(cfg: Any, trainer: Any = None) -> dict[str, Any]:
    """Two real optimizer steps on the CPU with the loop's code; the tracker's figures of step 2."""
    ctx, params, raw, micro = prepared_step(cfg, trainer)
    tracker = tracked_steps(ctx, params, raw, cfg.train.max_grad_norm,
                            lambda phases: forward_backward(ctx, raw, micro, phases))
    out = tracker.snapshot()["devices"]["cpu"]
    out["batch_bytes"] = sum(v.numel() * v.element_size() for v in raw.values() if isinstance(v, torch.Tensor))
    return out


def assert_plan_matches_a_real_cpu_step(cfg: Any) -> None:
    """``plan_step(cfg)`` on the CPU agrees with a real step of ``cfg`` within 5 % (``cfg`` has train.device=cpu)."""
    plan = plan_step(cfg)
    real = real_step(cfg)
    assert plan.target == "cpu" and plan.margin_bytes == 0
    assert plan.peak_bytes == pytest.approx(real["peak_bytes"], rel=0.05), (plan.peak_phase, real["peak_phase"])
    if "offload" not in plan.run["plugins"]:
        # Without parking, every tensor a CPU run holds is on the planner's device too, so each
        # phase agrees, not only the maximum. (Parked weights are on the planner's host but on
        # the CPU run's only device.)
        for phase in ("forward", "backward"):
            assert plan.phases[phase] == pytest.approx(real["peak_by_phase"][phase], rel=0.05), phase
        assert plan.by_category["weights"] == real["peak_by_category"]["weights"]
        # The optimizer's simulation allocates its state, not the temporaries of AdamW's update
        # (sqrt and division of one parameter's moment at a time: two parameter-sized tensors);
        # the CPU run's raw batch lives on its only device through the optimizer step (on a GPU
        # it is on the host); and the loop still holds a few small tensors of the step (< 1 %).
        run = resolve(cfg)
        models = prepare_models(build_trainer(cfg, run).build_models("meta"), cfg.model, run)
        largest = max(p.numel() * p.element_size() for p in models.trainable_parameters())
        gap = real["peak_by_phase"]["optimizer"] - plan.phases["optimizer"]
        assert 0 <= gap <= 2 * largest + real["batch_bytes"] + 0.01 * real["peak_bytes"], (gap, largest)
