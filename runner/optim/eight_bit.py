"""bitsandbytes' optimizers (adamw8bit, lion, lion8bit) without a host sync after every parameter.

Why: bitsandbytes' ``Optimizer8bit.step`` (0.50.2) calls ``sync_gpu(p)``, a ``torch.cuda.synchronize()``,
after each parameter's update: 1,680 host syncs per SDXL step, so the CPU can never queue the next
kernels while the card runs the last ones. The sync matters only for paged state (CUDA unified
memory, whose prefetches are asynchronous; bitsandbytes also syncs once after the loop for it), so
the non-paged optimizers here are bitsandbytes' own classes with a ``step`` that makes exactly the
same per-parameter calls (``init_state``, ``prefetch_state``, ``update_step``: the same kernels on
the same values, so the same weights bit for bit and the same state bytes) and no sync. The paged
optimizer (``optimizer=paged_adamw8bit``) keeps bitsandbytes' step.

:meth:`NoPerParameterSync.update_one` is the one-parameter update that fused backward
(runner/optim/fused.py) calls directly from its hook, instead of a whole ``step()`` with the
parameter groups narrowed to one parameter. The choice against torchao's 8-bit AdamW is in
docs/architecture.md ("8-bit optimizers and host syncs").
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

import torch


class NoPerParameterSync:
    """Mixin over a bitsandbytes ``Optimizer8bit``: its ``step`` without the sync after each parameter."""

    initialized: bool
    param_groups: list[dict[str, Any]]
    state: dict[Any, dict[str, Any]]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gindex, group in enumerate(self.param_groups):
            for pindex, p in enumerate(group["params"]):
                if p.grad is not None:
                    self.update_one(group, p, gindex, pindex)
        return loss

    @torch.no_grad()
    def update_one(self, group: dict[str, Any], p: torch.Tensor, gindex: int, pindex: int) -> None:
        """Parameter ``p`` (``group["params"][pindex]`` of group ``gindex``) updated from its gradient, as
        bitsandbytes' ``step`` updates it (its first-step set-up included)."""
        if not self.initialized:
            self.check_overrides()  # type: ignore[attr-defined]
            self.to_gpu()  # type: ignore[attr-defined]
            self.initialized = True
        if len(self.state[p]) == 0:
            self.init_state(group, p, gindex, pindex)  # type: ignore[attr-defined]
        self.prefetch_state(p)  # type: ignore[attr-defined]
        self.update_step(group, p, gindex, pindex)  # type: ignore[attr-defined]


@lru_cache(maxsize=None)
def without_per_parameter_sync(cls: type) -> type:
    """``cls`` (a bitsandbytes optimizer class) with :class:`NoPerParameterSync`'s step; same name and
    constructor, so checkpoints, torchao's offload (which rebuilds ``type(optimizer)``) and messages see it."""
    return type(cls.__name__, (NoPerParameterSync, cls), {"__module__": __name__, "__doc__": cls.__doc__,
                                                           "__qualname__": cls.__qualname__})
