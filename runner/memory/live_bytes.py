"""LiveBytesTracker: count live tensor-storage bytes per device, phase, category and module.

Why our own and not ``torch.distributed._tools.MemTracker``: that one is accurate but walks
every module on every op (about 100x slower on an SDXL U-Net). Counting *storages* is enough
for a memory budget: every tensor an op returns is backed by a storage; we add its bytes the
first time we see it and subtract them when the storage dies.

How death is observed
---------------------
PyTorch preserves the Python object of a storage (``tensor.untyped_storage()`` returns the
same object for as long as the C++ storage lives, even after Python dropped every reference
to it), so a ``weakref`` to that object fires exactly when the storage is freed, including
frees done by C++ (autograd releasing saved tensors in backward). ``tests/runner/memory/test_live_bytes.py``
checks this (allocate, delete, bytes go back down; views keep the storage alive). The
callback only appends to a queue; the queue is drained before every op and every query, so
bookkeeping never runs re-entrantly inside a half-done update (a GC pass can free a tensor at
any bytecode) and a free is always accounted before the next allocation, which keeps peaks
exact. Identity is ``storage._cdata`` plus a check that the weakref still points at the same
object, so an address reused by a new storage is never mistaken for the old one.

What is counted
---------------
* ``storage.nbytes()`` of op outputs: the bytes PyTorch asked for. On CUDA the caching
  allocator rounds blocks up (512 B / 2 MiB segments) and keeps freed blocks reserved; those
  are allocator overheads, not live bytes, and are not counted here. Neither are buffers a
  library allocates internally without a Python-visible tensor: on an H100, cuBLAS took a
  ~32 MiB workspace per handle through the caching allocator (one for forward, more for the
  autograd thread in backward), so ``torch.cuda.memory_allocated()`` read ~35 MB above this
  tracker after a small MLP's forward and ~68 MB above it after backward. Add a fixed margin
  for them (``CUBLAS_WORKSPACE_CONFIG`` sets their size).
* Storages that existed before the tracker (weights, the input batch) are counted when they
  are first *seen*: through :meth:`LiveBytesTracker.track` (do this for the weights, so the
  totals include them from the start), or, as a fallback, when an op first reads them
  (category ``"other"``). The fallback keeps totals honest but adds those bytes at first use.
* The key of a device is ``str(tensor.device)``: ``"cpu"``, ``"cuda:0"``, ``"meta"``. Under
  ``FakeTensorMode`` a fake tensor reports its *fake* device (a fake ``cuda:0`` tensor counts
  under ``"cuda:0"`` although its storage is on meta), which is what a planner wants.

Attribution (keep it simple and honest)
---------------------------------------
Every storage gets a category when it is first seen:

* explicit: ``track(x, category)`` and :meth:`track_gradients` (``"gradients"``) set or
  re-label it (use it for ``param.grad`` after backward, and for anything you know better);
* otherwise from the phase it was born in: ``forward`` -> ``"activations"``, ``backward`` ->
  ``"gradients"``, ``optimizer`` -> ``"optimizer_state"`` (override with
  ``phase(name, category=...)``); born outside any phase -> ``"other"``;
* a storage that dies inside the same phase *instance* it was born in was a
  ``"temporaries"`` allocation. This is decided at its death, so the per-category breakdown
  *at the peak* is corrected retroactively: a forward buffer alive at the peak but freed
  before forward ended is moved from "activations" to "temporaries" in ``peak_by_category``.

So "activations" = born in forward and still alive when forward ended (what autograd saves
for backward, plus the outputs); "gradients" = born in backward and surviving it (parameter
gradients; recomputed activations and activation gradients die inside backward and are
temporaries); "optimizer_state" = born in the optimizer step and surviving it (Adam moments).
Temporaries freed *inside* one aten op (workspace of a kernel) are not visible at this level.

Phases and module calls (``phase``, ``module``, the module hooks, and how births are attributed
to modules) are :mod:`runner.memory.live_bytes_scopes`; the read side (bytes now and at the
peak, snapshots, reports) is :mod:`runner.memory.live_bytes_views`. Both are mixins of the
tracker, so this file keeps only the per-op counting.

The breakdown at the peak is materialised lazily: while the live total sits at its peak it is
the current breakdown, and it is copied only when the first free after the peak happens. A
forward pass sets a new peak on almost every allocation, so copying at each new peak would
cost a dict copy per op.

Nesting with FakeTensorMode
---------------------------
Both orders work (tested): ``with FakeTensorMode(): with tracker:`` and ``with tracker: with
FakeTensorMode():``. In both, the tracker sees FakeTensor outputs and counts their (meta)
storages under the tensors' fake device. Tensors converted with ``fake_mode.from_tensor``
before the tracker started are pre-existing: pass them to :meth:`track`.
"""
from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from runner.compat import (
    DisableTorchFunction,
    DTensor,
    FakeTensor,
    TorchDispatchMode,
    dtensor_local,
    tree_iter,
)
from runner.memory.live_bytes_scopes import Frame, TrackerScopes
from runner.memory.live_bytes_views import NO_PHASE, TrackerViews

