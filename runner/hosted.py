"""Hosted mode: keep your own training loop and let the runner apply the memory plugins.

A few lines of change in an existing loop::

    from runner.hosted import session
    ctx = session(["+preset=sdxl_24gb"])               # same overrides as the command line
    unet, optimizer, loader = ctx.prepare(unet, lambda params: torch.optim.AdamW(params, 1e-4), loader)
    for batch in loader:
        with ctx.step_context(), ctx.accelerator.autocast():
            loss = my_loss(unet, batch)
        ctx.accelerator.backward(loss)
        optimizer.step(); optimizer.zero_grad()

The config is composed and validated exactly as ``python -m runner`` would do it; the trainer
group is ignored because the loop is yours.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from runner.context import RunContext
from runner.loop import make_accelerator
from runner.run import build_plugins, make_context
from runner.validate import compose_config, validate


def session(overrides: Sequence[str] = (), output_dir: str | Path | None = None) -> RunContext:
    """Compose + validate the config, run ``configure_process`` and return a ready context."""
    cfg = compose_config(overrides)
    validate(cfg)
    schedule = build_plugins(cfg)
    ctx = make_context(cfg, schedule, Path(output_dir) if output_dir else None)
    ctx.run_phase("configure_process")
    ctx.accelerator = make_accelerator(cfg, ctx.device)
    return ctx
