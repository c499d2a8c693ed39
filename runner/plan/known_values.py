"""Values the planner knows: small tensors that carry their real values through a simulated step.

Why: the planner runs a trainer's encode step on tensors without values (real ``meta``, or fake
tensors on it). Code that reads a value to decide what to do next stops there: transformers'
masking asks ``padding_mask.all()`` (``tensor.sum() == tensor.numel()``, then ``bool()``) before it
builds an attention mask, so a trainer whose T5 or CLIP encoder takes a mask could not be planned.
Yet those values are known: token ids and masks come from the tokenizer as real CPU tensors and
only then move to the device. :class:`KnownValues` keeps them:

* a real CPU tensor of at most :data:`LIMIT` elements moved onto the simulated device keeps a copy
  of itself as its value;
* an op whose tensor inputs all have values (or are small real tensors) computes its outputs'
  values from them, on the CPU, with the simulation's modes off (nothing it makes is counted);
* a read of a value (``.item()``, ``bool()``, ``torch.equal``, a move back to the host as ``tolist``
  makes) is answered from it;
* an in-place op on a tensor with a value, given an input without one, forgets the value;
* an op whose output's shape depends on values (``nonzero``, ``repeat_interleave`` by a tensor, indexing
  by a boolean mask), which a fake tensor cannot answer, is answered from the values: computed on them
  when every input has one, else (an index by a known mask into an activation) run with the mask's
  ``nonzero`` indices in its place (Qwen-Image 2.1's transformer lays out its joint sequence so).

A read of a tensor with no value still fails as before, and the planner reports the call and the
trainer's line (runner/plan/__init__.py). The trade-off: a few microseconds an op while values are
alive; the mode is active around a simulated step's forward (from the batch's move to the device to
the loss), where they live.

Masks of an example batch or of a cached encode part are the one value the planner assumes rather
than knows: all true (every token valid, the longest sequence a run can see; runner/plan/batch.py),
so that a denoiser that counts its caption's tokens from the mask (Lumina 2's
``mask.sum(dim=1).tolist()``) can be planned, at its worst case.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from runner.compat import (FAKE_VALUE_ERRORS, TorchDispatchMode, is_fake, tree_flatten, tree_map,
                           without_dispatch_modes)

LIMIT = 1 << 16  # elements: ids, masks and the scalars made from them; never activations
_ATTR = "_runner_known_value"
_MOVES = {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device,
          torch.ops.aten.to.dtype, torch.ops.aten.to.other}
_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
             torch.ops.aten._index_put_impl_.default}
_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}


def value_of(t: Any) -> torch.Tensor | None:
    """The real value the planner knows for ``t`` (a small real tensor is its own), else None."""
    if not isinstance(t, torch.Tensor):
        return None
    known = getattr(t, _ATTR, None)
    if known is not None:
        return known
    if t.device.type == "cpu" and not is_fake(t) and t.numel() <= LIMIT:
        return t
    return None


def _to_host(args: Any, kwargs: Any) -> bool:
    """Whether a move op's destination is the CPU (``_to_copy(device=cpu)``, ``to(cpu)``)."""
    device = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (torch.device, str))), None))
    return device is not None and torch.device(device).type == "cpu"


def _simulated(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.device.type == "meta" or is_fake(t))


def _leaves(tree: Any) -> Iterator[Any]:
    """The leaves of an op's arguments or outputs (tuples, lists and dicts of them), as ``tree_flatten`` gives them:
    this runs for every op while a value is alive, where pytree's generic walk was most of the mode's cost."""
    if isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _leaves(item)
    elif type(tree) is dict:
        for item in tree.values():
            yield from _leaves(item)
    else:
        yield tree


