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


def cpu_precision(cfg: DictConfig, device: torch.device) -> DictConfig:
    """On CPU, train the denoiser in float32 unless ``train.cpu_autocast`` asks otherwise.

    Presets store trained weights in bf16 to fit a GPU (``model.train_dtype``); a CPU without
    native bf16 matmuls emulates them (the tiny SDXL step went from ~0.1 s to 2.6 s here).
    This is the storage-side twin of the autocast policy in ``runner.loop.make_accelerator``;
    the planner still plans the configured dtypes, since it plans the GPU run.
    """
    if device.type != "cpu" or cfg.train.cpu_autocast or cfg.model.get("train_dtype", "float32") == "float32":
        return cfg
    log.info("model.train_dtype=%s applies on CUDA; this CPU run trains in float32 "
             "(train.cpu_autocast=true keeps %s on CPU)", cfg.model.train_dtype, cfg.model.train_dtype)
    cfg = cfg.copy()
    cfg.model.train_dtype = "float32"
    return cfg
