"""The steady-state figures of a simulated step (runner/plan/simulate.py): the optimizer state per device and
top-level module, each phase's device peak with that state added, and the bytes per category at a peak."""
from __future__ import annotations

from typing import Any

from runner.memory.live_bytes_views import CATEGORIES, OPTIONAL_CATEGORIES
from runner.plan.dist import rank_phase
from runner.plan.result import PhasePeak
from runner.plan.target import DEVICE, HOST


def optimizer_state_by_module(sim: Any) -> dict[str, dict[str, int]]:
    """Optimizer state per device and top-level module, as it stands after the step."""
    state: dict[str, dict[str, int]] = {}
    for dev, mods in sim.state_by_dev.items():
        for label, cats in mods.items():
            n = cats.get("optimizer_state", 0)
            if n:
                per = state.setdefault(dev, {})
                per[sim.recorder.top(label)] = per.get(sim.recorder.top(label), 0) + n
    return state


TRAINING_PHASES = ("forward", "backward", "optimizer")


def host_in_training(sim: Any) -> int:
    """The host's highest live bytes in the step's training phases (offloaded activations wait there)."""
    return max((per_dev[HOST.type].peak_bytes for name, per_dev in sim.recorder.phases
                if name.startswith(TRAINING_PHASES) and HOST.type in per_dev), default=0)


def steady_peaks(sim: Any, state: dict[str, dict[str, int]]) -> tuple[dict[str, PhasePeak], dict[str, int]]:
    """The highest phase per device, and each phase's device peak, in the steady state.

    Forward and backward get the optimizer state added (it lives through them from the second
    step on) unless the optimizer steps inside backward; with ``dist`` the bytes are one rank's.
    The device comes first in each phase: ``rank_phase`` carries what it moved to the host over.
    """
    best: dict[str, PhasePeak] = {}
    phases: dict[str, int] = {}
    for name, per_dev in sim.recorder.phases:
        moved = 0  # dist.cpu_offload: this rank's shards on the host (runner/plan/dist.py)
        for dev, pk in sorted(per_dev.items(), key=lambda kv: kv[0] != DEVICE.type):
            if name.startswith(("forward", "backward")) and not sim.fused:  # steady state: the state lives through them
                extra = state.get(dev, {})
                by_module = {m: dict(c) for m, c in pk.by_module.items()}
                for m, n in extra.items():
                    by_module.setdefault(m, {})["optimizer_state"] = by_module.get(m, {}).get("optimizer_state", 0) + n
                pk = PhasePeak(name, pk.where, pk.peak_bytes + sum(extra.values()), by_module)
            if sim.rank_layout is not None:  # dist=ddp|fsdp: one rank's bytes (runner/plan/dist.py)
                pk, moved = rank_phase(sim.rank_layout, pk, dev == DEVICE.type, moved)
            if dev == DEVICE.type:
                phases[name] = pk.peak_bytes
            if dev not in best or pk.peak_bytes > best[dev].peak_bytes:
                best[dev] = pk
    return best, phases


def by_category(peak: PhasePeak) -> dict[str, int]:
    """Bytes per category at the peak; optional categories listed only when present, so plans
    without them keep the keys they had."""
    by_category = {c: sum(per.get(c, 0) for per in peak.by_module.values()) for c in CATEGORIES}
    for c in OPTIONAL_CATEGORIES:
        n = sum(per.get(c, 0) for per in peak.by_module.values())
        if n:
            by_category[c] = n
    return by_category
