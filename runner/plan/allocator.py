"""The step's device allocations, replayed through the CUDA caching allocator's model: reserved bytes.

Why: the budget is what the card can *reserve*; the tracker's peak is what tensors hold. The
allocator keeps freed blocks cached and reserves whole segments or pages
(runner/memory/caching_allocator.py), so a step reserves 1-3% more than its allocated peak
(H200, docs/benchmarks.md). The planner records every device storage's birth and death in
order, and replays them here twice: as recorded (setup, the first step, anything between
steps) and then the micro-batches once more, as the second step runs them with the optimizer
state and the cached blocks of the first in place. That is the steady state the plan's peak
describes.

Two replays: without a cap, the reserved peak a large card would show (the figure the plan
prints beside the allocated one); with the cap at the budget (less the kernel workspace
margin), whether the allocator would have to flush its cache and retry (slower: each retry
synchronises the device) or could not fit at all, which is what decides "fits".

Not for ``dist`` plans (the simulation holds the whole model and ``runner/plan/dist.py`` turns
bytes into one rank's afterwards; there is no per-rank allocation order to replay) nor a CPU
target (no caching allocator).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from runner.memory.caching_allocator import CachingAllocatorModel

_REPLAYED = "step 2"


class AllocationLog:
    """The tracker's ``alloc_observer``: births and deaths of storages on one device, in order."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.events: list[tuple[int, int]] = []  # (storage serial, bytes): bytes < 0 is a death
        self.step: tuple[int, int] | None = None  # events[a:b] are the micro-batches of the step

    def born(self, device: str, serial: int, nbytes: int) -> None:
        if device == self.device:
            self.events.append((serial, nbytes))

    def died(self, device: str, serial: int) -> None:
        if device == self.device:
            self.events.append((serial, -1))

    def step_started(self) -> None:
        self.step = (len(self.events), len(self.events))

    def step_ended(self) -> None:
        if self.step is not None:
            self.step = (self.step[0], len(self.events))

    def replay(self, model: CachingAllocatorModel) -> CachingAllocatorModel:
        for serial, n in self.events:
            model.alloc(serial, n) if n >= 0 else model.free(serial)
        if self.step is not None:
            a, b = self.step
            born = set()
            for serial, n in self.events[a:b]:  # the second step: its own storages, same order
                if n >= 0:
                    born.add(serial)
                    model.alloc((_REPLAYED, serial), n)
                elif serial in born:
                    model.free((_REPLAYED, serial))
        return model


@dataclass
class ReservedPlan:
    """What the caching allocator would reserve for the planned step (see the module docstring)."""

    expandable_segments: bool
    reserved_peak_bytes: int  # without a cap
    allocated_peak_bytes: int  # the same replay's allocated peak (requests rounded to 512 B)
    capped_at_bytes: int | None  # the cap the second replay ran with (budget less the margin)
    retries: int  # times the capped allocator had to free its cache and retry
    ooms: int  # allocations the capped allocator could not serve

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def expandable_segments(cfg: Any) -> bool:
    """Whether the run's allocator maps pages on demand: ``allocator.default.expandable_segments``,
    unless ``PYTORCH_CUDA_ALLOC_CONF``/``PYTORCH_ALLOC_CONF`` says otherwise (it wins key by key, as
    plugins/allocator.py applies it); PyTorch's own default (off) without the allocator plugin."""
    for env in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        for item in os.environ.get(env, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() == "true"
    node = (cfg.get("allocator") or {}).get("default") if hasattr(cfg, "get") else None
    return bool(node.get("expandable_segments", True)) if node is not None else False


def plan_reserved(log: AllocationLog, cfg: Any, cap_bytes: int | None) -> ReservedPlan:
    """Replay ``log`` without a cap and, when a budget is set, capped at ``cap_bytes``."""
    expandable = expandable_segments(cfg)
    free = log.replay(CachingAllocatorModel(expandable))
    capped = log.replay(CachingAllocatorModel(expandable, cap_bytes)) if cap_bytes is not None else None
    return ReservedPlan(
        expandable_segments=expandable,
        reserved_peak_bytes=free.peak_reserved,
        allocated_peak_bytes=free.peak_allocated,
        capped_at_bytes=cap_bytes,
        retries=capped.retries if capped else 0,
        ooms=capped.ooms if capped else 0,
    )
