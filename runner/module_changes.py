"""One registry of every change plugins make to modules, so teardown undoes them in one place.

Plugins wrap forwards (checkpointing, parking), swap layers (quantization), set attention
processors (tiling) or register torch hooks (streaming). Each change is recorded here as
``(module, kind, handle, undo)``; :meth:`ModuleHooks.remove_all` undoes them newest first, and
the runner calls it in a ``finally``, so an exception mid-step leaves no patched module behind.
The same registry answers "is this module already checkpointed / parked / streamed?" without
ad-hoc ``_runner_*`` attributes on the modules (diffusers' ``HookRegistry`` is the model).

Modules are held weakly: a module a plugin drops (an encoder whose outputs are all cached) is
freed as usual, and its entries are skipped at teardown.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from torch import nn

log = logging.getLogger("runner")


@dataclass
class HookEntry:
    module: weakref.ReferenceType[nn.Module]
    kind: str  # what was done, e.g. "checkpoint", "park", "stream", "tiling"
    owner: str  # the plugin key that did it, e.g. "checkpoint/blocks"
    handle: Any  # whatever the plugin needs later (a ParkedModule, a StreamHandle, the old forward)
    undo: Optional[Callable[[], None]]


class ModuleHooks:
    """Per-module record of plugin changes with one undo path (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: list[HookEntry] = []

    def add(self, module: nn.Module, kind: str, owner: str, handle: Any = None,
            undo: Optional[Callable[[], None]] = None) -> None:
        """Record that ``owner`` did ``kind`` to ``module``; ``undo`` reverts it at teardown."""
        self._entries.append(HookEntry(weakref.ref(module), kind, owner, handle, undo))

    def entries(self, kind: Optional[str] = None, owner: Optional[str] = None) -> Iterator[HookEntry]:
        for e in self._entries:
            if (kind is None or e.kind == kind) and (owner is None or e.owner == owner) and e.module() is not None:
                yield e

    def remove_all(self) -> None:
        """Undo everything, newest first. One failing undo is logged and does not stop the others."""
        while self._entries:
            self._undo(self._entries.pop())

    @staticmethod
    def _undo(e: HookEntry) -> None:
        if e.undo is None:
            return
        try:
            e.undo()
        except Exception as err:  # noqa: BLE001 - teardown must reach every other entry
            log.warning("teardown: undoing %s of %s failed: %s", e.kind, e.owner, err)

    def __len__(self) -> int:
        return len(self._entries)


# ---- per-module marks, for the twin functions ---------------------------------------------------
# A plugin's twin function (apply_activation_checkpointing, park_module, apply_stream_offload)
# works without a run, so it cannot rely on a RunContext to know whether a module is already
# wrapped. It records that here instead of in ad-hoc attributes on the module: one weak table,
# keyed by module, of {kind: what the twin needs to undo it}.
_MARKS: "weakref.WeakKeyDictionary[nn.Module, dict[str, Any]]" = weakref.WeakKeyDictionary()


def mark(module: nn.Module, kind: str, value: Any) -> None:
    """Record that ``kind`` was applied to ``module`` (``value``: what undoing it needs)."""
    _MARKS.setdefault(module, {})[kind] = value


def marked(module: nn.Module, kind: str) -> Any:
    """The value recorded by :func:`mark`, or None."""
    return _MARKS.get(module, {}).get(kind)


def unmark(module: nn.Module, kind: str) -> Any:
    """Forget ``kind`` on ``module``; returns the value it had (None if unmarked)."""
    marks = _MARKS.get(module)
    return None if marks is None else marks.pop(kind, None)


# Saved-tensor hooks of the runner's plugins (activation offload, streamed offload) nest with
# each other; a hook pair of anyone else (a checkpoint region) is left alone. Held weakly.
_COMPOSABLE: "weakref.WeakSet[Callable[..., Any]]" = weakref.WeakSet()


def composable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as one of the runner's saved-tensor hooks (see above); returns ``fn``."""
    _COMPOSABLE.add(fn)
    return fn


def is_composable(fn: Any) -> bool:
    return fn in _COMPOSABLE
