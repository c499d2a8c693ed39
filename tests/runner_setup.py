"""The runner's setup of a managed run, step by step as runner/__main__.py does it, up to the plugins.

Not a test module (no ``test_`` prefix); pytest puts tests/ on ``sys.path``, so test files import it
by name. For tests that need a RunContext with real tiny models before ``apply_setup_phases``, and
for whole jobs as ``python -m runner`` runs them (:func:`job`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from accelerate.utils import set_seed

from runner.parts import build_plugins, build_trainer, make_context, prepare_models
from runner.cli.compose import compose_config
from runner.cli.launch import run_job
from runner.checks import validate
from runner.context import RunContext
from runner.resolved import resolve
from runner.session import make_accelerator


def prepared_context(out: Path, *overrides: str, trainer: Any = None) -> RunContext:
    """Composed, validated, resolved; trainer, models (dtypes, LoRA) and accelerator built; no plugin phase run."""
    cfg = compose_config([f"output_dir={out}", "train.progress=false", *overrides])
    validate(cfg)
    resolved = resolve(cfg)
    ctx = make_context(cfg, resolved, build_plugins(cfg, resolved), out)
    ctx.trainer = trainer or build_trainer(cfg, resolved)
    set_seed(resolved.seed)
    ctx.models = prepare_models(ctx.trainer.build_models("cpu"), cfg.model, resolved)
    ctx.accelerator = make_accelerator(resolved)
    return ctx


QUIET = ["train.progress=false", "sample.every=0"]


def job(out: Path, *overrides: str) -> dict:
    """One job as ``python -m runner`` runs it; its job_summary.json."""
    from runner.__main__ import task

    try:
        run_job(task, compose_config([f"output_dir={out}", *QUIET, *overrides]))
    except SystemExit:
        pass
    return json.loads((out / "job_summary.json").read_text())
