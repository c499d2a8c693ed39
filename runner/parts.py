"""The parts of a run, each built on its own: plugins, trainer, context, and the runner's own
changes to any trainer's models (dtypes and LoRA).

runner/parts.py opens a run from these parts, and the planner (runner/plan/simulate.py) builds
the same parts on fake tensors, so both run the same code. What the runner does to a trainer's
models: a user's trainer builds plain modules; the runner, not the trainer, applies
``model.dtype``, ``model.train_dtype`` (as resolved for the target device) and
``model.train=lora``, so that a trainer with only a denoiser runs every preset unchanged, in
managed and hosted mode alike. The built-in trainers build their modules in these dtypes already
(they load weights lazily, converting on load, which is what keeps a 12 B model's host RAM in
check) and say so with ``ModelSet.dtypes_applied``; for them this is a no-op apart from LoRA,
which they attach too.
"""
from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig
from torch import nn

from runner import registry
from runner.adapters import lora_alpha
from runner.constants import is_adapter
from runner.context import RunContext
from runner.data.checks import EDIT_FAMILIES
from runner.errors import UserError
from runner.export.config import check_full_format
from runner.families.common.loading import attach_lora
from runner.plugin import Plugin, PluginSchedule, check_requirements
from runner.resolved import ResolvedRun
from runner.trainer import ModelSet, Trainer, reference_count

log = logging.getLogger("runner")


def build_plugins(cfg: DictConfig, run: ResolvedRun, *, check: bool = True) -> PluginSchedule:
    """Every selected plugin, built from its own config node and the resolved run, then their per-phase
    order. ``check``: each plugin's node check and ``validate()`` run here (a caller whose config no
    job checked); ``check=False``: the job's checks did both (the preflight's plugins)."""
    return PluginSchedule.build(selected_plugins(cfg, run, check=check, node_checked=not check))


def selected_plugins(cfg: DictConfig, run: ResolvedRun, *, check: bool = True,
                     node_checked: bool = True) -> list[Plugin]:
    """Each selected plugin built from its node and the resolved run, in the config's order. With
    ``check`` its ``validate()`` runs (the checks against the run), and before it the node check its
    registry entry declares unless ``node_checked`` (runner/checks.py:check_config ran it)."""
    plugins = []
    for kind, name, node in registry.selected(cfg):
        entry = registry.plugin_entry(kind, name)
        if check and not node_checked and entry.check is not None:
            entry.check(node, f"{kind}.{name}")
        plugin = entry.load()(node, run)
        if check:
            plugin.validate()
        plugins.append(plugin)
    if check:
        check_requirements(plugins)  # each plugin's declared requires, named before anything is built
    return plugins


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
    # data.references against what the trainer declares (runner/trainer.py "Reference images"): a user's
    # trainer that declares nothing takes none, so a reference is refused here rather than ignored.
    reference_count(trainer, cfg, None if not str(target).startswith("runner.") else EDIT_FAMILIES)
    check_full_format(cfg, trainer)  # export.full_format=single_file: refused now, not after training
    return trainer


def idle_parts(run: ResolvedRun) -> dict[str, Any]:
    """The features' objects of a :class:`RunContext` that switches none of them on (no sampling,
    validation, EMA, tracking, flip, compile or simulated card; ``run``'s distribution): what the
    session injects, so that runner/context.py imports no feature."""
    from runner.compile.regional import NoCompile
    from runner.data.flip import NO_FLIP
    from runner.distributed.runtime import build_distribution
    from runner.ema.average import NoEMA
    from runner.memory.cuda_sim import NoSimulation
    from runner.output.trackers import NoTracking
    from runner.sampling.sampler import NoSampler
    from runner.val.holdout import NoValidation

    return {"sampler": NoSampler(), "tracking": NoTracking(), "flip": NO_FLIP, "ema": NoEMA(),
            "validation": NoValidation(), "dist": build_distribution(run), "compiler": NoCompile(),
            "card": NoSimulation()}


def make_context(cfg: Any, run: ResolvedRun, schedule: PluginSchedule, output_dir: Path | None,
                 overrides: list[str] | None = None) -> RunContext:
    """The run's context: the features ``cfg`` selects that are known before the models (compile,
    flip), the others idle until the session builds them."""
    from runner.compile.regional import build_compiler
    from runner.data.flip import visit_flip

    parts = idle_parts(run)
    parts["flip"] = visit_flip(cfg.get("data") if hasattr(cfg, "get") else None)
    if hasattr(cfg, "train"):
        parts["compiler"] = build_compiler(cfg.train)
    return RunContext(run=run, schedule=schedule, cfg=cfg, output_dir=output_dir,
                      overrides=None if overrides is None else list(overrides), **parts)


def has_adapters(module: nn.Module) -> bool:
    """Whether peft adapter layers are already in ``module`` (a trainer attached LoRA itself)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in module.modules())


def prepare_models(models: ModelSet, model_cfg: Any, run: ResolvedRun) -> ModelSet:
    """Apply the resolved dtypes and ``model.train`` to ``models`` (in place; returned for chaining).

    * frozen modules: floating weights in ``run.frozen_dtype``, ``requires_grad`` off;
    * trained modules, ``model.train=full``: floating weights in ``run.train_dtype``;
    * trained modules, ``model.train=lora``: base frozen in ``run.frozen_dtype``, then peft LoRA on
      ``model.lora_targets`` with adapters in ``run.train_dtype`` (skipped when the trainer
      already attached adapters).
    """
    for name, module in models.items():
        trained = name in models.trained
        if trained and is_adapter(run.train_mode):
            if has_adapters(module):
                continue
            if not models.dtypes_applied:
                _cast(module, run.frozen_dtype)
            dora = bool(model_cfg.get("lora_dora", False))
            attach_lora(module, int(model_cfg.lora_rank), lora_alpha(model_cfg), list(model_cfg.lora_targets),
                        run.train_dtype, dora=dora, kind=run.train_mode, factor=int(model_cfg.get("lokr_factor", -1)))
            kind = "DoRA" if dora else {"lora": "LoRA", "lokr": "LoKr", "loha": "LoHa"}[run.train_mode]
            log.info("model.train=%s: peft %s (rank %s) on %s's %s", run.train_mode, kind, model_cfg.lora_rank, name,
                     ", ".join(map(str, model_cfg.lora_targets)))
            continue
        if models.dtypes_applied:
            continue
        _cast(module, run.train_dtype if trained else run.frozen_dtype)
        if not trained:
            module.requires_grad_(False)
    return models


def _cast(module: nn.Module, dtype: Any) -> None:
    """``module.to(dtype)`` when a floating tensor has another dtype (diffusers warns on every
    ``to(dtype)`` call, even a no-op one)."""
    tensors = [*module.parameters(), *module.buffers()]
    if any(t.is_floating_point() and t.dtype != dtype for t in tensors):
        module.to(dtype)
