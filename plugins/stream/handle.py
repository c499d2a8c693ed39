"""The streaming handle: a module whose blocks' weights live on the host between uses.

:func:`apply_stream_offload` plans (runner/plugins/stream/plan.py) and returns a
:class:`StreamHandle`, which owns the host copies and device buffers, issues and waits for the
copies, and undoes everything on ``remove()``. When blocks are loaded and released is decided
by its hooks (runner/plugins/stream/hooks.py).

How training stays correct (where accelerate's cpu_offload and diffusers' group offloading fail):

* **Parameter identity.** Each streamed parameter keeps its ``nn.Parameter`` object, whose data
  lives on the host: the optimizer, ``state_dict`` and checkpoints see it. While a block is
  loaded, its module holds a *device twin* (a second, persistent ``nn.Parameter``) in
  ``module._parameters`` instead (the FSDP2 approach); between uses the twin's data is an empty
  tensor, so the device memory is really returned. Twins persist, so the autograd graph of a
  forward (which holds the twin, e.g. in ``AccumulateGrad``) stays valid when the block is
  reloaded for backward.
* Saved weights, the backward order and the gradients of streamed trained parameters: hooks.py.
"""
from __future__ import annotations

import weakref
from contextlib import nullcontext
from typing import Any, Callable, Iterable

import torch
from torch import nn

from runner.side_streams import cuda_like as on_card
from runner.side_streams import is_real_accelerator, record_stream, stream_api
from runner.compat import has_compatible_shallow_copy_type
from runner.module_changes import mark, marked, unmark
from runner.plugins.host_buffers import HostRegion, host_copy
from runner.plugins.stream.hooks import _StreamHooks
from runner.plugins.stream.schedule import (
    StreamPlan,
    _streamable,
    align,
    guess_execution_order,
    plan_stream,
)
from runner.plugins.stream.state import (
    INFLIGHT,
    LOADED,
    RELEASED,
    StreamStats,
    _Block,
    _Slot,
)

MARK = "stream"  # runner.module_changes mark on a streamed module: its StreamHandle


