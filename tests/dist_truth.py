"""One rank's plan against the same rank's real step: run with ``PYTHONPATH=tests torchrun --nproc_per_node=N
-m dist_truth OUT_DIR override...`` (tests/runner/plan/test_dist_plan.py does), once per ``dist=`` in
``RUNNER_TRUTH_DISTS`` (default ``ddp,fsdp``), in the same processes.

Not a test module (no ``test_`` prefix). Each rank composes the run from the overrides, plans its
own step (``plan_step(cfg, run=run)``: the per-rank plan of runner/plan/dist.py), then sets up the
real run as runner/__main__.py and runner/loop.py do (models, plugins, DDP or FSDP2, optimizer) and
runs two optimizer steps with the loop's own passes, agreement and gradient synchronisation under
a LiveBytesTracker; the figures of step 2 (optimizer state exists, as for the rest of a run) go to
``OUT_DIR/<dist>-rank-<r>.json`` beside the plan's.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def main() -> None:
    import os

    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    for name in os.environ.get("RUNNER_TRUTH_DISTS", "ddp,fsdp").split(","):
        one(out, [f"dist={name}", *overrides], name)


def one(out: Path, overrides: list[str], label: str) -> None:
    from planner_truth import tracked_steps  # tests/ is on the path (PYTHONPATH=tests)

    from runner.parts import (
        build_plugins,
        build_trainer,
        make_context,
        prepare_models,
    )
    from runner.cli.compose import compose_config
    from runner.checks import validate
    from runner.distributed.launch import join_process_group
    from runner.loop import forward_backward
    from runner.optim.build import build_optimizer
    from runner.optim.fused import fuse_into_backward
    from runner.plan import plan_step
    from runner.resolved import resolve
    from runner.session import make_accelerator

    torch.set_num_threads(1)
    world = join_process_group()
    cfg = compose_config(["train.device=cpu", "train.progress=false", *overrides])
    validate(cfg)
    run = resolve(cfg)
    plan = plan_step(cfg, run=run)

    trainer = build_trainer(cfg, run)
    ctx = make_context(cfg, run, build_plugins(cfg, run), None)
    ctx.trainer = trainer
    torch.manual_seed(0)
    ctx.models = prepare_models(trainer.build_models("cpu"), cfg.model, run)
    ctx.accelerator = make_accelerator(run)
    ctx.apply_setup_phases()
    ctx.dist.prepare_models(ctx)
    params = list(ctx.models.trainable_parameters())
    ctx.optimizer = build_optimizer(cfg.optimizer, params)
    ctx.run_phase("wrap_optimizer")
    ctx.optimizer = fuse_into_backward(ctx.optimizer, cfg.optimizer, run, agree=ctx.dist.all_agree)  # as session.py
    for name, m in ctx.models.items():
        m.train(name in ctx.models.trained)
    raw_all = trainer.example_raw_batch(run.batch_size, "cpu")
    indices = list(range(run.batch_size))
    _, seeds = ctx.dist.shard(indices, raw_all["sample_seed"])
    lo = world.rank * run.rank_batch if run.dist.active else 0
    raw = {k: (v[lo:lo + run.rank_batch] if isinstance(v, (torch.Tensor, list)) else v) for k, v in raw_all.items()}
    raw["sample_seed"] = seeds

    def passes(phases: object) -> None:  # the loop's passes inside the ranks' agreement
        ctx.dist.attempts(lambda m: forward_backward(ctx, raw, m, phases))(run.micro_batch)

    tracker = tracked_steps(ctx, params, raw, cfg.train.max_grad_norm, passes, set_to_none=ctx.dist.grads_to_none)
    real = tracker.snapshot()["devices"]["cpu"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{label}-rank-{world.rank}.json").write_text(json.dumps({
        "rank": world.rank, "world": world.world_size,
        "plan_peak": plan.peak_bytes, "plan_phases": plan.phases, "plan_by_module": plan.by_module,
        "real_peak": real["peak_bytes"], "real_phases": real["peak_by_phase"],
        "real_by_category": real["peak_by_category"], "real_phase": real["peak_phase"],
    }, indent=2))


if __name__ == "__main__":
    main()
