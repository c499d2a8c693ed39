"""The steps of one run, each callable and testable on its own. ``__main__`` strings them together."""
from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig

from runner import registry
from runner.context import RunContext
from runner.errors import UserError
from runner.plugin import Plugin, PluginSchedule
from runner.resolved import ResolvedRun
from runner.trainer import Trainer

log = logging.getLogger("runner")


def build_plugins(cfg: DictConfig, run: ResolvedRun) -> PluginSchedule:
    """Every selected plugin, built from its own config node and the resolved run, and validated;
    then their per-phase order."""
    plugins: list[Plugin] = []
    for kind, name, node in registry.selected(cfg):
        plugin = registry.get_plugin(kind, name)(node, run)
        plugin.validate()
        plugins.append(plugin)
    return PluginSchedule.build(plugins)


def build_trainer(cfg: DictConfig, run: ResolvedRun | None = None) -> Trainer:
    """Instantiate ``cfg.trainer._target_`` with the whole run config, and the resolved run when
    its constructor takes ``run`` (the built-in trainers do: they build in the run's dtypes)."""
    target = cfg.trainer.get("_target_")
    try:
        cls = get_class(target)
    except Exception as e:
        names = ", ".join(sorted(registry.trainers()))
        raise UserError(
            f"trainer._target_={target!r} could not be imported ({str(e).splitlines()[0]}). "
            f"Give a 'module.Class' importable from the current directory or PYTHONPATH, or one of trainer={names}."
        ) from None
    try:
        takes_run = "run" in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a class without an inspectable signature
        takes_run = False
    try:
        trainer = cls(cfg, run=run) if takes_run and run is not None else cls(cfg)
    except UserError:
        raise
    except Exception as e:  # a user's trainer: its message, not our traceback (RUNNER_DEBUG=1 re-raises)
        if os.environ.get("RUNNER_DEBUG"):
            raise
        raise UserError(
            f"trainer._target_={target!r}: constructing {cls.__name__} failed with {type(e).__name__}: "
            f"{(str(e).strip().splitlines() or [''])[0]}. Fix the trainer or its options (trainer.*); set "
            "RUNNER_DEBUG=1 to see the traceback."
        ) from None
    missing = [m for m in ("build_models", "dataset", "loss", "example_batch") if not callable(getattr(trainer, m, None))]
    if missing:
        raise UserError(
            f"trainer._target_={target!r} does not implement the trainer protocol: missing {', '.join(missing)}. "
            "See runner/trainer.py for the four methods a trainer needs."
        )
    return trainer


def make_context(cfg: Any, run: ResolvedRun, schedule: PluginSchedule, output_dir: Path | None,
                 overrides: list[str] | None = None) -> RunContext:
    from runner.data.flip import visit_flip

    return RunContext(run=run, schedule=schedule, cfg=cfg, output_dir=output_dir,
                      overrides=None if overrides is None else list(overrides),
                      flip=visit_flip(cfg.get("data") if hasattr(cfg, "get") else None))


def output_dir(cfg: DictConfig) -> Path:
    if cfg.output_dir:
        return Path(cfg.output_dir)
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    raise UserError("output_dir is not set and no Hydra run directory exists; set output_dir=<folder>.")
