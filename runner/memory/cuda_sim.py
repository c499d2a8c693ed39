"""``train.device=cuda_sim``: the CUDA code path of a whole run, executed on the CPU.

Why: the planner plans what a GPU runs (side streams, prefetch and stash windows, pinned buffers,
the caching allocator), and a CPU run takes the synchronous branches instead, so nothing but a
lent GPU ran the path the plan describes. This device runs it on the CPU with real values, and
answers the questions a user asks before renting a card: does it fit, what peaks, does OOM
recovery work.

How a CPU tensor is "on the card"
---------------------------------
The run's device is ``cpu:0`` (:data:`SIM_DEVICE`) and its host ``cpu``. PyTorch treats the two as
different devices in ``.to()`` (so ``x.to(cpu:0)`` is a real copy, as a host-to-device copy is) while
both are ordinary CPU memory. Every storage is *placed* when it is born, by the op that made it:
a ``device=`` argument places it there; otherwise it is on the card when any input is, or when
the user-level call it is made in has an input on the card (a C++ op such as ``pad_sequence`` makes
its output with its inputs' real device, a bare ``cpu`` at the dispatcher), else on the host. An op
that mixes card and host tensors raises the error CUDA raises (0-dim host scalars, empty tensors,
copies and host index tensors excepted, as on CUDA): both are CPU memory here, and without the
check a device mismatch that stops a GPU run at its first encode would pass (it found three:
park's encoders called through an inner model, FLUX.2 klein's ids on the parked encoder's host
device). A torch-function mode makes the rest of the CUDA semantics hold:

* ``t.device`` of a storage on the card reads ``cpu:0``, so ``torch.arange(..., device=x.device)``
  in model code lands on the card and ``p.device == run.device`` holds;
* ``.to(place)`` aliases when the tensor is already there (as on a GPU) and copies otherwise;
  ``.cpu()`` of a card tensor copies to the host;
* ``pin_memory()`` / ``pin_memory=True`` give host tensors that :meth:`Tensor.is_pinned` reports
  as pinned (a CPU-only torch has no pinned allocator), and their bytes are counted;
* side streams and events are :mod:`runner.side_streams`'s simulated ones: work runs in order, so a
  tensor used on a side stream lives exactly as long as the plugin keeps a reference to it
  (its stash or prefetch window), which is what the caching allocator would keep.

What the host does is counted too (:class:`HostCounts`): every kernel or copy dispatched on the card (``card_ops``;
views and allocations launch nothing: runner/memory/op_kinds.py, the planner's definition) and
every host sync (``host_syncs``): a read of a card value on the host (``.item()``, ``float``/``int``/``bool``
of a card tensor, ``.tolist()``), a blocking copy from the card to the host, and a synchronize of a
simulated stream or event. On a GPU each sync stops the CPU until the card has caught up, so the CPU
can no longer queue work ahead of it; the loop writes both per step to metrics.jsonl and
job_summary.json (``host_syncs_per_step``, ``card_ops_per_step``).

What is measured: the live-bytes tracker (:class:`runner.memory.live_bytes.LiveBytesTracker`)
counts card storages under ``"cuda_sim"`` and host ones under ``"cpu"``; the card's births and deaths
drive :class:`runner.memory.caching_allocator.CachingAllocatorModel` with the budget as its cap,
so allocated and reserved bytes are the allocator's and a request the capped allocator cannot serve
raises the real ``torch.OutOfMemoryError`` (OOM recovery runs as on a card).

Trade-offs: every op goes through Python (a tiny model's step runs a few times slower than on the
plain CPU); the simulated card is the one process's: ``dist`` is refused with it; a storage made
before the simulation started (the prompts encoded for samples) counts as host memory.
"""
from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from runner.side_streams import SIM_DEVICE, SYNC_OBSERVERS, is_simulated_cuda
from runner.compat import TorchFunctionMode, engine_run_backward, parse_to, tree_iter
from runner.memory.caching_allocator import CachingAllocatorModel
from runner.memory.live_bytes import LiveBytesTracker, _storage_of
from runner.memory.op_kinds import launches_nothing

DEVICE_KEY = "cuda_sim"
"""The tracker's name for storages on the simulated card."""

HOST_KEY = "cpu"

_HOST_MOVE = torch.device("cpu", 1)
"""Where a move to the host goes: ``.to(cpu)`` of a tensor that reports ``cpu`` would alias, so the
move is made to another CPU index, which PyTorch copies (as a device-to-host copy is a copy)."""


