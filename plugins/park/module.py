"""Parking one frozen module: its weights on the host, swapped onto the device for each call
(:func:`park_module`, the twin of ``offload=park``'s placement; see plugins/park/__init__.py)."""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from runner.side_streams import cuda_like
from runner.blocks import outermost
from runner.compat import has_compatible_shallow_copy_type
from runner.module_changes import mark, marked, unmark
from runner.plugins.park.align import first_device, outputs_for, report_device, send_to

PARK_METHODS = ("forward", "encode", "decode")
MARK = "park"  # runner.module_changes mark: the module's ParkedModule


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ParkedModule:
    """A frozen module whose weights live on ``host`` and are swapped onto ``device`` per call.

    Calls nest (``vae.forward`` calls ``vae.encode``): weights are moved in by the outermost
    call and out when it returns. ``loads`` counts the moves in. The outermost call also aligns
    devices (plugins/park/align.py): its tensor inputs go to ``device``, its outputs back to where
    the caller's inputs were. ``module.device`` reads ``device``; ``next(module.parameters()).device``
    reads the host between calls (the weights really are there) and ``device`` during one.
    """

    def __init__(self, module: nn.Module, device: torch.device, host: torch.device, pin_memory: bool,
                 skip: frozenset[int] = frozenset()) -> None:
        """``skip``: ids of submodules left out (their weights and calls are another ParkedModule's)."""
        self.module_ref = weakref.ref(module)
        self.device, self.host = torch.device(device), torch.device(host)
        self.pinned = bool(pin_memory) and cuda_like(self.device)
        self.depth = 0
        self.loads = 0
        self.swapped: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param or buffer, its host data)
        self.moved: list[nn.Module] = []  # leaf modules with quantized parameter types: Module.to
        seen: set[int] = set()  # tied weights (T5's shared embedding) are one tensor: swap it once
        for sub in module.modules():
            if id(sub) in skip:
                continue
            own_params = list(sub.parameters(recurse=False))
            if any(type(p) is not nn.Parameter for p in own_params):
                self.moved.append(sub)
                sub.to(self.host)
                continue
            for t in [*own_params, *sub.buffers(recurse=False)]:
                if id(t) in seen:
                    continue
                seen.add(id(t))
                if t.device != self.host:
                    t.data = t.data.to(self.host)
                if self.pinned:
                    t.data = t.data.pin_memory()
                self.swapped.append((t, t.data))
        self.nbytes = _bytes(h for _, h in self.swapped) + sum(
            _bytes([*m.parameters(recurse=False), *m.buffers(recurse=False)]) for m in self.moved
        )
        # ``param.data = x`` needs tensors of one implementation type (CPU and CUDA are); ``meta``,
        # the planner's simulated device, is not, so there the tensors' contents are exchanged
        # with torch.utils.swap_tensors instead (same objects, same effect, frozen tensors only).
        probe = torch.empty(0, device=self.host)
        self.swap_objects = not has_compatible_shallow_copy_type(probe, torch.empty(0, device=self.device))
        self._holders: list[torch.Tensor] = []
        self.wrapped: dict[str, Any] = {}  # method name -> the instance attribute it replaced (or None)
        for name in PARK_METHODS:
            if callable(getattr(type(module), name, None)):
                self.wrapped[name] = module.__dict__.get(name)
                setattr(module, name, self._wrapper(name, self.wrapped[name]))
        self._callers: list[torch.device | None] = []  # per outermost call: where its inputs were
        self.hooks = [h for sub in list(module.modules())[1:] if id(sub) not in skip
                      for h in (sub.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
                                sub.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True))]
        self.own_class = report_device(module, self.device)  # the class to restore, None if unchanged
        mark(module, MARK, self)

    def _arrive(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Enter; an outermost call's tensor inputs to the device (where they were is remembered)."""
        outermost = self.depth == 0
        self.enter()
        if not outermost:
            return args, kwargs
        self._callers.append(first_device((args, kwargs)))
        return send_to(args, self.device), send_to(kwargs, self.device)

    def _leave(self, outputs: Any) -> Any:
        """Exit; an outermost call's outputs back where its caller's inputs were."""
        self.exit()
        if self.depth == 0 and self._callers:
            return outputs_for(self._callers.pop(), self.device, outputs)
        return outputs

    def _pre_hook(self, _module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return self._arrive(args, kwargs)

    def _post_hook(self, _module: nn.Module, _args: Any, _kwargs: Any, outputs: Any) -> Any:
        return self._leave(outputs)

    def _wrapper(self, name: str, previous: Any) -> Callable[..., Any]:
        module_ref, cls_fn = self.module_ref, getattr(type(self.module_ref()), name)

        def call(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = self._arrive(args, kwargs)
            outputs = None
            try:
                outputs = previous(*args, **kwargs) if previous is not None else cls_fn(module_ref(), *args, **kwargs)
            finally:
                outputs = self._leave(outputs)
            return outputs

        return call

    def enter(self) -> None:
        if self.depth == 0:
            if self.swap_objects:
                self._holders = []
                for t, host in self.swapped:
                    dev = host.to(self.device)
                    holder = nn.Parameter(dev, requires_grad=False) if isinstance(t, nn.Parameter) else dev
                    torch.utils.swap_tensors(t, holder)
                    self._holders.append(holder)
            else:
                for t, host in self.swapped:
                    t.data = host.to(self.device, non_blocking=self.pinned)
            for m in self.moved:
                m.to(self.device)
            self.loads += 1
        self.depth += 1

    def exit(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            if self.swap_objects:
                for (t, _), holder in zip(self.swapped, self._holders):
                    torch.utils.swap_tensors(t, holder)
                self._holders = []
            else:
                for t, host in self.swapped:
                    t.data = host  # pointer swap: the device copy is released, nothing copied back
            for m in self.moved:
                m.to(self.host)

    def remove(self) -> None:
        """Restore the module's methods; its weights stay on the host."""
        module = self.module_ref()
        if module is None:
            return
        for name, previous in self.wrapped.items():
            if previous is None:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, previous)
        for h in self.hooks:
            h.remove()
        if self.own_class is not None and getattr(type(module), "_parked_base", None) is self.own_class:
            module.__class__ = self.own_class
        unmark(module, MARK)


def park_module(
    module: nn.Module, device: torch.device | str, host: torch.device | str = "cpu", pin_memory: bool = True,
    skip: frozenset[int] = frozenset(),
) -> ParkedModule:
    """Keep ``module``'s weights on ``host`` and move them to ``device`` for each call.

    Only for frozen modules: a trained parameter's optimizer would keep updating the host copy
    while gradients were computed against a device copy that is thrown away. Undo with
    :meth:`ParkedModule.remove` (or :func:`unpark_module`).
    """
    if any(p.requires_grad for p in module.parameters()):
        raise ValueError("park_module() is for frozen modules; this one has parameters with requires_grad=True")
    if marked(module, MARK) is not None:
        return marked(module, MARK)
    return ParkedModule(module, torch.device(device), torch.device(host), pin_memory, skip)


def park_in_blocks(module: nn.Module, device: torch.device | str, host: torch.device | str = "cpu",
                   pin_memory: bool = True) -> list[ParkedModule]:
    """``offload.park.fill=stream``: ``module``'s blocks each parked on its own, so one block's weights are on
    the device at a time, and the rest (embeddings, norms) for the whole call. Its blocks: the outermost
    children of its ``nn.ModuleList``s (T5's ``encoder.block``, Mistral's and its vision tower's ``layers``, a
    VAE's ``down_blocks``); not runner/blocks.py's denoiser rules, which take Mistral 3's declared block class,
    its vision tower's. Undo with :meth:`ParkedModule.remove` on each (blocks first in the list, the module last)."""
    in_lists = {id(child) for m in module.modules() if isinstance(m, nn.ModuleList) for child in m}
    blocks = outermost(module, lambda m: id(m) in in_lists)
    parked = [park_module(b, device, host, pin_memory) for b in blocks]
    skip = frozenset(id(m) for b in blocks for m in b.modules())
    return parked + [park_module(module, device, host, pin_memory, skip)]


def unpark_module(module: nn.Module) -> None:
    parked = marked(module, MARK)
    if parked is not None:
        parked.remove()
