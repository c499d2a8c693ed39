"""Fake tensors for the simulation: the fake-tensor mode, fake modules and fake batches.

Speed
-----
A full-size SDXL or Flux step is 50-80 k dispatched ops, and the fixed cost of each op in
``FakeTensorMode`` is most of a plan's time (docs/benchmarks.md has the profile and figures).
So the simulation keeps that path short without changing a figure: :class:`SimulationMode`
(a cheaper cache key, direct dispatch, ``_unsafe_view`` served from the cache, new outputs and
views built without ``FakeTensor.__new__`` or generator context managers), the tracker
answering the autograd engine's device queries itself, fake parameters made without dispatched
ops (:func:`fake_module`), gradient clipping with the foreach kernels a GPU run uses
(runner/memory/semantics.py), and the garbage collector kept off the objects that existed before
the plan (runner/plan/simulate.py).
"""
from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn

from runner.compat import (
    DISPATCH_HANDLE_DIRECTLY,
    DISPATCH_META_HANDLERS,
    FAKE_CACHE_FAST_PATHS,
    FAKE_OUTPUT_FAST_PATH,
    FAKE_TENSOR_PARAM_KWARGS,
    DisableTorchDispatch,
    DispatchCacheKey,
    FakeTensor,
    FakeTensorConverter,
    FakeTensorMode,
    active_fake_mode,
    get_default_device,
    get_proxy_mode,
    set_throw_on_mutable_data_ptr,
    set_warn_deprecated_on_mutable_data_ptr,
)


class _UnmemoizedOutputs(FakeTensorConverter):
    """Fake op outputs without the converter's weak memo.

    ``nn.Module.to`` replaces a fake parameter with ``torch.utils.swap_tensors``, which refuses a
    tensor that has a weak reference, and the stock converter keeps a weak memo of every op
    output it wraps (keyed by a fresh meta tensor that is never looked up again). Without it,
    modules of fake parameters move between the simulated host and device like real ones.
    """

    def from_meta_and_device(self, fake_mode: FakeTensorMode, t: torch.Tensor, device: torch.device,
                             pytype: Any = None, dispatch_keys: Any = None) -> FakeTensor:
        return FakeTensor(fake_mode, t, device, pytype=pytype, dispatch_keys=dispatch_keys)


class _Unusual(Exception):
    """An argument the fast cache key does not describe: use FakeTensorMode's own key."""


_PLAIN_ARGS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_FAST_KEY = object()  # keeps fast keys apart from stock keys in FakeTensorMode's shared cache
_UNSAFE_VIEW, _VIEW = torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default