_HOST = torch.device("cpu")
_aten = torch.ops.aten
# Ops that legitimately take card and host tensors together on CUDA: copies and moves between the
# two, in-place storage swaps, and indexing with host index tensors (moved by the op).
_CROSSING_OPS = {_aten._to_copy, _aten.copy_, _aten.copy, _aten._copy_from, _aten._copy_from_and_resize, _aten.to,
                 _aten.set_, _aten.index, _aten.index_put_, _aten.index_put, _aten._index_put_impl_, _aten.lift_fresh,
                 _aten.detach, _aten.alias, _aten.record_stream}


# A host sync: the CPU reads a card value (``.item()``; ``float``/``int``/``bool`` of a tensor dispatch it).
_SYNC_OPS = {_aten._local_scalar_dense.default}
# Copies: one from the card into host memory that is not non_blocking is a host sync.
_COPY_PACKETS = {_aten._to_copy, _aten.copy_}
# bitsandbytes' 4-bit matmul: on CUDA, past its custom kernel's range of rows (all but a few tokens), it
# dequantizes the whole weight to the input's dtype and runs F.linear; the CPU kernel's own temporaries are
# invisible to the tracker, so the card allocates that weight around the op, as the planner does
# (plugins/quantization/bnb.py).
_DEQUANT_MATMULS = frozenset({"bitsandbytes::gemm_4bit"})
# torch modules whose ``.to(device)`` passes the real device of card tensors (a bare ``cpu`` here): on a GPU
# that is the card, so no move (torch.nn.utils.clip_grad moves the clip coefficient to the gradients' device).
_REAL_DEVICE_CALLERS = {"torch.nn.utils.clip_grad"}
_MODE_MODULES = {__name__, "runner.memory.semantics", "torch.overrides", "torch.utils._python_dispatch"}


