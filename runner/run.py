"""The steps of one run, each callable and testable on its own. ``__main__`` strings them together."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from runner import registry
from runner.context import RunContext
from runner.errors import UserError
from runner.plugin import KINDS, Plugin, PluginSchedule
from runner.trainer import Trainer

log = logging.getLogger("runner")


def resolve_device(cfg: DictConfig) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA device is available. Use train.device=cpu or auto.")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def build_plugins(cfg: DictConfig) -> PluginSchedule:
    """One plugin per kind from the composed config, and their per-phase order."""
    plugins: list[Plugin] = []
    for kind in KINDS:
        node = cfg[kind]
        plugin_cls = registry.get_plugin(kind, node.name)
        plugins.append(plugin_cls(node))
    return PluginSchedule.build(plugins)


def build_trainer(cfg: DictConfig) -> Trainer:
    """Instantiate ``cfg.trainer._target_`` with the whole run config."""
    target = cfg.trainer.get("_target_")
    try:
        cls = get_class(target)
    except Exception as e:
        names = ", ".join(sorted(registry.trainers()))
        raise UserError(
            f"trainer._target_={target!r} could not be imported ({str(e).splitlines()[0]}). "
            f"Give a 'module.Class' importable from the current directory or PYTHONPATH, or one of trainer={names}."
        ) from None
    trainer = cls(cfg)
    missing = [m for m in ("build_models", "dataset", "loss", "example_batch") if not callable(getattr(trainer, m, None))]
    if missing:
        raise UserError(
            f"trainer._target_={target!r} does not implement the trainer protocol: missing {', '.join(missing)}. "
            "See runner/trainer.py for the four methods a trainer needs."
        )
    return trainer


def make_context(cfg: DictConfig, schedule: PluginSchedule, output_dir: Path | None) -> RunContext:
    return RunContext(cfg=cfg, schedule=schedule, device=resolve_device(cfg), output_dir=output_dir)


def output_dir(cfg: DictConfig) -> Path:
    if cfg.output_dir:
        return Path(cfg.output_dir)
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    raise UserError("output_dir is not set and no Hydra run directory exists; set output_dir=<folder>.")


def plain(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
