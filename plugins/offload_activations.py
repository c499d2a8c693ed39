"""Saved activations in host memory (``offload=activations``).

Everything autograd saves for backward during forward goes through
``torch.autograd.graph.saved_tensors_hooks``: the pack hook copies each large activation to
pinned host memory on a side stream and the unpack hook brings it back in backward, a few
tensors ahead of need. The device then holds activations only while they are produced and
consumed. Modelled on torchtune's ``OffloadActivations``:

* parameters, views of parameters, module buffers, tensor subclasses, non-dense tensors and
  tensors under ``min_bytes`` (1 KiB) stay where they are: weights are not activations, and
  small copies cost more than they save;
* with streams, the device tensor of each copy is kept in a small stash (``max_fwd_stash``
  copies) until its copy has landed, so its memory is not reused too early, then the compute
  stream waits for the copy and the tensor is dropped; tensors still stashed when backward
  starts are used directly, without a round trip;
* in backward, unpacking tensor ``i`` also starts copying the next ``prefetch`` offloaded
  tensors (saved earlier in forward, needed next) on the side stream;
* a warning is logged when host RAM use passes ``ram_warn_pct`` (60%) after the first step.

With activation checkpointing (``checkpoint=blocks``) only the checkpointed blocks' inputs are
saved outside the recomputed regions, so those boundary tensors are what moves; the two
combine into the smallest activation footprint for one extra forward pass of compute.

Pinned host copies come from PyTorch's caching host allocator (``pin_memory=True``): activation
sizes repeat every step, so its cache serves them without new page-locking, at the price of
rounding each block up to a power of two. On a CPU run there is nothing to move (device is the
host) unless ``always_copy`` (tests), and under the planner's fake tensors the copies are
synchronous ``to(host)`` calls, so the planner sees device bytes fall and host bytes rise.

The hooks are entered around every forward+backward through ``ctx.step_contexts``; a disabled
plugin adds nothing there. They mark themselves composable, so ``offload=stream``'s per-block
hooks (which keep weights out of the saved tensors) pass activations on to them.
"""
from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from torch import nn

from runner.side_streams import cuda_like, is_real_accelerator, record_stream, stream_api
from runner.compat import current_graph_task_id, is_fake, queue_engine_callback
from runner.context import Transfer
from runner.module_changes import composable
from runner.plugin import Plugin
from runner.plugins.schemas import ActivationOffloadConfig, check_activation_offload
from runner.registry import register_plugin

if TYPE_CHECKING:
    from runner.context import RunContext

log = logging.getLogger("runner")


def check_config(c: Any, key: str = "offload.activations") -> None:
    """This plugin's settings (runner/plugins/schemas.py)."""
    check_activation_offload(c, key)


class _Region:
    """One host copy: the memory span of a saved tensor, as a flat buffer."""

    __slots__ = ("id", "host", "device", "__weakref__")

    def __init__(self, rid: int, host: torch.Tensor, device: torch.device) -> None:
        self.id = rid
        self.host = host
        self.device = device


class _Offloaded:
    """What autograd keeps instead of an offloaded activation: its region and its view of it."""

    __slots__ = ("region", "shape", "stride", "offset")

    def __init__(self, region: _Region, shape: tuple, stride: tuple, offset: int) -> None:
        self.region = region
        self.shape = shape
        self.stride = stride
        self.offset = offset

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.as_strided(self.shape, self.stride, flat.storage_offset() + self.offset)


@dataclass
class ActivationStats:
    offloaded: int = 0  # tensors copied to the host
    offloaded_bytes: int = 0
    live_host_bytes: int = 0  # offloaded bytes held on the host right now
    peak_host_bytes: int = 0  # most offloaded bytes held on the host at once
    kept: int = 0  # saved tensors left on the device (weights, small, non-dense)
    deduplicated: int = 0  # saved again while already offloaded (one host copy serves both)
    reused_from_stash: int = 0  # brought back without a copy (still on the device)
    prefetched: int = 0  # brought back ahead of need
    waited: int = 0  # brought back on demand


DEFAULT_STREAMS: Any = object()  # "the device's own stream API" (none on meta or the CPU)