def _caller_module() -> str | None:
    """The module of the code that made the call the function modes are handling (past the modes' frames)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in _MODE_MODULES:
        frame = frame.f_back
    return frame.f_globals.get("__name__") if frame is not None else None


def _requested_place(device: Any) -> str:
    """Where a call that names ``device`` asks to be: ``cpu:0`` is the card, any other CPU the host."""
    d = torch.device(device)
    if d.type != "cpu":
        return str(d)
    return DEVICE_KEY if is_simulated_cuda(d) else HOST_KEY


def _dispatched_place(device: Any) -> str | None:
    """Where an op's ``device=`` argument places its output, at the dispatcher: ``cpu:0`` the card,
    ``cpu:1`` the host (every user-level request is rewritten to one of the two), and a bare ``cpu``
    nothing: PyTorch's own code passes a tensor's real device (autograd's ``ToCopyBackward`` returns
    a gradient to its input's device), and for a card tensor that reads ``cpu``; None: inherit."""
    d = torch.device(device)
    if d.type != "cpu":
        return str(d)
    return None if d.index is None else _requested_place(d)

_DEVICE_GETTER = torch.Tensor.device


class _AllocatorFeed:
    """The tracker's births and deaths of card storages, served by the caching allocator's model."""

    def __init__(self, model: CachingAllocatorModel) -> None:
        self.model = model
        self.failed: int | None = None  # bytes of the last request the capped allocator could not serve

    def born(self, device: str, serial: int, nbytes: int) -> None:
        if device == DEVICE_KEY:
            ooms = self.model.ooms
            self.model.alloc(serial, nbytes)
            if self.model.ooms != ooms:  # a real cudaMalloc that fails maps nothing: undo the request
                self.model.free(serial)
                self.model.empty_cache()
                self.failed = nbytes

    def died(self, device: str, serial: int) -> None:
        if device == DEVICE_KEY:
            self.model.free(serial)


class PlacementTracker(LiveBytesTracker):
    """Live bytes per place (card or host), each storage placed by the op that made it."""

    def __init__(self, cap_bytes: int | None = None, expandable_segments: bool = True) -> None:
        super().__init__(count_inputs=False)
        self.allocator = CachingAllocatorModel(expandable_segments, cap_bytes)
        self.alloc_observer = _AllocatorFeed(self.allocator)
        self._op_key = HOST_KEY
        self.call_place: str | None = None  # the user-level call's inputs are on the card (_PlacementCalls)
        self._pinning = 0
        self._pinned: dict[int, tuple[weakref.ref, int]] = {}
        self.card_ops = 0  # kernels and copies dispatched with an input or output on the card (not views)
        self.host_syncs = 0  # reads of card values on the host, blocking copies to it, stream/event synchronizes

    def _count(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Count ``func`` as a card op or a host sync (module docstring)."""
        if func in _SYNC_OPS:
            self.host_syncs += self._on_card(args[0])
            return
        if func.overloadpacket in _COPY_PACKETS:
            copy_ = func.overloadpacket is _aten.copy_
            src = args[1] if copy_ else args[0]
            to_host = (self.place_of(args[0]) if copy_ else self._op_key) == HOST_KEY
            if to_host and self._on_card(src):
                waits = not (kwargs.get("non_blocking") or (copy_ and len(args) > 2 and args[2] is True))
                self.host_syncs += waits  # the CPU waits for a blocking copy to the host
                self.card_ops += not waits
                return
        self.card_ops += self._op_key == DEVICE_KEY and not launches_nothing(func)

    def _on_card(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and self.place_of(t) == DEVICE_KEY

    def place_of(self, t: torch.Tensor) -> str:
        """Where ``t``'s storage lives: :data:`DEVICE_KEY` or the host (also for one never seen)."""
        s = _storage_of(t)
        rec = self._live.get(s._cdata) if s is not None else None
        return rec.device if rec is not None and rec() is s else HOST_KEY

    def _device_key(self, t: torch.Tensor, born: bool) -> str:
        return self._op_key if born else HOST_KEY  # first seen outside its birth: made before, on the host

    def _placement(self, kwargs: dict, args: tuple) -> str:
        if self._pinning:
            return HOST_KEY
        device = kwargs.get("device")
        if device is not None and (place := _dispatched_place(device)) is not None:
            return place
        for t in tree_iter(args):
            if isinstance(t, torch.Tensor) and self.place_of(t) == DEVICE_KEY:
                return DEVICE_KEY
        return self.call_place or HOST_KEY

    def _refuse_mixed(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Raise what CUDA raises for an op that mixes card tensors with host tensors (not 0-dim
        scalars or empty tensors; not a copy or an indexing op, which move their inputs): without this a device
        mismatch that fails at step 1 on a GPU (a parked module's inner model called with its weights
        still on the host) would pass on the simulated card, where both are CPU memory."""
        if func.overloadpacket in _CROSSING_OPS:
            return
        places = {self.place_of(t) for t in tree_iter((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.dim() > 0 and t.numel() > 0}  # empty: no storage to place
        if DEVICE_KEY in places and HOST_KEY in places:
            host = [tuple(t.shape) for t in tree_iter((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0
                    and t.numel() > 0 and self.place_of(t) == HOST_KEY]
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:0 and cpu! (train.device=cuda_sim, in {func}, host tensors of shapes {host}: "
                               "a GPU raises this too)")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self._refuse_mixed(func, args, kwargs or {})
        self._op_key = self._placement(kwargs or {}, args)
        self._count(func, args, kwargs or {})
        self.alloc_observer.failed = None
        dequantized = self._dequantized_weight(func, types, args)  # alive while the op's output is allocated
        out = super().__torch_dispatch__(func, types, args, kwargs)
        del dequantized
        if self._pinning:
            for t in tree_iter(out):
                if isinstance(t, torch.Tensor) and (s := _storage_of(t)) is not None:
                    self._pinned[s._cdata] = (weakref.ref(s), int(s.nbytes()))
        if self.alloc_observer.failed is not None:
            raise torch.OutOfMemoryError(self._oom_message(func, self.alloc_observer.failed))
        return out

    def _dequantized_weight(self, func: Any, types: Any, args: tuple) -> torch.Tensor | None:
        """The compute-dtype weight CUDA's 4-bit matmul materialises (``_DEQUANT_MATMULS``), on the card."""
        if getattr(func, "namespace", None) != "bitsandbytes" or func.name() not in _DEQUANT_MATMULS \
                or self._op_key != DEVICE_KEY:
            return None
        a, shape_b = args[0], args[2]  # gemm_4bit(A, B, shapeB, absmax, ...): the weight is shapeB = (N, K)
        return super().__torch_dispatch__(_aten.empty.memory_format, types, (tuple(int(n) for n in shape_b),),
                                          {"dtype": a.dtype, "device": a.device})

    def _oom_message(self, func: Any, nbytes: int) -> str:
        a = self.allocator
        gib = 2**30
        return (f"CUDA out of memory (train.device=cuda_sim, in {func}): tried to allocate {nbytes / 2**20:.2f} MiB; "
                f"the simulated card's caching allocator is capped at {a.cap / gib:.3f} GiB (budget_gb less the "
                f"kernel-workspace margin) and holds {a.allocated / gib:.3f} GiB allocated, {a.reserved / gib:.3f} GiB "
                "reserved.")

    @contextmanager
    def pinning(self) -> Iterator[None]:
        """Storages born inside are pinned host memory."""
        self._pinning += 1
        try:
            yield
        finally:
            self._pinning -= 1

    def is_pinned(self, t: torch.Tensor) -> bool:
        s = _storage_of(t)
        entry = self._pinned.get(s._cdata) if s is not None else None
        return entry is not None and entry[0]() is s

    def pinned_bytes(self) -> int:
        """Bytes of live pinned host storages."""
        self._pinned = {k: v for k, v in self._pinned.items() if v[0]() is not None}
        return sum(n for _, n in self._pinned.values())

    def memory_stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats()``'s keys the runner reads, for the simulated card, plus the
        unrounded live tensor bytes (what the planner's peak counts)."""
        if self._dead:
            self._drain()
        a = self.allocator
        return {
            "allocated_bytes.all.current": a.allocated, "allocated_bytes.all.peak": a.peak_allocated,
            "reserved_bytes.all.current": a.reserved, "reserved_bytes.all.peak": a.peak_reserved,
            "num_alloc_retries": a.retries, "num_ooms": a.ooms,
            "live_bytes.all.current": self.current.get(DEVICE_KEY, 0), "live_bytes.all.peak": self.peak.get(DEVICE_KEY, 0),
        }

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: the allocator releases what it holds unused."""
        if self._dead:
            self._drain()
        self.allocator.empty_cache()


class _PlacementCalls(TorchFunctionMode):
    """The user-level calls whose meaning depends on where a tensor lives (module docstring)."""

    def __init__(self, tracker: PlacementTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tracker = self.tracker
        if getattr(func, "__self__", None) is _DEVICE_GETTER:
            return SIM_DEVICE if tracker.place_of(args[0]) == DEVICE_KEY else func(*args, **kwargs)
        if func is torch.Tensor.to:
            if _caller_module() in _REAL_DEVICE_CALLERS:
                return self._to_real_device(args, kwargs)
            return self._to(args, kwargs)
        if func is torch.Tensor.cpu:
            t = args[0]
            return t.to(_HOST_MOVE) if tracker.place_of(t) == DEVICE_KEY else t
        if func is torch.Tensor.pin_memory:
            with tracker.pinning():
                return args[0].clone()
        if func is torch.Tensor.is_pinned:
            return tracker.is_pinned(args[0])
        if func is torch.Tensor.tolist and tracker.place_of(args[0]) == DEVICE_KEY:
            tracker.host_syncs += 1  # C++ reads the values after copying them to the host: one sync
        device = kwargs.get("device")
        if device is not None and torch.device(device) == _HOST:  # the caller asks for the host: say so
            kwargs = {**kwargs, "device": _HOST_MOVE}
        if kwargs.get("pin_memory"):
            with tracker.pinning():
                return func(*args, **{**kwargs, "pin_memory": False})
        # A call with card inputs: tensors its C++ implementation makes with the inputs' real device
        # (``pad_sequence``'s output, at the dispatcher a bare ``cpu``) are on the card, as on a GPU.
        outer = tracker.call_place
        tracker.call_place = DEVICE_KEY if any(isinstance(t, torch.Tensor) and tracker.place_of(t) == DEVICE_KEY
                                               for t in tree_iter((args, kwargs))) else None
        try:
            return func(*args, **kwargs)
        finally:
            tracker.call_place = outer

    def _to_real_device(self, args: tuple, kwargs: dict) -> Any:
        """``.to(device)`` from torch code that passes a tensor's real device (a bare ``cpu`` for a card tensor):
        it stays where it is, as on a GPU (clipping moves the clip coefficient to the gradients' device)."""
        t, rest = args[0], args[1:]
        if rest and isinstance(rest[0], (torch.device, str)) and torch.device(rest[0]) == _HOST:
            rest = rest[1:]
        elif isinstance(kwargs.get("device"), (torch.device, str)) and torch.device(kwargs["device"]) == _HOST:
            kwargs = {k: v for k, v in kwargs.items() if k != "device"}
        return self._to((t, *rest), kwargs)

    def _to(self, args: tuple, kwargs: dict) -> Any:
        t, rest = args[0], args[1:]
        kwargs = dict(kwargs)
        copy = bool(kwargs.pop("copy", False))
        device, dtype, non_blocking, memory_format = parse_to(*rest, **kwargs)
        dtype = dtype or t.dtype
        fmt = memory_format or torch.preserve_format
        here = self.tracker.place_of(t)
        if rest and isinstance(rest[0], torch.Tensor):
            want = self.tracker.place_of(rest[0])
        elif device is None:
            want = here
        else:
            want = _requested_place(device)
        if want == here:  # no move: at most a dtype change where it is, as on a GPU
            if copy:
                return t.to(dtype, non_blocking=non_blocking, copy=True, memory_format=fmt)
            return t.to(dtype, non_blocking=non_blocking, memory_format=fmt)
        # A move: to an explicit CPU index, which PyTorch copies (also through a subclass's own .to,
        # e.g. bitsandbytes' Params4bit, which takes no copy= argument).
        target = SIM_DEVICE if want == DEVICE_KEY else _HOST_MOVE if want == HOST_KEY else torch.device(want)
        return t.to(target, dtype, non_blocking=non_blocking, memory_format=fmt)


class NoSimulation:
    """The run's device is real (a GPU or the CPU): nothing is simulated, nothing to enter."""

    active = False
    simulates = False

    def __enter__(self) -> NoSimulation:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def memory_stats(self) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def adopt(self, accelerator: Any) -> None:
        return None


class SimulatedCuda:
    """The simulated card of one run: enter it around the run's placement and steps."""

    simulates = True

    def __init__(self, cap_bytes: int | None, expandable_segments: bool = True, precision: str = "no") -> None:
        from runner.memory.semantics import DeviceSemantics  # CUDA's autocast and attention choice, as planned

        self.tracker = PlacementTracker(cap_bytes, expandable_segments)
        self._calls = _PlacementCalls(self.tracker)
        on_card = lambda x: self.tracker.place_of(x) == DEVICE_KEY
        self.semantics = DeviceSemantics("cuda", precision, on_device=on_card, cpu_kernels=True)
        self.active = False

    def adopt(self, accelerator: Any) -> None:
        """The run's autocast is CUDA's (the planner's emulation of its op lists and weight-cast cache),
        not the CPU's, whose lists differ (group_norm runs in bf16 there, in float32 on CUDA): the
        accelerator is built without a mixed precision and its ``autocast()`` is this one's."""
        accelerator.autocast = self.semantics.autocast
        accelerator.semantics = self.semantics
        accelerator.backward = self.backward

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The backward pass, as the planner runs it: through the engine's entry (``loss.backward()``
        is a call the function modes handle, and while one handles a call it is switched off, so a
        checkpoint's recomputation would run without the card's placement and autocast), under the
        emulated autocast without its cast cache (the forward ran under it: so do recomputations,
        as torch.utils.checkpoint restores CUDA's autocast state)."""
        with self.semantics.autocast(cache=False):
            engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (),
                                allow_unreachable=True, accumulate_grad=True)

    def __enter__(self) -> SimulatedCuda:
        self.tracker.__enter__()
        self._calls.__enter__()
        self.semantics.__enter__()
        SYNC_OBSERVERS.append(self._stream_synchronized)
        self.active = True
        return self

    def _stream_synchronized(self) -> None:
        self.tracker.host_syncs += 1

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        if self._stream_synchronized in SYNC_OBSERVERS:
            SYNC_OBSERVERS.remove(self._stream_synchronized)
        try:
            self.semantics.__exit__(*exc)
        finally:
            try:
                self._calls.__exit__(*exc)
            finally:
                self.tracker.__exit__(*exc)

    def memory_stats(self) -> dict[str, int]:
        return self.tracker.memory_stats()

    def empty_cache(self) -> None:
        self.tracker.empty_cache()

    @property
    def peak_live_bytes(self) -> int:
        return self.tracker.peak.get(DEVICE_KEY, 0)

    @property
    def pinned_bytes(self) -> int:
        return self.tracker.pinned_bytes()


class HostCounts:
    """A step's host syncs and card ops on the simulated card (module docstring); nothing elsewhere."""

    def __init__(self, card: Any) -> None:
        self.tracker: PlacementTracker | None = getattr(card, "tracker", None)
        self._start = (0, 0)

    def begin(self) -> None:
        """The step starts: count from here."""
        if self.tracker is not None:
            self._start = (self.tracker.host_syncs, self.tracker.card_ops)

    def end(self) -> dict[str, int]:
        """The step's metrics columns ``host_syncs`` and ``card_ops`` (none when nothing is simulated)."""
        if self.tracker is None:
            return {}
        return {"host_syncs": self.tracker.host_syncs - self._start[0], "card_ops": self.tracker.card_ops - self._start[1]}