PHASE_CATEGORIES: dict[str, str] = {
    "forward": "activations",
    "backward": "gradients",
    "optimizer": "optimizer_state",
}
"""Category given to survivors of a phase (births in it that outlive it)."""

_PRIM_DEVICE = torch.ops.prim.device.default



class _Rec(weakref.ref):
    """A weak reference to one storage, carrying its accounting (the callback gets this object)."""

    __slots__ = ("key", "nbytes", "device", "category", "serial", "seq", "module")

    def __new__(cls, storage: Any, callback: Any, *rest: Any) -> _Rec:
        return super().__new__(cls, storage, callback)

    def __init__(self, storage: Any, callback: Any, key: int, nbytes: int, device: str,
                 category: str, serial: int | None, seq: int, module: str | None) -> None:
        super().__init__(storage, callback)
        self.key = key
        self.nbytes = nbytes
        self.device = device
        self.category = category
        self.serial = serial  # phase instance it was born in (None: born outside / pre-existing)
        self.seq = seq  # allocation order, to tell whether it was alive at the peak
        self.module = module


def _storage_of(t: torch.Tensor) -> Any:
    if isinstance(t, DTensor):  # a sharded tensor (FSDP2): its bytes are its local shard's
        t = dtensor_local(t)
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, wrapper subclasses
        return None


def _device_name(t: torch.Tensor) -> str:
    # A FakeTensor's device is an attribute; ``t.device`` would dispatch a query to read it.
    return str(t.fake_device if isinstance(t, FakeTensor) else t.device)


def _int(n: Any) -> int:
    try:
        return int(n)
    except Exception:  # an unbacked symbolic size: count nothing rather than fail the op
        return 0


