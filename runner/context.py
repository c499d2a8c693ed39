"""RunContext: what plugins see and change during one run.

The same object serves managed mode (the runner fills it and owns the loop) and hosted mode
(a user's loop calls :meth:`RunContext.prepare`, the way ``accelerate.Accelerator.prepare``
works, and keeps its own loop).
"""
from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from runner.plugin import PluginSchedule
from runner.trainer import ModelSet

log = logging.getLogger("runner")


@dataclass
class RunContext:
    cfg: Any
    schedule: PluginSchedule
    device: torch.device
    output_dir: Path | None = None
    # True inside the planner: models hold fake tensors, ``device`` is ``meta`` (the simulated
    # accelerator) and ``host`` is fake ``cpu``. A plugin whose kernels cannot run on fake
    # tensors (bitsandbytes) takes its byte-equivalent simulation path when this is set.
    simulate: bool = False
    host: torch.device = field(default_factory=lambda: torch.device("cpu"))
    models: ModelSet | None = None
    trainer: Any = None
    optimizer: torch.optim.Optimizer | None = None
    accelerator: Any = None
    # Free-form per-plugin state, keyed by plugin key ("checkpoint/blocks"), for teardown.
    state: dict[str, Any] = field(default_factory=dict)
    # Context managers plugins want entered around every forward+backward (e.g. saved-tensor hooks).
    step_contexts: list[Any] = field(default_factory=list)
    # Extra lines for the run report: ("optimizer state bytes", 1234) ...
    notes: dict[str, Any] = field(default_factory=dict)

    def run_phase(self, phase: str, *args: Any) -> None:
        self.schedule.run(phase, self, *args)

    def apply_setup_phases(self) -> None:
        """Run the model phases on ``self.models``; modules no plugin placed go to the device.

        A plugin that keeps a module elsewhere (host, streamed) sets ``module._runner_placed``.
        """
        self.run_phase("transform_models")
        self.run_phase("place_models")
        for _, m in self.models.items():
            if not getattr(m, "_runner_placed", False):
                m.to(self.device)
        self.run_phase("wrap_execution")

    def step_context(self) -> ExitStack:
        """Enter every plugin's per-step context (a no-op stack when none asked for one)."""
        stack = ExitStack()
        for make in self.step_contexts:
            stack.enter_context(make())
        return stack

    # ---- hosted mode -------------------------------------------------------------------
    def prepare(
        self,
        models: dict[str, nn.Module] | nn.Module,
        optimizer: torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
        dataloader: Any = None,
        trained: set[str] | None = None,
    ) -> tuple[Any, Any, Any]:
        """Apply the configured plugins to a user's own models, optimizer and data loader.

        ``models`` is one module or a dict of named modules; by default a module is "trained"
        when it has a parameter with ``requires_grad``. ``optimizer`` is best given as a
        factory (``lambda params: AdamW(params, lr=1e-4)``): plugins that replace parameters
        (quantization, LoRA) run first, and the factory then receives the parameters that are
        really trained. Returns ``(models, optimizer, dataloader)`` in the form given.
        """
        single = isinstance(models, nn.Module)
        named = {"model": models} if single else dict(models)
        if trained is None:
            trained = {n for n, m in named.items() if any(p.requires_grad for p in m.parameters())}
        self.models = ModelSet(named, set(trained))
        self.apply_setup_phases()
        if optimizer is not None:
            if not isinstance(optimizer, torch.optim.Optimizer):
                optimizer = optimizer(list(self.models.trainable_parameters()))
            self.optimizer = optimizer
            self.run_phase("wrap_optimizer")
        out_models = self.models["model"] if single else self.models.modules
        return out_models, self.optimizer, dataloader
