"""Loss parts as metrics columns: a trainer whose loss sums several terms (LTX-2's video and audio) records each
term of a training step here, and the loop writes their batch means beside ``loss`` (runner/loop.py ``record``)."""
from __future__ import annotations

import torch

MAX_PENDING = 256  # parts recorded by passes nobody reads (the planner's simulated steps) are dropped past this


class LossParts:
    """Mixin: ``add_loss_parts`` in ``loss``, ``take_loss_parts`` once per step (one host read per part)."""

    def init_loss_parts(self) -> None:
        self._parts: list[tuple[str, torch.Tensor, int]] = []

    def add_loss_parts(self, samples: int, **parts: torch.Tensor) -> None:
        """Record each part of a training pass (grad enabled: validation and sampling passes are not steps)."""
        if not torch.is_grad_enabled():
            return
        if len(self._parts) > MAX_PENDING:
            self._parts.clear()
        self._parts += [(name, value.detach(), samples) for name, value in parts.items()]

    def take_loss_parts(self) -> dict[str, float]:
        """Each part's mean over the samples of the passes since the last call (micro-batches weighted by size)."""
        sums: dict[str, tuple[torch.Tensor, int]] = {}
        for name, value, n in self._parts:
            total, count = sums.get(name, (torch.zeros((), device=value.device), 0))
            sums[name] = (total + value.float() * n, count + n)
        self._parts.clear()
        return {name: float(total) / count for name, (total, count) in sums.items()}