class KnownValues(TorchDispatchMode):
    """The mode of the module docstring: values of small tensors kept through the simulated ops."""

    def __init__(self) -> None:
        super().__init__()
        self.alive = 0  # simulated tensors holding a value: none, and only moves can make one

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _READS:
            values = self._values(args, kwargs) if any(_simulated(a) for a in tree_flatten(args)[0]) else None
            if values is not None:
                with without_dispatch_modes():
                    return func(*values[0], **values[1])
            return func(*args, **kwargs)
        if func in _MOVES and _to_host(args, kwargs) and (value := value_of(args[0])) is not None and _simulated(args[0]):
            with without_dispatch_modes():  # a read back to the host (``tolist``): the value, moved as asked
                return func(value, *args[1:], **kwargs)
        try:
            out = func(*args, **kwargs)
        except FAKE_VALUE_ERRORS:
            out = self._shaped_by_values(func, args, kwargs)
        if func in _MOVES or self.alive:
            self._follow(func, args, kwargs, out)
        return out

    def _shaped_by_values(self, func: Any, args: Any, kwargs: Any) -> Any:
        """An op whose output shape depends on values (the fake kernel refused it), from the known values:
        outputs made empty on the simulated device with the real result's shapes (``_follow`` then gives
        them the values), or the op run with each known boolean index replaced by its nonzero indices."""
        device = next(a.device for a in tree_flatten((args, kwargs))[0] if _simulated(a))
        values = self._values(args, kwargs)
        if values is not None:
            with without_dispatch_modes():
                result = func(*values[0], **values[1])
            return tree_map(lambda r: torch.empty(r.shape, dtype=r.dtype, device=device)
                            if isinstance(r, torch.Tensor) else r, result)
        unknown = False

        def positions(a: Any) -> Any:
            nonlocal unknown
            if not (isinstance(a, torch.Tensor) and a.dtype == torch.bool and _simulated(a)):
                return a
            v = value_of(a)
            if v is None:
                unknown = True
                return a
            with without_dispatch_modes():
                counts = [len(ix) for ix in v.nonzero(as_tuple=True)]
            return [torch.empty(n, dtype=torch.long, device=device) for n in counts]

        if func not in _INDEXING:
            raise
        indices = [] if args[1] is None else [p for ix in args[1] for p in
                                              (positions(ix) if ix is not None else [None])]
        if unknown:
            raise
        return func(args[0], indices, *args[2:], **kwargs)

    def _values(self, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """``(args, kwargs)`` with every simulated tensor replaced by its value and every simulated
        device by the CPU, where the values are computed; None if a simulated tensor has none."""
        missing = False

        def real(a: Any) -> Any:
            nonlocal missing
            if isinstance(a, torch.device) and a.type == "meta":
                return torch.device("cpu")
            if not isinstance(a, torch.Tensor):
                return a
            v = value_of(a)
            if v is None:
                missing = True
                return a
            return v

        swapped = tree_map(real, (args, kwargs))
        return None if missing else swapped

    def _follow(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Give ``out`` values computed from the inputs' (or forget a stale one, in place)."""
        outs = [o for o in _leaves(out) if _simulated(o)]
        if not outs:
            return
        values = None
        if (all(o.numel() <= LIMIT for o in outs) and torch.Tag.nondeterministic_seeded not in func.tags
                and all(value_of(a) is not None for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor))):
            values = self._values(args, kwargs)
        if values is None:
            for o in outs:  # an in-place op with an unknown input: the old value is stale
                if getattr(o, _ATTR, None) is not None:
                    delattr(o, _ATTR)
            return
        with without_dispatch_modes():
            result = func(*values[0], **values[1])
        reals = [r for r in tree_flatten(result)[0] if isinstance(r, torch.Tensor)]
        if len(reals) != len(outs):
            return
        for o, r in zip(outs, reals):
            if tuple(o.shape) == tuple(r.shape) and o.dtype == r.dtype:
                if getattr(o, _ATTR, None) is None:
                    self.alive += 1
                    weakref.finalize(o, self._gone)
                setattr(o, _ATTR, r)

    def _gone(self) -> None:
        self.alive -= 1


_ACTIVE: list[KnownValues] = []  # the mode in force, so that a nested known_values() reuses it


@contextmanager
def known_values() -> Iterator[KnownValues]:
    """Keep the values of small tensors through the ops run inside (module docstring). Re-entrant:
    inside another ``known_values()`` it is that one (a second mode would follow every op twice)."""
    if _ACTIVE:
        yield _ACTIVE[-1]
        return
    mode = KnownValues()
    _ACTIVE.append(mode)
    try:
        with mode:
            yield mode
    finally:
        _ACTIVE.pop()
