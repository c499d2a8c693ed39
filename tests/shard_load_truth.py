"""Each rank's host bytes while ``dist=fsdp`` loads the trained module: run with ``PYTHONPATH=tests
torchrun --nproc_per_node=N -m shard_load_truth OUT_DIR LABEL override...`` (tests/runner/distributed/test_sharded_load.py).

Not a test module (no ``test_`` prefix). Each rank sets up the run as runner/__main__.py does
(``build_models_for_rank``, the plugins' setup, then FSDP2's sharding, which fills the shards) under a
LiveBytesTracker and writes ``OUT_DIR/LABEL-rank-<r>.json``: the tracker's host peak, the bytes of the
frozen modules and of the trained module's buffers (held whole by every rank), the trained module's
weights whole and this rank's shards, and its largest tensor.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    from runner.parts import build_plugins, build_trainer, make_context, prepare_models
    from runner.cli.compose import compose_config
    from runner.checks import validate
    from runner.distributed.launch import join_process_group
    from runner.distributed.loading import build_models_for_rank
    from runner.memory.live_bytes import LiveBytesTracker
    from runner.resolved import resolve
    from runner.session import make_accelerator

    out, label, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    world = join_process_group()
    cfg = compose_config(["train.device=cpu", "train.progress=false", "dist=fsdp", *overrides])
    validate(cfg)
    run = resolve(cfg)
    ctx = make_context(cfg, run, build_plugins(cfg, run), None)
    ctx.trainer = build_trainer(cfg, run)
    ctx.accelerator = make_accelerator(run)
    torch.manual_seed(0)
    tracker = LiveBytesTracker()
    with tracker:
        ctx.models = prepare_models(build_models_for_rank(ctx), cfg.model, run)
        ctx.apply_setup_phases()
        ctx.dist.prepare_models(ctx)
    name = next(iter(ctx.models.trained))
    trained = ctx.models[name]
    params = list(trained.parameters())
    frozen = [t for n, m in ctx.models.items() if n != name for t in (*m.parameters(), *m.buffers())]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{label}-rank-{world.rank}.json").write_text(json.dumps({
        "rank": world.rank, "world": world.world_size,
        "host_peak": tracker.snapshot()["devices"]["cpu"]["peak_bytes"],
        "frozen": _bytes(frozen), "buffers": _bytes(trained.buffers()),
        "whole": _bytes(params), "shards": _bytes(p.to_local() for p in params),
        "largest": max(p.numel() * p.element_size() for p in params),
    }, indent=2))
    ctx.teardown()


if __name__ == "__main__":
    main()
