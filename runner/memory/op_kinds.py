"""Which aten ops launch work on a card: the one definition the planner's counts and the simulated card's share.

An op that only allocates, relabels or views memory (``empty``, ``detach``, ``view``, ``t`` ...) is dispatched
on the host and launches no kernel; every other op on a card tensor is one card op (a kernel or a copy).
runner/plan/cost.py counts ``kernels + copies`` with it, runner/memory/cuda_sim.py ``card_ops``.
"""
from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

# Ops that allocate or relabel memory without reading or writing it.
NO_TRAFFIC = frozenset(op for op in (
    getattr(aten.empty, "memory_format", None), getattr(aten.empty_strided, "default", None),
    getattr(aten.empty_like, "default", None), getattr(aten.new_empty, "default", None),
    getattr(aten.new_empty_strided, "default", None), getattr(aten.detach, "default", None),
    getattr(aten.alias, "default", None), getattr(aten.lift_fresh, "default", None),
    getattr(aten.set_, "source_Storage_storage_offset", None), getattr(aten.resize_, "default", None),
) if op is not None)


def launches_nothing(func: Any) -> bool:
    """``func`` reads and writes no data (an allocation, a view, a relabel): no kernel on a card."""
    return func in NO_TRAFFIC or bool(getattr(func, "is_view", False))
