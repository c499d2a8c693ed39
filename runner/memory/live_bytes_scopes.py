"""Phases and module calls of a :class:`runner.memory.live_bytes.LiveBytesTracker`: the open
frames that births are attributed to, their peaks, and the module hooks that open them.

Kept apart from the per-op counting (live_bytes.py) and the read side (live_bytes_views.py) so
that each file has one job: these run at phase and module boundaries, never per op.

Phases
------
``phase(name)`` opens a frame: storages born inside get the phase's category when they survive
it (``PHASE_CATEGORIES``) and are temporaries when they die inside the same phase *instance*;
the highest live level seen while it was open becomes the phase's peak (and its parent's).

Modules
-------
``module(name)`` (or forward pre/post hooks installed by :meth:`TrackerScopes.attach_module_hooks`)
tags births with the innermost open module and records, per call, how much the live total grew
(retained, i.e. activations kept for backward) and how far it peaked above the entry level.
Attribution happens at module boundaries only: nothing is scanned per op. Backward is not
attributed to modules (only to the ``backward`` phase). Module figures are summed over devices.
``track(x, category, module=name)`` labels pre-existing tensors (weights, gradients, optimizer
state) with a module too, so the breakdown *at the peak* (``peak_by_module``: module ->
category -> bytes, per device) covers every byte; unlabelled bytes are under ``"(none)"``.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn


class Frame:
    """One open phase or module call: the highest live level seen while it was open."""

    __slots__ = ("name", "serial", "category", "maxes", "enter_total", "max_total")

    def __init__(self, name: str, serial: int, category: str | None, maxes: dict[str, int], total: int) -> None:
        self.name = name
        self.serial = serial
        self.category = category
        self.maxes = maxes
        self.enter_total = total
        self.max_total = total


class TrackerScopes:
    """Mixin of LiveBytesTracker: the phase and module frames its counting attributes births to.

    Every boundary drains the queue of dead storages first, so frees that happened inside a
    frame are accounted to it before it closes.
    """

    current: dict[str, int]
    phase_peaks: dict[str, dict[str, int]]
    _phases: list[Frame]
    _modules: list[Frame]
    _hooks: list[Any]
    _serial_counter: int
    _serial_names: dict[int, str]
    _module_stats: dict[str, dict[str, int]]
    _total: int

    _uncounting: int
    _excluded: dict[int, Any]

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Storages born inside (and views of them) are never counted: they stand for bytes that are
        counted elsewhere. The planner's use: a weight cast to the compute dtype under ``dist=fsdp``
        stands for FSDP2's all-gathered copy of its unit, which runner/plan/dist.py counts per unit
        (one unit at a time, freed after use) rather than per op."""
        self._uncounting += 1
        try:
            yield
        finally:
            self._uncounting -= 1

    def _is_excluded(self, key: int, storage: Any) -> bool:
        ref = self._excluded.get(key)
        if ref is None:
            return False
        if ref() is storage:
            return True
        del self._excluded[key]  # a dead excluded storage whose address was reused
        return False

    @contextmanager
    def phase(self, name: str, category: str | None = None) -> Iterator[None]:
        """Everything allocated inside belongs to phase ``name`` ("forward", "backward", ...).

        ``category`` overrides what survivors of this phase are called (default from
        ``PHASE_CATEGORIES``, else "other").
        """
        self._drain()
        self._serial_counter += 1
        self._serial_names[self._serial_counter] = name
        frame = Frame(name, self._serial_counter, category, dict(self.current), self._total)
        self._phases.append(frame)
        try:
            yield
        finally:
            self._drain()  # frees inside the phase are still attributed to it
            self._phases.pop()
            peaks = self.phase_peaks.setdefault(name, {})
            for dev, v in frame.maxes.items():
                if v > peaks.get(dev, 0):
                    peaks[dev] = v
                if self._phases:
                    pm = self._phases[-1].maxes
                    if v > pm.get(dev, 0):
                        pm[dev] = v

    def _module_enter(self, name: str) -> None:
        self._drain()
        self._module_stats.setdefault(
            name, {"calls": 0, "allocated_bytes": 0, "retained_bytes": 0, "max_increase_bytes": 0}
        )
        self._modules.append(Frame(name, 0, None, {}, self._total))

    def _module_exit(self) -> None:
        self._drain()
        f = self._modules.pop()
        st = self._module_stats[f.name]
        st["calls"] += 1
        st["retained_bytes"] += self._total - f.enter_total
        st["max_increase_bytes"] = max(st["max_increase_bytes"], f.max_total - f.enter_total)
        if self._modules and f.max_total > self._modules[-1].max_total:
            self._modules[-1].max_total = f.max_total

    @contextmanager
    def module(self, name: str) -> Iterator[None]:
        """Attribute births inside to module ``name`` (innermost open module wins)."""
        self._module_enter(name)
        try:
            yield
        finally:
            self._module_exit()

    def attach_module_hooks(self, model: nn.Module, depth: int = 1, prefix: str = "") -> list[Any]:
        """Forward pre/post hooks on the submodules ``depth`` levels below ``model``.

        Containers that are never called (ModuleList, ModuleDict) do not count as a level:
        their children are used instead (``down_blocks.0``). Returns the hook handles; they are
        also removed by :meth:`detach_module_hooks`.
        """
        handles: list[Any] = []

        def pre(name: str) -> Any:
            return lambda mod, args: self._module_enter(name)

        def post(name: str) -> Any:
            return lambda mod, args, out: self._module_exit()

        def visit(mod: nn.Module, path: str, level: int) -> None:
            for cname, child in mod.named_children():
                full = f"{path}.{cname}" if path else cname
                if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                    visit(child, full, level)
                elif level + 1 >= depth:
                    handles.append(child.register_forward_pre_hook(pre(full)))
                    handles.append(child.register_forward_hook(post(full), always_call=True))
                else:
                    visit(child, full, level + 1)

        visit(model, prefix, 0)
        self._hooks.extend(handles)
        return handles

    def detach_module_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
