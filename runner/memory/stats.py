"""Live memory statistics for every step: metrics.jsonl columns, the progress bar, pressure warnings.

What is measured, and where it comes from
-----------------------------------------
On CUDA everything comes from one ``torch.cuda.memory_stats(device)`` call (a dict read from
the caching allocator; no synchronisation):

* ``mem_allocated_gb``: bytes in live tensors (``allocated_bytes.all.current``), at step end;
* ``mem_reserved_gb``: bytes the caching allocator holds from the driver (live + cached);
* ``memory_peak_gb`` / ``mem_peak_reserved_gb``: the highest allocated / reserved bytes so far
  (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``). The runner never resets these
  counters inside a run, because benchmarks and the planner's validation read
  ``max_memory_allocated`` over a whole run; :func:`runner.cli.launch.run_job` resets them once when a
  job starts, so the jobs of a ``-m`` sweep do not inherit each other's peaks. (Per-step peaks
  would need a reset every step, as torchtune does, and would break those readers.)
* ``mem_fragmentation`` = (reserved - allocated) / reserved: the share of reserved memory that
  is cached but not in use. High values with OOMs mean blocks of the wrong size are cached
  (``allocator.expandable_segments`` is the fix);
* ``cuda_alloc_retries``: times the allocator had to free its cache and retry a cudaMalloc
  (a sign of running at the edge: each one is a device synchronisation); ``cuda_ooms``: OOM
  errors raised. Both count since this run started (process counters minus their value then).

On CPU there is no separate device allocator to ask, so the device columns are ``null`` rather
than invented; ``host_rss_gb`` (the process's resident set, from psutil) is reported on every
device, and on CPU it is also what ``memory_in_use_gb`` and the pressure level use. RSS counts
everything the process holds (Python objects, the allocator's free lists, shared libraries),
so it is an upper bound of tensor memory, sampled at step end, not a peak.

Pressure levels
---------------
``used / budget`` where ``used`` is the reserved bytes at step end on CUDA (what the process
holds from the card; the caching allocator keeps a step's blocks, so this is close to the step's
high-water mark, and an allocation beyond the budget is an OOM) and the RSS at step end on CPU,
and ``budget`` is ``budget_gb`` when set, else the device's total memory (card / host RAM):

========  ==============
low       below 60 %
medium    60 % to 75 %
high      75 % to 90 %
critical  90 % and above
========  ==============

The log warns when the level rises to high or critical, once per change of level (not every
step), and says when it falls back below high.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import psutil
import torch

log = logging.getLogger("runner")

GIB = 2**30

PRESSURE_LEVELS: tuple[tuple[str, float], ...] = (("low", 0.60), ("medium", 0.75), ("high", 0.90), ("critical", float("inf")))
"""(level, upper bound of ``used / budget`` for that level), in rising order."""

WARN_FROM = "high"

_RANK = {name: i for i, (name, _) in enumerate(PRESSURE_LEVELS)}


def pressure_level(fraction: float) -> str:
    """The level of ``used / budget`` (see the module table)."""
    for name, upper in PRESSURE_LEVELS:
        if fraction < upper:
            return name
    return PRESSURE_LEVELS[-1][0]


def fragmentation(reserved: int, allocated: int) -> float | None:
    """(reserved - allocated) / reserved; None when nothing is reserved."""
    if reserved <= 0:
        return None
    return (reserved - allocated) / reserved


def host_rss() -> int:
    return psutil.Process().memory_info().rss


def device_total_bytes(device: torch.device) -> int:
    """Card capacity on CUDA, physical RAM on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(_index(device)).total_memory
    return psutil.virtual_memory().total


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@dataclass
class PressureMonitor:
    """Turns ``used / budget`` into a level and logs level changes (not every step)."""

    budget_bytes: int
    budget_source: str
    level: str | None = None

    def update(self, used_bytes: int, step: int) -> tuple[str, float]:
        fraction = used_bytes / self.budget_bytes
        level = pressure_level(fraction)
        if level != self.level:
            if _RANK[level] >= _RANK[WARN_FROM]:
                log.warning(
                    "memory pressure %s at step %d: %.1f of %.1f GiB (%.0f%% of %s)",
                    level, step, used_bytes / GIB, self.budget_bytes / GIB, 100 * fraction, self.budget_source,
                )
            elif self.level is not None and _RANK[self.level] >= _RANK[WARN_FROM]:
                log.info("memory pressure back to %s at step %d (%.0f%% of %s)", level, step, 100 * fraction,
                         self.budget_source)
            self.level = level
        return level, fraction