class StreamHandle(_StreamHooks):
    """A module whose blocks stream their weights; created by :func:`apply_stream_offload`."""

    def __init__(self, module: nn.Module, blocks: list[nn.Module], plan: StreamPlan, device: torch.device,
                 host: torch.device, prefetch: int, pin_memory: bool, always_copy: bool,
                 clear_cast_cache: Callable[[], None] = torch.clear_autocast_cache,
                 cuda_like: bool | None = None) -> None:
        self.module = module
        self.clear_cast_cache = clear_cast_cache
        self.plan = plan
        self.device = device
        self.host = host
        self.prefetch = prefetch
        self.stats = StreamStats()
        self.regions: list[HostRegion] = []
        self._hooks: list[Any] = []
        # The side-stream branch runs wherever the target is CUDA-like (runner/side_streams.py): on the GPU
        # with its streams, in the planner (meta) and on the CPU with simulated ones, so what the
        # plan counts is what the GPU keeps (the copy stream's own allocator pool included).
        cuda_like = device.type == "cuda" if cuda_like is None else cuda_like
        self._api = stream_api(device, cuda_like) if device != host else None
        self.async_copies = self._api is not None
        self.pin = bool(pin_memory) and self.async_copies and on_card(device)
        self.same_storage = device == host and not always_copy
        self._h2d = self._api.Stream(device=device) if self.async_copies else None
        self._d2h = self._api.Stream(device=device) if self.async_copies else None
        self._empties: dict[torch.dtype, torch.Tensor] = {}
        self._pending: list[tuple[Any, _Slot | None]] = []  # (event, slot to add staging into) of d2h copies
        self._callback_task: int | None = None
        self._owners: dict[int, _Slot] = {}  # id(device twin) -> slot
        self.blocks: list[_Block] = []
        self._order: list[int] = []  # block indices in recorded forward execution order
        self._seen: list[int] = []  # blocks called in this forward, in order (one entry per call)
        self._first_pos: dict[int, int] = {}  # block -> position of its first call in this forward
        self._call_pos: dict[int, int] = {}  # block -> position of its call in progress
        self._bwd_seq: list[tuple[int, int]] = []  # (position, block) of calls whose outputs need backward
        self._keep: set[int] = set()
        self._ahead: dict[int, list[int]] = {}
        self._stack: list[tuple[int, Any]] = []  # saved-tensor hooks entered by block pre hooks
        self._learned = False  # the execution order has been recorded by one forward
        self._timing: list[tuple[str, Any, Any, int]] | None = None  # (direction, start, end, bytes) when timed
        self.removed = False
        self._build(blocks)
        self._finalizer = weakref.finalize(self, _close_regions, self.regions)

    # -- construction -----------------------------------------------------------------------
    def _empty(self, dtype: torch.dtype) -> torch.Tensor:
        t = self._empties.get(dtype)
        if t is None:
            t = self._empties[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return t

    def _build(self, blocks: list[nn.Module]) -> None:
        names = {id(m): n for n, m in self.module.named_modules()}
        streamed_slots: set[int] = set()
        for bp, blk in zip(self.plan.blocks, blocks):
            b = _Block(bp.index, blk, names.get(id(blk), bp.name), bp.streamed)
            self.blocks.append(b)
            if not bp.streamed:
                continue
            params, _, _ = _streamable(blk, set())
            # Frozen slots first: they share one host region, laid out exactly like the device buffer.
            params.sort(key=lambda t: t[2].requires_grad)
            offset = 0
            for owner, name, p in params:
                dev = nn.Parameter(self._empty(p.dtype), requires_grad=p.requires_grad)
                s = _Slot(b, owner, name, p, dev, offset)
                offset += align(s.nbytes)
                b.slots.append(s)
                self._owners[id(dev)] = s
                streamed_slots.add(id(p))
            b.flat_bytes = offset
        # Place everything that is not streamed on the device (identity kept where torch allows).
        for m in self.module.modules():
            for n, p in list(m._parameters.items()):
                if p is not None and id(p) not in streamed_slots:
                    _move_param(m, n, p, self.device)
            for n, buf in list(m._buffers.items()):
                if buf is not None:
                    m._buffers[n] = buf.to(self.device)
        for b in self.blocks:
            if b.streamed:
                self._host_layout(b)
        for s in self._all_slots():
            if s.trainable:
                self._hooks.append(s.dev.register_post_accumulate_grad_hook(self._make_grad_hook(s)))
        self._set_order(guess_execution_order(self.module, [b.module for b in self.blocks]))
        self._hooks.append(self.module.register_forward_pre_hook(self._root_pre))
        self._hooks.append(self.module.register_forward_hook(self._root_post, always_call=True))
        for b in self.blocks:
            self._hooks.append(b.module.register_forward_pre_hook(self._make_pre(b)))
            self._hooks.append(b.module.register_forward_hook(self._make_post(b), always_call=True))

    def _host_layout(self, b: _Block) -> None:
        """Move the block's host parameters to (pinned) host memory; frozen ones share one region."""
        frozen = [s for s in b.slots if not s.trainable]
        frozen_bytes = (frozen[-1].offset + align(frozen[-1].nbytes)) if frozen else 0
        if self.pin and frozen:
            region = HostRegion(frozen_bytes, pin=True)
            self.regions.append(region)
            b.region = region
            b.arena = region.tensor[:frozen_bytes]
            b.arena_bytes = frozen_bytes
            for s in frozen:
                view = region.view(s.offset, s.host)
                view.copy_(s.host.detach())
                s.host.data = view
        for s in b.slots:
            if s.trainable and self.pin:
                copy, region = host_copy(s.host, pin=True)
                if region is not None:
                    self.regions.append(region)
                s.host.data = copy
            elif s.host.device != self.host:
                _move_param(s.owner, s.name, s.host, self.host)
                s.host = s.owner._parameters[s.name]

    def _all_slots(self) -> Iterable[_Slot]:
        for b in self.blocks:
            yield from b.slots

    def _set_order(self, order: list[int]) -> None:
        self._order = list(order)
        streamed = [i for i in self._order if self.blocks[i].streamed]
        self._keep = set(streamed[-(self.prefetch + 1):]) if streamed else set()
        self._ahead = {}
        for pos, i in enumerate(self._order):
            nxt = [j for j in self._order[pos + 1:] if self.blocks[j].streamed][: self.prefetch]
            self._ahead[i] = nxt

    # -- loading and releasing --------------------------------------------------------------
    def _flat_view(self, b: _Block, s: _Slot) -> torch.Tensor:
        return b.flat[s.offset:s.offset + s.nbytes].view(s.host.dtype).view(s.host.shape)

    def _issue(self, b: _Block) -> None:
        """Start copying block ``b`` to the device (on the side stream when there is one)."""
        if b.state != RELEASED or not b.streamed:
            return
        self.stats.loads += 1
        if self.same_storage:
            b.state = LOADED
            return
        stream_ctx = self._api.stream(self._h2d) if self.async_copies else nullcontext()
        with stream_ctx:
            timing = self._timing is not None and self.async_copies
            if timing:
                start = self._h2d.record_event(self._api.Event(enable_timing=True))
            flat = torch.empty(b.flat_bytes, dtype=torch.uint8, device=self.device)
            b.flat = flat
            rest = b.slots
            if b.arena is not None:
                flat[:b.arena_bytes].copy_(b.arena, non_blocking=self.async_copies)
                rest = [s for s in b.slots if s.trainable]
            for s in rest:
                self._flat_view(b, s).copy_(s.host.detach(), non_blocking=self.async_copies)
            if self.async_copies:
                b.event = self._h2d.record_event(self._api.Event(enable_timing=True) if timing else None)
                if timing:
                    self._timing.append(("h2d", start, b.event, b.flat_bytes))
        self.stats.h2d_bytes += b.flat_bytes
        b.state = INFLIGHT if self.async_copies else LOADED
        now = self.device_bytes()
        if now > self.stats.peak_device_bytes:
            self.stats.peak_device_bytes = now

    def _use(self, b: _Block) -> None:
        """Make block ``b``'s weights usable on the current stream and install its device twins."""
        if not b.streamed:
            return
        if b.state == RELEASED:
            self.stats.on_demand += 1
            self._make_room()
            self._issue(b)
        if b.state == INFLIGHT:
            self.stats.waited += int(not b.event.query())
            current = self._api.current_stream(self.device)
            current.wait_event(b.event)
            record_stream(b.flat, current)  # allocated on the copy stream, used on this one
            b.event = None
            b.state = LOADED
        for s in b.slots:
            if not s.installed:
                s.dev.data = s.host.data if self.same_storage else self._flat_view(b, s)
                s.owner._parameters[s.name] = s.dev
                s.installed = True

    def _release_slot(self, s: _Slot) -> None:
        if s.installed:
            s.owner._parameters[s.name] = s.host
            s.dev.data = self._empty(s.host.dtype)
            s.installed = False

    def _release(self, b: _Block) -> None:
        if not b.streamed or b.state == RELEASED:
            return
        if b.state == INFLIGHT:  # prefetched but never used: finish the copy before dropping it
            b.event.synchronize()
            b.event = None
        for s in b.slots:
            self._release_slot(s)
        if not any(s.installed for s in b.slots):
            b.flat = None
            b.state = RELEASED

    def _loaded(self) -> list[_Block]:
        return [b for b in self.blocks if b.state != RELEASED]

    def _make_room(self) -> None:
        """Keep at most prefetch+1 blocks loaded: drop prefetched blocks nobody uses yet (a wrong
        guess of the order) before loading one that is needed now."""
        loaded = self._loaded()
        for other in loaded:
            if len(loaded) <= self.prefetch:
                break
            if not any(s.installed for s in other.slots):
                self._release(other)
                loaded.remove(other)

    def _prefetch(self, indices: Iterable[int]) -> None:
        for i in indices:
            b = self.blocks[i]
            if b.state == RELEASED and len(self._loaded()) > self.prefetch:
                break  # the window is full
            self._issue(b)

    # -- lifecycle ------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget a failed step (OOM): drop pending copies and every loaded block."""
        if self.async_copies:
            self._h2d.synchronize()
            self._d2h.synchronize()
        for event, _ in self._pending:
            event.synchronize()
        self._pending.clear()
        self._callback_task = None
        while self._stack:
            _, hooks = self._stack.pop()
            if hooks is not None:
                hooks.__exit__(None, None, None)
        for b in self.blocks:
            self._release(b)

    def time_copies(self, enabled: bool = True) -> None:
        """Record CUDA events around every copy (for benchmarks; costs two events per copy)."""
        self._timing = [] if enabled and self.async_copies and is_real_accelerator(self.device) else None

    def copy_seconds(self) -> dict[str, tuple[float, int]]:
        """{"h2d"|"d2h": (seconds the copy stream spent copying, bytes)} since :meth:`time_copies`.

        Synchronizes. Bytes over seconds is the bandwidth the copies achieved while streaming,
        to compare with a plain pinned copy of the same size.
        """
        out: dict[str, tuple[float, int]] = {}
        for direction, start, end, nbytes in self._timing or []:
            end.synchronize()
            secs, total = out.get(direction, (0.0, 0))
            out[direction] = (secs + start.elapsed_time(end) / 1000.0, total + nbytes)
        if self._timing is not None:
            self._timing.clear()
        return out

    def device_bytes(self) -> int:
        """Bytes of streamed weights on the device right now."""
        return sum(b.flat_bytes for b in self.blocks if b.state != RELEASED and b.flat is not None)

    def pinned_bytes(self) -> int:
        """Host bytes page-locked for this module (0 without CUDA)."""
        return sum(r.nbytes for r in self.regions if r.pinned)

    def host_bytes(self) -> int:
        """Host bytes of streamed weights (pinned or not): what the planner reports as pinned host RAM."""
        return sum(s.nbytes for s in self._all_slots())

    def remove(self, to_device: bool = False) -> None:
        """Detach every hook and drop the streamed weights from the device.

        Streamed parameters stay on the host (unpinned) unless ``to_device``: then they move to
        the device and the module is a plain device module again. Resident parts stay where
        they are.
        """
        if self.removed:
            return
        self.reset()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for s in self._all_slots():
            if to_device:
                _move_param(s.owner, s.name, s.host, self.device)
        self._finalizer()
        self.removed = True


def _close_regions(regions: list[HostRegion]) -> None:
    for r in regions:
        r.close()


def _move_param(owner: nn.Module, name: str, p: nn.Parameter, device: torch.device) -> None:
    """Move one parameter like ``Module.to`` does: same object where torch allows, else a new one."""
    if p.device == device:
        return
    new = p.detach().to(device)
    if has_compatible_shallow_copy_type(p, new):
        p.data = new
    else:  # e.g. fake cpu -> fake meta in the planner
        owner._parameters[name] = nn.Parameter(new, requires_grad=p.requires_grad)


def apply_stream_offload(
    module: nn.Module,
    blocks: list[nn.Module],
    device_budget_bytes: int,
    prefetch: int = 1,
    device: torch.device | str = "cuda",
    host: torch.device | str = "cpu",
    *,
    pin_memory: bool = True,
    always_copy: bool = False,
    name: str = "module",
    plan: StreamPlan | None = None,
    clear_cast_cache: Callable[[], None] = torch.clear_autocast_cache,
    cuda_like: bool | None = None,
) -> StreamHandle:
    """Stream the weights of ``blocks`` (in execution order) of ``module`` within a byte budget.

    Everything outside the streamed blocks is moved to ``device``; the streamed blocks' weights
    go to ``host`` (page-locked when CUDA is available and ``pin_memory``). ``always_copy`` makes
    a CPU run copy weights between host and "device" tensors anyway (tests use it to exercise
    the copy paths). Returns a handle; ``handle.remove()`` undoes the hooks.
    """
    device, host = torch.device(device), torch.device(host)
    if marked(module, MARK) is not None:
        raise ValueError("apply_stream_offload: this module is already streamed; call handle.remove() first")
    plan = plan or plan_stream(module, blocks, device_budget_bytes, prefetch, name)
    handle = StreamHandle(module, blocks, plan, device, host, prefetch, pin_memory, always_copy, clear_cast_cache,
                          cuda_like)
    mark(module, MARK, handle)
    _orig_remove = handle.remove

    def remove(to_device: bool = False) -> None:
        _orig_remove(to_device)
        unmark(module, MARK)

    handle.remove = remove  # type: ignore[method-assign]
    return handle