class LiveBytesTracker(TrackerViews, TrackerScopes, TorchDispatchMode):
    """Counts live storage bytes per device; peaks per phase, per category and per module.

    Usage::

        tracker = LiveBytesTracker()
        tracker.track(model, "weights")
        with tracker:
            with tracker.phase("forward"):
                loss = model(x).mean()
            with tracker.phase("backward"):
                loss.backward()
            tracker.track_gradients(model.parameters())
            with tracker.phase("optimizer"):
                opt.step()
        print(tracker.report())

    ``count_inputs``: also count storages first seen as op inputs (pre-existing tensors that
    were not passed to :meth:`track`), as category "other". Turn it off to count only what is
    allocated under the tracker.
    """

    def __init__(self, count_inputs: bool = True) -> None:
        super().__init__()
        self.count_inputs = count_inputs
        self._live: dict[int, _Rec] = {}
        self._dead: collections.deque[tuple[_Rec, int | None]] = collections.deque()
        self._seq = 0
        self._serial_counter = 0
        self._serial_names: dict[int, str] = {}
        self._phases: list[Frame] = []
        self._modules: list[Frame] = []
        self._hooks: list[Any] = []
        self.current: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.max_since_mark: dict[str, int] = {}  # highest live bytes since take_max_since_mark (profile points)
        self._total = 0
        self._peak_seq: dict[str, int] = {}
        self._peak_phase: dict[str, str] = {}
        self._peak_module: dict[str, str | None] = {}
        self._cat_current: dict[str, dict[str, int]] = {}
        # (category, module) -> bytes, now and at the peak; see "lazily" in the module docstring.
        self._cm_current: dict[str, dict[tuple[str, str | None], int]] = {}
        self._cm_at_peak: dict[str, dict[tuple[str, str | None], int]] = {}
        self._peak_pending: dict[str, bool] = {}  # at peak now: the at-peak copy is not taken yet
        self.phase_peaks: dict[str, dict[str, int]] = {}
        self._phase_temporaries: dict[str, dict[str, int]] = {}
        self._module_stats: dict[str, dict[str, int]] = {}
        self._module_live: dict[str, int] = {}
        # Called with (func, args, kwargs, out, innermost phase) after every op: the planner's
        # FLOP/byte counter (runner/plan/cost.py). None: nothing extra per op.
        self.op_observer: Callable[[Any, tuple, dict, Any, str], None] | None = None
        # Told of every storage's birth (``born(device, serial, nbytes)``) and death
        # (``died(device, serial)``) in order: the planner replays them through the caching
        # allocator's model (runner/plan/allocator.py). None: nothing extra per storage.
        self.alloc_observer: Any = None
        # Storages born inside ``uncounted()`` (runner/memory/live_bytes_scopes.py): key -> weakref; never counted.
        self._uncounting = 0
        self._excluded: dict[int, weakref.ref] = {}

    # ---- storages resized in place ----------------------------------------------------------
    # FSDP2 frees a unit's gathered weights with ``storage.resize_(0)`` and allocates them again
    # with ``resize_(n)``: no op is dispatched, so the dispatch mode alone would count them as
    # live for good. While a tracker is active, UntypedStorage.resize_ (public) reports resizes
    # of storages it counts. One wrapper per process; trackers register with it.
    _active: ClassVar[list[LiveBytesTracker]] = []
    _original_resize: ClassVar[Any] = None

    def __enter__(self) -> LiveBytesTracker:
        cls = type(self)
        if not LiveBytesTracker._active:
            original = torch.UntypedStorage.resize_
            LiveBytesTracker._original_resize = original

            def resize_(storage: Any, size: int) -> Any:
                out = original(storage, size)
                for tracker in LiveBytesTracker._active:
                    tracker._resized(storage)
                return out

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        LiveBytesTracker._active.append(self)
        del cls
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            if self in LiveBytesTracker._active:
                LiveBytesTracker._active.remove(self)
            if not LiveBytesTracker._active and LiveBytesTracker._original_resize is not None:
                torch.UntypedStorage.resize_ = LiveBytesTracker._original_resize  # type: ignore[method-assign]
                LiveBytesTracker._original_resize = None

    def _resized(self, storage: Any) -> None:
        rec = self._live.get(storage._cdata)
        if rec is None or rec() is not storage:
            return
        if self._dead:
            self._drain()
        n = _int(storage.nbytes())
        if n != rec.nbytes:
            self._add(rec.device, rec.category, rec.module, n - rec.nbytes)
            rec.nbytes = n
            self._reallocated(rec)

    def _reallocated(self, rec: _Rec) -> None:
        # A resized storage is a new allocation of its new size, as the allocator serves it.
        if self.alloc_observer is not None:
            self.alloc_observer.died(rec.device, rec.seq)
            self.alloc_observer.born(rec.device, rec.seq, rec.nbytes)

    # ---- dispatch --------------------------------------------------------------------------
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # PyTorch wraps every dispatch mode's __torch_dispatch__ in torch._disable_dynamo, a
        # per-call cost that matters at the planner's ~10^5 ops; nothing here is ever compiled.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is _PRIM_DEVICE:
            # ``tensor.device`` of a FakeTensor dispatches this query: over half of all ops a
            # simulated step sees. It allocates nothing; answer it without the fake mode's
            # dispatch (FakeTensor's own handler says the same outside a kernel invocation).
            t = args[0]
            if isinstance(t, FakeTensor) and not t.fake_mode.in_kernel_invocation:
                return t.fake_device
            return func(*args)
        kwargs = kwargs or {}
        # Torch-function modes (the planner's DeviceSemantics) act above autograd on the user's
        # calls; the aten calls and tensor queries below are not theirs to see.
        with DisableTorchFunction():
            if self._dead:
                self._drain()
            if self.count_inputs:
                for t in tree_iter((args, kwargs)):
                    if isinstance(t, torch.Tensor):
                        self._see(t, None, born=False)
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                self._see(out, None, born=True)
            else:
                for t in tree_iter(out):
                    if isinstance(t, torch.Tensor):
                        self._see(t, None, born=True)
            if self.op_observer is not None:
                self.op_observer(func, args, kwargs, out, self._phases[-1].name if self._phases else NO_PHASE)
        return out

    def _see(self, t: torch.Tensor, category: str | None, born: bool, label: str | None = None) -> _Rec | None:
        s = _storage_of(t)
        if s is None:
            return None
        key = s._cdata
        if self._excluded and self._is_excluded(key, s):
            return None
        rec = self._live.get(key)
        if rec is not None and rec() is s:
            if born:  # out= / resize_: an existing storage may have grown
                n = _int(s.nbytes())
                if n != rec.nbytes:
                    self._add(rec.device, rec.category, rec.module, n - rec.nbytes)
                    rec.nbytes = n
                    self._reallocated(rec)
            if (category is not None and category != rec.category) or (label is not None and label != rec.module):
                self._relabel(rec, category or rec.category, label if label is not None else rec.module)
            return rec
        if rec is not None:  # a dead storage whose address was reused: settle it first
            self._free(rec, None)
        if born and self._uncounting:
            self._excluded[key] = weakref.ref(s)
            return None
        n = _int(s.nbytes())
        top = self._phases[-1] if self._phases else None
        if category is None:
            if born and top is not None:
                category = top.category or PHASE_CATEGORIES.get(top.name, "other")
            else:
                category = "other"
        serial = top.serial if (born and top is not None) else None
        in_module = self._modules[-1].name if (born and self._modules) else None
        module = label if label is not None else in_module
        self._seq += 1
        rec = _Rec(s, self._on_dead, key, n, self._device_key(t, born), category, serial, self._seq, module)
        self._live[key] = rec
        self._add(rec.device, category, module, n)
        if self.alloc_observer is not None:
            self.alloc_observer.born(rec.device, rec.seq, n)
        if in_module is not None:
            st = self._module_stats[in_module]
            st["allocated_bytes"] += n
        return rec

    def _device_key(self, t: torch.Tensor, born: bool) -> str:
        """The device a newly seen storage counts under: the tensor's (a subclass may place it by
        the op that made it: runner/memory/cuda_sim.py)."""
        return _device_name(t)

    def _on_dead(self, rec: _Rec) -> None:
        # Runs wherever the storage died (any thread, any bytecode): only enqueue.
        try:
            serial = self._phases[-1].serial
        except IndexError:  # outside any phase (or a phase closed concurrently)
            serial = None
        self._dead.append((rec, serial))

    def _drain(self) -> None:
        while self._dead:
            rec, serial = self._dead.popleft()
            self._free(rec, serial)

    def _free(self, rec: _Rec, death_serial: int | None) -> None:
        if self._live.get(rec.key) is rec:
            del self._live[rec.key]
        else:
            return
        n, dev = rec.nbytes, rec.device
        self._add(dev, rec.category, rec.module, -n)
        if self.alloc_observer is not None:
            self.alloc_observer.died(dev, rec.seq)
        if rec.serial is not None and rec.serial == death_serial:
            # Born and died inside the same phase instance: a temporary.
            ph = self._serial_names.get(rec.serial, NO_PHASE)
            tmp = self._phase_temporaries.setdefault(ph, {})
            tmp[dev] = tmp.get(dev, 0) + n
            if n and rec.seq <= self._peak_seq.get(dev, 0):  # alive at the peak (the copy is taken: we just freed)
                at = self._cm_at_peak[dev]
                old, new = (rec.category, rec.module), ("temporaries", rec.module)
                at[old] = at.get(old, 0) - n
                at[new] = at.get(new, 0) + n

    def _add(self, dev: str, category: str, module: str | None, n: int) -> None:
        if n < 0 and self._peak_pending.get(dev):
            self._take_peak_copy(dev)  # the first free after the peak: keep the breakdown at the peak
        cur = self.current.get(dev, 0) + n
        self.current[dev] = cur
        self._total += n
        cats = self._cat_current.get(dev)
        if cats is None:
            cats = self._cat_current[dev] = {}
            self._cm_current[dev] = {}
        cats[category] = cats.get(category, 0) + n
        cm = self._cm_current[dev]
        cm[(category, module)] = cm.get((category, module), 0) + n
        if module is not None:
            self._module_live[module] = self._module_live.get(module, 0) + n
        if n <= 0:
            return
        if cur > self.max_since_mark.get(dev, 0):
            self.max_since_mark[dev] = cur
        if cur > self.peak.get(dev, 0):
            self.peak[dev] = cur
            self._peak_seq[dev] = self._seq
            self._peak_phase[dev] = self._phases[-1].name if self._phases else NO_PHASE
            self._peak_module[dev] = self._modules[-1].name if self._modules else None
            self._peak_pending[dev] = True
        if self._phases:
            m = self._phases[-1].maxes
            if cur > m.get(dev, 0):
                m[dev] = cur
        if self._modules:
            f = self._modules[-1]
            if self._total > f.max_total:
                f.max_total = self._total

    def _take_peak_copy(self, dev: str) -> None:
        self._cm_at_peak[dev] = dict(self._cm_current.get(dev, {}))
        self._peak_pending[dev] = False

    def _relabel(self, rec: _Rec, category: str, module: str | None) -> None:
        dev, n = rec.device, rec.nbytes
        old, new = (rec.category, rec.module), (category, module)
        cats = self._cat_current[dev]
        cats[old[0]] = cats.get(old[0], 0) - n
        cats[category] = cats.get(category, 0) + n
        cm = self._cm_current[dev]
        cm[old] = cm.get(old, 0) - n
        cm[new] = cm.get(new, 0) + n
        if old[1] is not None:
            self._module_live[old[1]] = self._module_live.get(old[1], 0) - n
        if module is not None:
            self._module_live[module] = self._module_live.get(module, 0) + n
        # Alive now and born before the peak: it was alive at the peak. (While the peak copy is
        # pending, the current breakdown *is* the peak's and was just updated.)
        if rec.seq <= self._peak_seq.get(dev, 0) and not self._peak_pending.get(dev):
            at = self._cm_at_peak[dev]
            at[old] = at.get(old, 0) - n
            at[new] = at.get(new, 0) + n
        rec.category = category
        rec.module = module
        rec.serial = None  # an explicit label is final: never re-classified as a temporary

    # ---- registering pre-existing tensors ---------------------------------------------------
    def track(self, tensors_or_module: Any, category: str = "weights", module: str | None = None) -> int:
        """Count tensors that already exist (weights, optimizer state); re-label known ones.

        Accepts a module (its parameters and buffers), a tensor, or any nest of them (list,
        dict, optimizer.state). Returns the bytes now labelled ``category`` by this call.
        ``module`` also labels them with a module name for ``peak_by_module`` (default: keep
        the module they were born in, none for pre-existing tensors).
        """
        self._drain()
        if isinstance(tensors_or_module, nn.Module):
            items: Any = [*tensors_or_module.parameters(), *tensors_or_module.buffers()]
        else:
            items = tensors_or_module
        total = 0
        seen: set[int] = set()
        for t in tree_iter(items) if not isinstance(items, torch.Tensor) else [items]:
            if not isinstance(t, torch.Tensor):
                continue
            rec = self._see(t, category, born=False, label=module)
            if rec is not None and rec.key not in seen:
                seen.add(rec.key)
                total += rec.nbytes
        return total

    def track_gradients(self, params: Any, module: str | None = None) -> int:
        """Label the ``.grad`` of ``params`` (a module or an iterable of tensors) as "gradients"."""
        if isinstance(params, nn.Module):
            params = params.parameters()
        return self.track([p.grad for p in params if p.grad is not None], "gradients", module)