class MemoryMonitor:
    """Per-step memory columns: call :meth:`sample` at the end of every step."""

    def __init__(self, device: torch.device, budget_gb: float | None = None, card: Any = None) -> None:
        self.device = device
        # train.device=cuda_sim: the simulated card answers torch.cuda.memory_stats (runner/memory/cuda_sim.py)
        self.card = card if card is not None and card.simulates else None
        self.cuda = (device.type == "cuda" and torch.cuda.is_available()) or self.card is not None
        if budget_gb:
            budget, source = int(float(budget_gb) * GIB), f"budget_gb={budget_gb:g}"
        else:
            budget = device_total_bytes(device)
            source = f"the {'card' if self.cuda else 'host RAM'} ({budget / GIB:.1f} GiB; budget_gb unset)"
        self.pressure = PressureMonitor(budget, source)
        self._base_retries = self._base_ooms = 0
        if self.cuda:
            stats = self._stats()
            self._base_retries = stats.get("num_alloc_retries", 0)
            self._base_ooms = stats.get("num_ooms", 0)

    def sample(self, step: int) -> dict[str, Any]:
        """The memory columns of one metrics.jsonl row (GiB; None where the device has no such figure)."""
        rss = host_rss()
        row: dict[str, Any] = {"host_rss_gb": rss / GIB}
        if self.cuda:
            s = self._stats()
            allocated = s.get("allocated_bytes.all.current", 0)
            reserved = s.get("reserved_bytes.all.current", 0)
            used = reserved
            row.update(
                memory_in_use_gb=allocated / GIB,
                memory_peak_gb=s.get("allocated_bytes.all.peak", 0) / GIB,
                mem_allocated_gb=allocated / GIB,
                mem_reserved_gb=reserved / GIB,
                mem_peak_reserved_gb=s.get("reserved_bytes.all.peak", 0) / GIB,
                mem_fragmentation=fragmentation(reserved, allocated),
                cuda_alloc_retries=s.get("num_alloc_retries", 0) - self._base_retries,
                cuda_ooms=s.get("num_ooms", 0) - self._base_ooms,
            )
            if self.card is not None:  # the plan's peak counts live tensor bytes; so does this one
                row.update(memory_peak_gb=s["live_bytes.all.peak"] / GIB, memory_source="cuda_sim")
        else:
            used = rss
            row.update(
                memory_in_use_gb=rss / GIB,
                memory_peak_gb=None,
                mem_allocated_gb=None,
                mem_reserved_gb=None,
                mem_peak_reserved_gb=None,
                mem_fragmentation=None,
                cuda_alloc_retries=None,
                cuda_ooms=None,
            )
        level, fraction = self.pressure.update(used, step)
        row.update(mem_budget_gb=self.pressure.budget_bytes / GIB, mem_budget_used=fraction, mem_pressure=level)
        return row

    def _stats(self) -> dict[str, Any]:
        return self.card.memory_stats() if self.card is not None else torch.cuda.memory_stats(self.device)

    @staticmethod
    def postfix(row: dict[str, Any]) -> dict[str, str]:
        """Short progress-bar fields: allocated/reserved and peak on CUDA, RSS on CPU."""
        if row.get("mem_allocated_gb") is not None:
            out = {"mem": f"{row['mem_allocated_gb']:.2f}/{row['mem_reserved_gb']:.2f}G",
                   "peak": f"{row['memory_peak_gb']:.2f}G"}
            if row.get("mem_fragmentation") is not None:
                out["frag"] = f"{100 * row['mem_fragmentation']:.0f}%"
        else:
            out = {"rss": f"{row['host_rss_gb']:.2f}G"}
        out["pressure"] = row["mem_pressure"]
        return out