class SimulationMode(FakeTensorMode):
    """FakeTensorMode with a cheaper path through its dispatch cache, for the planner's tensors.

    Why: a simulated SDXL or Flux step dispatches 50-80 k ops, nearly all cache hits, so the
    fixed cost of one hit is most of a plan's time. Three changes, each measured on a full-size
    plan, none changing a figure (tests/runner/plan/test_planner.py plans tiny presets both ways and
    compares the plans byte for byte):

    * The cache key. The stock key describes each tensor argument through a generic,
      SymInt-aware path (a metadata dataclass per tensor, walked field by field): about half of
      each hit. The planner's tensors have static shapes and no constants, so the same facts fit
      in one tuple per tensor: dtype, shape, stride, offset, storage bytes, device,
      requires_grad and the conj/neg/inference bits (the stock key's memory format follows from
      shape and stride). Anything else (SymInts, real tensors, sparse or quantized tensors,
      another mode's fakes, callables) takes the stock key.
    * Dispatch. Ordinary ops go straight to the cached path, skipping a per-op debug-log
      context and PyTorch's torch._disable_dynamo wrapper (nothing here is compiled).
    * ``_unsafe_view``, below.

    Cache validation, cache entries and the outputs built from them stay FakeTensorMode's own.
    These are private PyTorch internals (runner/compat.py): where they are missing,
    ``simulation_mode`` uses the stock mode.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.cache_enabled or func in DISPATCH_META_HANDLERS or func in DISPATCH_HANDLE_DIRECTLY:
            return super().__torch_dispatch__(func, types, args, kwargs or {})
        if func is _UNSAFE_VIEW:
            # linear and matmul reshape their fresh output with _unsafe_view, which the fake
            # cache never stores (it aliases its input but is not tagged a view), so each one
            # ran its Python meta kernel: ~3,700 per SDXL LoRA step. It is view() without view
            # tracking, and below autograd (here) the two are the same op on the same storage.
            try:
                return self._cached_dispatch_impl(_VIEW, types, args, kwargs or {})
            except RuntimeError:  # strides view() cannot express: the stock path decides
                pass
        return self._cached_dispatch_impl(func, types, args, kwargs or {})

    # FakeTensor's attributes besides its device and mode, as FakeTensor.__new__ sets them for an op
    # output (all None); taken from the first output, per mode. False: use the stock constructor.
    _output_state: dict[str, Any] | bool | None = None

    def _get_output_tensor_from_cache_entry(self, state: Any, entry: Any, key: Any, func: Any, args: Any) -> Any:
        """A cache hit's output, built without FakeTensor.__new__'s argument checks.

        Why: after the cache key, building each output was the largest fixed cost of a hit
        (FakeTensor.__new__ validates its arguments and sets fifteen memo attributes through
        descriptors: ~3x the time of what is kept here). The output is the same tensor: the meta
        tensor the stock path makes, wrapped by ``Tensor._make_subclass`` as ``__new__`` wraps it,
        with the attributes ``__new__`` would set copied from one it made. Anything but a plain
        new output or a view of a fake input (in-place, symbolic, conjugate/negative, sparse) takes the
        stock path.
        """
        md = entry.metadata
        if (md is None or entry.inplace_idx is not None or self.shape_env is not None
                or md.is_conj or md.is_neg or md.layout is not torch.strided
                or self._output_state is False or not FAKE_OUTPUT_FAST_PATH):
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        is_view = getattr(func, "is_view", False)
        if is_view != (entry.view_idx is not None) or (is_view and not isinstance(args[entry.view_idx], FakeTensor)):
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        # The stock path builds the meta tensor inside in_kernel_invocation_manager, a generator
        # context manager (~5 us a call, twice for a view). A plain meta tensor needs only the
        # Python dispatch modes off, which is what the C++ guard does.
        with DisableTorchDispatch():
            empty = torch.empty_strided(md.shape, md.stride, dtype=md.dtype, device="meta",
                                        requires_grad=md.requires_grad)
            if is_view:  # a view shares its input's storage, as the stock path sets it
                empty.set_(args[entry.view_idx].untyped_storage(), md.storage_offset, md.shape, md.stride)
        return self._wrap(empty, md.device)

    def _wrap(self, elem: torch.Tensor, device: torch.device) -> FakeTensor:
        st = self._output_state
        if st is None:  # the first output: the stock constructor, and what it set
            out = FakeTensor(self, elem, device)
            st = {k: v for k, v in vars(out).items() if k not in ("_fake_device", "fake_device", "fake_mode")}
            self._output_state = st if all(v is None for v in st.values()) else False
            return out
        out = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                          device_for_backend_keys=device)
        if self._allow_unsafe_data_ptr_access:
            set_warn_deprecated_on_mutable_data_ptr(out)
        else:
            set_throw_on_mutable_data_ptr(out)
        out.__dict__.update(st)
        out.fake_device = device
        out.fake_mode = self
        return out

    def _cache_key(self, state: Any, func: Any, args: Any, kwargs: Any) -> Any:
        if self.shape_env is not None:
            return super()._cache_key(state, func, args, kwargs)
        values: list[Any] = [_FAST_KEY, func, torch.get_default_dtype(), get_default_device(),
                             torch.is_inference_mode_enabled(),
                             get_proxy_mode() is not None]
        try:
            self._describe(values, args)
            if kwargs:
                for k, v in kwargs.items():
                    values.append(k)
                    self._describe(values, (v,))
        except _Unusual:
            return super()._cache_key(state, func, args, kwargs)
        return DispatchCacheKey(tuple(values))

    def _describe(self, out: list[Any], args: Any) -> None:
        for a in args:
            if isinstance(a, FakeTensor):
                if (a.fake_mode is not self or a.constant is not None or a.layout is not torch.strided
                        or a.is_quantized or a._has_symbolic_sizes_strides):
                    raise _Unusual
                out.append((a.dtype, tuple(a.shape), a.stride(), a.storage_offset(), a.untyped_storage().nbytes(),
                            a.fake_device, a.requires_grad, a.is_conj(), a.is_neg(), a.is_inference()))
            elif isinstance(a, (list, tuple)):
                out.append((type(a), len(a)))
                self._describe(out, a)
            elif isinstance(a, _PLAIN_ARGS):
                out.append(type(a))
                out.append(a)
            else:
                raise _Unusual


def simulation_mode(fast: bool = True) -> FakeTensorMode:
    """A FakeTensorMode in which fake modules can be moved with ``Module.to``.

    ``fast=False``: PyTorch's own dispatch and cache key (:class:`SimulationMode` off), for
    checking that the fast paths change no figure.
    """
    mode = (SimulationMode if fast and FAKE_CACHE_FAST_PATHS else FakeTensorMode)(allow_non_fake_inputs=True)
    old = mode.fake_tensor_converter
    mode.fake_tensor_converter = _UnmemoizedOutputs(copy_data=old.meta_converter.copy_data, export=old.export)
    return mode


_INIT_FUNCTIONS = tuple(n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_"))  # uniform_, ...


def _leave_as_is(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def weights_left_uninitialised() -> Iterator[None]:
    """``torch.nn.init``'s in-place initialisers do nothing (and return their tensor) inside.

    Why: the planner builds every model on ``meta``, where there are no values to initialise, yet
    each layer's ``reset_parameters`` still runs its initialiser op by op: ~1 s of a full-size Wan
    build (UMT5-XXL and the 14 B transformer), about as long as the rest of the build. Shapes,
    dtypes and tied weights are untouched (the plans are byte for byte the same). The trade-off:
    the patch is process-wide while it lasts, so a model built by another thread meanwhile would
    keep uninitialised weights; diffusers' ``no_init_weights`` makes the same choice when loading.
    """
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in saved:
        setattr(nn.init, name, _leave_as_is)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def fake_module(module: nn.Module, device: torch.device, memo: dict[int, torch.Tensor],
                leave: Collection[int] = ()) -> None:
    """Replace every parameter and buffer of ``module`` by a fake tensor on ``device``.

    Same shape, dtype, stride and ``requires_grad``; tied tensors stay tied (``memo`` is shared
    across the modules of one ModelSet). Call inside the simulation mode. The fakes are made
    without dispatching an op (no dispatch mode sees them born): pass them to the tracker.
    ``leave``: ids of tensors left as they are (a base read later, runner/plan/quantized_reads.py).
    """
    mode = active_fake_mode()
    if mode is None:
        raise RuntimeError("fake_module: call it inside the simulation mode (runner.plan.simulation_mode())")
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for key, t in list(table.items()):
                if t is None or id(t) in leave:
                    continue
                if id(t) not in memo:
                    memo[id(t)] = _fake_like(t, device, mode)
                table[key] = memo[id(t)]


def _fake_like(t: torch.Tensor, device: torch.device, mode: FakeTensorMode) -> torch.Tensor:
    # Why not torch.empty_strided under the mode, then nn.Parameter: that is two dispatched
    # ops per tensor (the parameter wrap detaches), ~0.5 s for the ~3,000 tensors of SDXL's
    # models. Here a plain meta tensor is wrapped directly, as the fake mode wraps its outputs.
    is_param = isinstance(t, nn.Parameter)
    if FAKE_TENSOR_PARAM_KWARGS:  # recent PyTorch (2.13); 2.11 takes the dispatched path below
        with DisableTorchDispatch():
            elem = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
        return FakeTensor(mode, elem, device, requires_grad=is_param and t.requires_grad, _is_param=is_param)
    fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    return nn.Parameter(fake, requires_grad=t.requires_grad) if is_param else fake