def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense (any dimension order): a host copy with the same strides holds
    exactly its elements. Expanded or strided views are left on the device."""
    try:
        dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
        expected = 1
        for st, sz in dims:
            if st != expected:
                return False
            expected *= sz
        return True
    except Exception:  # symbolic shapes
        return False


class ActivationOffloader:
    """Persistent state (streams, statistics) of activation offloading; call it for the hooks of one step.

    ``with offloader(): loss = model(x); loss.backward()``.
    """

    def __init__(self, device: torch.device | str, host: torch.device | str = "cpu", *, min_bytes: int = 1024,
                 use_streams: bool = True, max_fwd_stash: int = 5, prefetch: int = 2, pin_memory: bool = True,
                 ram_warn_pct: float = 60.0, skip: Iterable[torch.Tensor] = (), always_copy: bool = False,
                 streams: Any = DEFAULT_STREAMS) -> None:
        self.device = torch.device(device)
        self.host = torch.device(host)
        self.min_bytes = int(min_bytes)
        self.max_fwd_stash = max(1, int(max_fwd_stash))
        self.prefetch = int(prefetch)
        self.ram_warn_pct = float(ram_warn_pct)
        self.always_copy = always_copy
        self.stats = ActivationStats()
        self._skip = {id(t) for t in skip}
        # The stream API of the target (runner/side_streams.py): the GPU's, the in-order simulation of a CUDA
        # target on meta or the CPU (the planner, tests), or None for the synchronous path.
        api = stream_api(self.device, cuda_like=False) if streams is DEFAULT_STREAMS else streams
        self.pin = bool(pin_memory) and cuda_like(self.device)
        self.use_streams = bool(use_streams) and api is not None
        self._api = api if self.use_streams else None
        self._stream = self._api.Stream(device=self.device) if self.use_streams else None
        self._next_id = 0
        self._live: weakref.WeakValueDictionary[int, _Region] = weakref.WeakValueDictionary()
        self._fwd_stash: dict[int, tuple[torch.Tensor, Any]] = {}  # id -> (device tensor, copy event)
        self._ready: dict[int, tuple[torch.Tensor, Any]] = {}  # id -> (device tensor, copy event), prefetched
        self._packed: dict[tuple, tuple[Any, Any]] = {}  # this forward's copies, by storage and view
        self._callback_task: int | None = None
        self._warned = False
        self._steps = 0

    # -- decisions --------------------------------------------------------------------------
    def _offloadable(self, t: torch.Tensor) -> bool:
        if t.device == self.host and not self.always_copy:
            return False
        if t.numel() * t.element_size() < self.min_bytes:
            return False
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return False
        if id(t) in self._skip or (t._base is not None and id(t._base) in self._skip):
            return False
        if type(t) is not torch.Tensor and not is_fake(t):  # quantized and other subclasses
            return False
        return _dense(t)

    # -- hooks ------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        if not self._offloadable(t):
            self.stats.kept += 1
            return t
        # A dense view covers exactly `numel` elements from its storage offset: that span is
        # copied once, and every saved view of it (x and x.t(), or x saved by two nodes) is
        # rebuilt from the same host copy. The key holds the storage weakly: a storage freed
        # since cannot match a new one at the same address.
        storage = t.untyped_storage()
        start, n = t.storage_offset(), t.numel()
        key = (storage._cdata, start, n, t.dtype)
        shape, stride = tuple(t.shape), tuple(t.stride())
        hit = self._packed.get(key)
        if hit is not None and hit[0]() is storage:
            region = hit[1]()
            if region is not None:
                self.stats.deduplicated += 1
                return _Offloaded(region, shape, stride, 0)
        self._next_id += 1
        rid = self._next_id
        span = t.detach().as_strided((n,), (1,), start)
        if self.use_streams:
            current = self._api.current_stream(self.device)
            # Drop stashed tensors whose copies are old enough: the compute stream waits for the
            # copy, so their memory can be reused by later kernels on it.
            while len(self._fwd_stash) >= self.max_fwd_stash:
                old = next(iter(self._fwd_stash))
                _, ev = self._fwd_stash.pop(old)
                current.wait_event(ev)
            self._stream.wait_stream(current)
            with self._api.stream(self._stream):
                host = torch.empty((n,), dtype=span.dtype, device=self.host, pin_memory=self.pin)
                host.copy_(span, non_blocking=True)
                event = self._stream.record_event()
            self._fwd_stash[rid] = (span, event)
        else:
            host = span.to(self.host, copy=True)
        nbytes = n * span.element_size()
        st = self.stats
        st.offloaded += 1
        st.offloaded_bytes += nbytes
        st.live_host_bytes += nbytes
        st.peak_host_bytes = max(st.peak_host_bytes, st.live_host_bytes)
        region = _Region(rid, host, t.device)
        self._live[rid] = region
        self._packed[key] = (weakref.ref(storage), weakref.ref(region))
        weakref.finalize(region, _forget, weakref.ref(st), nbytes)  # autograd dropped it: its host copy is freed
        return _Offloaded(region, shape, stride, 0)

    def _bring_back(self, region: _Region) -> tuple[torch.Tensor, Any]:
        """Start copying ``region`` back to its device; (flat tensor, event or None)."""
        if not self.use_streams:
            return region.host.to(region.device, copy=True), None
        with self._api.stream(self._stream):
            dev = region.host.to(region.device, non_blocking=True)
            return dev, self._stream.record_event()

    def _unpack(self, x: Any) -> torch.Tensor:
        if not isinstance(x, _Offloaded):
            return x
        self._first_backward_call()
        region = x.region
        rid = region.id
        if rid in self._fwd_stash:  # the copy may still be in flight, but the device tensor is here
            self.stats.reused_from_stash += 1
            return x.view(self._fwd_stash[rid][0])
        if rid in self._ready:
            dev, event = self._ready.pop(rid)
            self.stats.prefetched += 1
        else:
            dev, event = self._bring_back(region)
            self.stats.waited += 1
        if event is not None:
            current = self._api.current_stream(self.device)
            current.wait_event(event)
            record_stream(dev, current)  # allocated on the copy stream, used on this one
        self._prefetch_below(rid)
        return x.view(dev)

    def _prefetch_below(self, rid: int) -> None:
        """Start copying back the regions backward needs next, so that at most ``prefetch`` are on the
        device (in flight or ready) beyond the one in use. Regions already prefetched count toward
        the window: counting only new ones let the window grow by one region per unpack (every
        unpack used one and started ``prefetch`` more), which held ~23 block inputs of Wan at once."""
        if not self.prefetch or not self.use_streams:
            return
        window = sum(1 for r in self._ready if r < rid)
        probe = rid - 1
        while window < self.prefetch and probe > 0 and rid - probe <= 256:
            region = self._live.get(probe)
            if region is not None and probe not in self._ready and probe not in self._fwd_stash:
                self._ready[probe] = self._bring_back(region)
                window += 1
            probe -= 1

    def _first_backward_call(self) -> None:
        task = current_graph_task_id()
        if task == -1 or task == self._callback_task:
            return
        self._callback_task = task
        self._packed.clear()  # forward is over: later packs belong to a new forward
        queue_engine_callback(self._end_of_backward)
        if self._fwd_stash and self.use_streams:
            current = self._api.current_stream(self.device)
            for _, ev in self._fwd_stash.values():
                current.wait_event(ev)
        if not self._warned and self.stats.offloaded:
            self._check_ram()

    def _end_of_backward(self) -> None:
        self._callback_task = None
        self._ready.clear()  # prefetched but never used (a branch without backward)
        self._fwd_stash.clear()

    def _check_ram(self) -> None:
        try:
            import psutil

            pct = psutil.virtual_memory().percent
        except Exception:  # pragma: no cover
            return
        if pct > self.ram_warn_pct:
            self._warned = True
            log.warning("activation offload: host RAM is %.0f%% used (more than %.0f%%); pinned activations may "
                        "push the host into swap. Lower the batch size or add checkpoint=blocks.", pct, self.ram_warn_pct)

    @contextmanager
    def __call__(self) -> Iterator[None]:
        """The saved-tensor hooks for one forward+backward."""
        pack, unpack = self._pack, self._unpack

        def pack_hook(t: torch.Tensor) -> Any:
            return pack(t)

        def unpack_hook(x: Any) -> torch.Tensor:
            return unpack(x)

        composable(pack_hook)  # offload=stream's block hooks delegate activations to us
        composable(unpack_hook)
        with torch.autograd.graph.saved_tensors_hooks(pack_hook, unpack_hook):
            yield
        self._packed.clear()
        self._steps += 1

    def reset(self) -> None:
        """Forget a failed step (OOM)."""
        self._packed.clear()
        self._fwd_stash.clear()
        self._ready.clear()
        self._callback_task = None


def _forget(stats_ref: Any, nbytes: int) -> None:
    st = stats_ref()
    if st is not None:
        st.live_host_bytes -= nbytes


def offload_activations(device: torch.device | str, host: torch.device | str = "cpu", *, min_bytes: int = 1024,
                        use_streams: bool = True, max_fwd_stash: int = 5, prefetch: int = 2, pin_memory: bool = True,
                        ram_warn_pct: float = 60.0, skip_modules: Iterable[nn.Module] = (),
                        always_copy: bool = False, streams: Any = DEFAULT_STREAMS) -> ActivationOffloader:
    """The twin: an :class:`ActivationOffloader`; ``with it(): forward and backward``.

    ``skip_modules``: their buffers are never offloaded (they are not activations).
    ``always_copy`` makes a CPU run copy saved tensors anyway (tests exercise the paths).
    ``streams``: the stream API (runner/side_streams.py:stream_api); by default the device's own, so
    ``meta`` and the CPU take the synchronous path unless a CUDA target's simulation is passed.
    """
    skip = [b for m in skip_modules for b in m.buffers()]
    return ActivationOffloader(device, host, min_bytes=min_bytes, use_streams=use_streams, max_fwd_stash=max_fwd_stash,
                               prefetch=prefetch, pin_memory=pin_memory, ram_warn_pct=ram_warn_pct, skip=skip,
                               always_copy=always_copy, streams=streams)


@register_plugin
class ActivationOffload(Plugin):
    kind = "offload"
    name = "activations"
    fit_knob = "activations"
    Config = ActivationOffloadConfig

    def wrap_execution(self, ctx: RunContext) -> None:
        if self.run.target == "cpu":  # decided once, so the CPU plan and the CPU run agree
            log.info("activations: the device is the host (a CPU run): saved tensors stay where they are")
            self.offloader = None
            return
        c = self.config
        self.offloader = offload_activations(
            ctx.device, ctx.host, min_bytes=int(c.min_bytes), use_streams=bool(c.use_streams),
            max_fwd_stash=int(c.max_fwd_stash), prefetch=int(c.prefetch), pin_memory=bool(c.pin_memory),
            ram_warn_pct=float(c.ram_warn_pct), skip_modules=[m for _, m in ctx.models.items()],
            streams=stream_api(ctx.device, cuda_like=self.run.on_cuda),  # the planner takes the GPU's branch too
        )
        ctx.step_contexts.append(self.offloader)

    def on_step_start(self, ctx: RunContext, step: int) -> None:
        offloader = getattr(self, "offloader", None)
        self._offloaded_before = offloader.stats.offloaded_bytes if offloader is not None else 0

    def on_step_end(self, ctx: RunContext, step: int) -> None:
        """Record this step's copies for the step-time model: each offloaded byte goes out and comes back."""
        offloader = getattr(self, "offloader", None)
        if offloader is None:
            return
        moved = offloader.stats.offloaded_bytes - getattr(self, "_offloaded_before", 0)
        ctx.facts.transfers[self.key] = Transfer(h2d_bytes=moved, d2h_bytes=moved,
                                                 overlapped=bool(self.config.use_streams) and self.run.on_cuda)

    def on_oom(self, ctx: RunContext, step: int, error: BaseException) -> None:
        if getattr(self, "offloader", None) is not None:
            self.offloader.reset()

    def teardown(self, ctx: RunContext) -> None:
        offloader = getattr(self, "offloader", None)
        if offloader is None:
            return
        if offloader in ctx.step_contexts:
            ctx.step_contexts.remove(offloader)
        ctx.notes["activations: peak bytes on the host"] = offloader.stats.peak_host_bytes
        ctx.notes["activations: bytes offloaded"] = offloader.stats.offloaded_bytes
        if self.config.pin_memory:  # pinned on the target GPU (the planner's contract)
            ctx.note_pinned_bytes(offloader.stats.peak_host_bytes)
        self.offloader = None
