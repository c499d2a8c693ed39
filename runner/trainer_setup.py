"""What the runner does to any trainer's models before the plugins: dtypes and LoRA.

A user's trainer builds plain modules; the runner, not the trainer, applies ``model.dtype``,
``model.train_dtype`` (as resolved for the target device) and ``model.train=lora``, so that a
trainer with only a denoiser runs every preset unchanged, in managed and hosted mode alike.
The built-in trainers build their modules in these dtypes already (they load weights lazily,
converting on load, which is what keeps a 12 B model's host RAM in check) and say so with
``ModelSet.dtypes_applied``; for them this is a no-op apart from LoRA, which they attach too.
"""
from __future__ import annotations

import logging
from typing import Any

from torch import nn

from runner.resolved import ResolvedRun
from runner.trainer import ModelSet
from runner.trainers.loading import attach_lora

log = logging.getLogger("runner")


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
        if trained and run.train_mode == "lora":
            if has_adapters(module):
                continue
            if not models.dtypes_applied:
                _cast(module, run.frozen_dtype)
            attach_lora(module, int(model_cfg.lora_rank), float(model_cfg.lora_alpha), list(model_cfg.lora_targets),
                        run.train_dtype)
            log.info("model.train=lora: peft LoRA (rank %s) on %s's %s", model_cfg.lora_rank, name,
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
