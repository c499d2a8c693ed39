"""The planner: "will this config fit on my card?", answered by simulating one training step.

``python -m runner +preset=sdxl_24gb mode=plan model.size=full`` (1024 px at full size) prints a
table and writes ``plan.json``; the exit status is 0 when the plan fits ``budget_gb`` and 3 when
it does not. ``mode=train`` plans first (``train.preflight``, on by default) and refuses to start
a run that cannot fit. The twin function is :func:`plan_step`.

How a step is simulated
-----------------------
1. The trainer builds its models at the configured size on ``meta`` (``build_models("meta")``),
   and every parameter and buffer becomes a fake tensor on the fake *host* (``cpu``): a real run
   also builds on the host first.
2. Every configured plugin runs through the same :class:`~runner.context.RunContext` phases as
   a real run (``transform_models``, ``place_models``, the move of unplaced modules to the
   device, ``wrap_execution``, ``wrap_optimizer``, the step hooks, ``teardown``) with
   ``ctx.simulate=True``, ``ctx.device=meta`` (the simulated accelerator) and ``ctx.host=cpu``.
   ``configure_process`` is not run: it sets process-wide things (environment, CUDA caps) and
   allocates no tensor.
3. One optimizer step under ``FakeTensorMode``: ``encode`` of a raw batch under ``no_grad``
   (``trainer.example_raw_batch``, when the trainer has it and no plugin made encoding
   unnecessary), ``loss``, backward, gradient clipping, ``optimizer.step()``; with
   ``train.grad_accum > 1`` two micro-batches (every later micro-batch repeats the second
   one's memory). A :class:`~runner.memory.tracker.LiveBytesTracker` counts live storage bytes
   per device, phase, category and top-level module.
4. Steady state: optimizer state is created by the first step and then lives through every
   later forward and backward, so the state's bytes are added to the forward and backward peaks
   (exact: the state does not change size while they run). The plan's peak is the largest of
   setup, forward+state, backward+state and the optimizer step.

Speed
-----
A full-size SDXL or Flux step is 50-80 k dispatched ops, and the fixed cost of each op in
``FakeTensorMode`` is most of a plan's time (docs/benchmarks.md has the profile and figures).
So the simulation keeps that path short without changing a figure: :class:`SimulationMode`
(a cheaper cache key, direct dispatch, ``_unsafe_view`` served from the cache), the tracker
answering the autograd engine's device queries itself, fake parameters made without dispatched
ops (:func:`fake_module`), gradient clipping with the foreach kernels a GPU run uses, and the
garbage collector kept off the objects that existed before the plan.

The simulated device behaves like the target device
------------------------------------------------------
``meta`` has no autocast and no fused attention kernels, so :class:`DeviceSemantics` (a
``TorchFunctionMode``) gives it the target's: CUDA autocast (the op lists of PyTorch's
``ATen/autocast_mode.h``: lower-precision, float32 and promote ops, and the cast cache of fp32
weights within the autocast region) when ``train.mixed_precision`` is bf16/fp16, and the
attention kernel PyTorch would pick (flash, memory-efficient, cuDNN or math, in PyTorch's
priority order and within the ``sdpa_kernel`` settings of the tiling plugin). Without this a
1024 px Flux step would count several GiB of L x L attention matrices that no GPU run allocates.
The target is CUDA unless ``train.device=cpu`` (or the preflight of a run that resolved to the
CPU): then float32 unless ``train.cpu_autocast``, and PyTorch's CPU flash attention.

What is not counted (so ``budget_gb`` should keep some room): the CUDA context and library
handles outside PyTorch's allocator; the caching allocator's rounding and fragmentation
(``allocator.expandable_segments`` keeps it small); kernel workspaces with no Python-visible
tensor, for which :data:`CUDA_WORKSPACE_MARGIN_BYTES` is added to the peak before comparing with
the budget; host memory that is not tensors (Python, libraries, the data loader); the
per-parameter temporaries of an optimizer update (the planner steps the optimizer's
simulation, see below). Host RAM is the peak of fake host tensors, which includes the whole
model at build time (the runner builds on the host, then places).

Contract for plugins (what ``ctx.simulate`` means)
--------------------------------------------------
* Tensors are fake: shapes, dtypes, devices and storages are real, values are not. ``.to()``,
  ``Module.to()``, factories, views and every op with a meta kernel work and cost no memory.
  What does not: reading values (``.item()``, ``.tolist()``, ``print``), kernels without a meta
  implementation (bitsandbytes, custom C++/CUDA ops), reading or writing weight files, and
  ``param.data = t`` between host and device (``cpu`` and ``meta`` tensors are not compatible
  for ``set_data``; assign the parameter with ``Module.to``/``setattr`` instead).
* A plugin whose real path cannot run on fake tensors takes a byte-for-byte simulation path
  when ``ctx.simulate`` is set, in its own file beside the real path: it replaces weights by
  fake tensors with the same byte size and dtype layout as the real ones (nf4: packed uint8 plus
  its absmax values), and its forward computes with fake tensors of the shapes and dtypes the
  real kernel produces (including what the real kernel dequantizes transiently).
* Optimizers: the planner calls :func:`runner.optim.build_optimizer` with ``simulate=True``,
  which returns an optimizer that allocates exactly the state the real one keeps after its first
  step (checked against the real optimizers byte for byte in tests/test_optimizers.py), then
  runs ``wrap_optimizer``. A plugin wrapping the optimizer must keep ``step()`` runnable on it.
* Encoding: a plugin that makes the encoders unnecessary during training (every latent and
  embedding cached) sets ``ctx.state["encode_on_device"] = False`` by the end of
  ``place_models``; the planner then feeds the trainer's *encoded* ``example_batch`` (as read
  from the cache). When only some encode parts are cached (``offload=park
  offload.cache_latents=false``), the planner computes the others with ``encode_part`` and
  takes the cached ones as tensors arriving on the device (shapes from a meta run of the
  encoders before the plugins), then calls ``finish_encode``; which parts are cached is
  ``ctx.state["cached_encode_parts"]`` if a plugin sets it, else every part needing a module
  the plugins removed from the ModelSet. Otherwise the planner calls ``trainer.encode`` on
  ``example_raw_batch``.
* Pinned host memory: a plugin that page-locks host memory (or would, on the target GPU) adds
  the bytes to ``ctx.state["pinned_host_bytes"]`` (an int; :func:`note_pinned_bytes`). The plan
  reports them as pinned and the rest of the host bytes as pageable.

When a plan does not fit, :func:`suggest` ranks the settings that would save the most. The
figures are *estimates* from the measured breakdown (for example "an 8-bit AdamW keeps 2 of
its 8 bytes per parameter"), each labelled with how it was derived; re-planning every candidate
would cost a full simulation each. :func:`verify_suggestions` re-plans them when asked.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConverter, FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.overrides import TorchFunctionMode

from runner.errors import UserError
from runner.memory.tracker import CATEGORIES, NO_MODULE, LiveBytesTracker

log = logging.getLogger("runner")

GiB = 2**30
DEVICE = torch.device("meta")  # the simulated accelerator
HOST = torch.device("cpu")  # the simulated host (fake cpu tensors)
BOOKKEEPING_KEYS = ("sample_seed", "index")  # per-sample ints the protocol reads with tolist()
# cuBLAS/cuDNN workspaces and allocator rounding have no Python-visible tensor. On an H100 the
# CUDA allocator read ~35 MB above the live-bytes tracker after a forward and ~68 MB after a
# backward (runner/memory/tracker.py); 128 MiB covers that with room for a second stream.
CUDA_WORKSPACE_MARGIN_BYTES = 128 * 2**20
PLAN_FILE = "plan.json"
OUTSIDE = "(outside modules)"


class PlanDoesNotFit(UserError):
    """The plan's peak is above ``budget_gb``: exit status 3, the same as an OOM give-up."""

    exit_code = 3


# ---- fake tensors ------------------------------------------------------------------------------
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


try:  # private parts of PyTorch's fake-tensor cache that SimulationMode builds on
    from torch._subclasses.fake_tensor import _DISPATCH_HANDLE_DIRECTLY, _DISPATCH_META_HANDLERS, _DispatchCacheKey

    _FAST_PATHS = all(hasattr(FakeTensorMode, m) for m in ("_cached_dispatch_impl", "_cache_key"))
except ImportError:  # another PyTorch: plan with the stock FakeTensorMode (slower, same figures)
    _FAST_PATHS = False

_PLAIN_ARGS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_FAST_KEY = object()  # keeps fast keys apart from stock keys in FakeTensorMode's shared cache
_UNSAFE_VIEW, _VIEW = torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default


class SimulationMode(FakeTensorMode):
    """FakeTensorMode with a cheaper path through its dispatch cache, for the planner's tensors.

    Why: a simulated SDXL or Flux step dispatches 50-80 k ops, nearly all cache hits, so the
    fixed cost of one hit is most of a plan's time. Three changes, each measured on a full-size
    plan, none changing a figure (tests/test_planner.py plans tiny presets both ways and
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
    These are private PyTorch internals: where they are missing, ``simulation_mode`` uses the
    stock mode.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.cache_enabled or func in _DISPATCH_META_HANDLERS or func in _DISPATCH_HANDLE_DIRECTLY:
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

    def _cache_key(self, state: Any, func: Any, args: Any, kwargs: Any) -> Any:
        if self.shape_env is not None:
            return super()._cache_key(state, func, args, kwargs)
        values: list[Any] = [_FAST_KEY, func, torch.get_default_dtype(), torch._C._get_default_device(),
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
        return _DispatchCacheKey(tuple(values))

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
    mode = (SimulationMode if fast and _FAST_PATHS else FakeTensorMode)(allow_non_fake_inputs=True)
    old = mode.fake_tensor_converter
    mode.fake_tensor_converter = _UnmemoizedOutputs(copy_data=old.meta_converter.copy_data, export=old.export)
    return mode


def fake_module(module: nn.Module, device: torch.device, memo: dict[int, torch.Tensor]) -> None:
    """Replace every parameter and buffer of ``module`` by a fake tensor on ``device``.

    Same shape, dtype, stride and ``requires_grad``; tied tensors stay tied (``memo`` is shared
    across the modules of one ModelSet). Call inside the simulation mode. The fakes are made
    without dispatching an op (no dispatch mode sees them born): pass them to the tracker.
    """
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if mode is None:
        raise RuntimeError("fake_module: call it inside the simulation mode (runner.planner.simulation_mode())")
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for key, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in memo:
                    memo[id(t)] = _fake_like(t, device, mode)
                table[key] = memo[id(t)]


def _fake_like(t: torch.Tensor, device: torch.device, mode: FakeTensorMode) -> torch.Tensor:
    # Why not torch.empty_strided under the mode, then nn.Parameter: that is two dispatched
    # ops per tensor (the parameter wrap detaches), ~0.5 s for the ~3,000 tensors of SDXL's
    # models. Here a plain meta tensor is wrapped directly, as the fake mode wraps its outputs.
    is_param = isinstance(t, nn.Parameter)
    if _FAKE_PARAM_KWARGS:
        with torch._C._DisableTorchDispatch():
            elem = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
        return FakeTensor(mode, elem, device, requires_grad=is_param and t.requires_grad, _is_param=is_param)
    fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    return nn.Parameter(fake, requires_grad=t.requires_grad) if is_param else fake


# FakeTensor(..., requires_grad=, _is_param=) exists in recent PyTorch (2.13 here); older
# versions (the GPU machine's 2.11) take the dispatched path above.
_FAKE_PARAM_KWARGS = {"requires_grad", "_is_param"} <= set(inspect.signature(FakeTensor.__new__).parameters)


def _fake_batch(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Fake copies on ``device`` of a batch's tensors; per-sample ints stay real CPU tensors."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and k not in BOOKKEEPING_KEYS:
            out[k] = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=device)
        else:
            out[k] = v
    return out


def _move_batch(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) and k not in BOOKKEEPING_KEYS else v)
            for k, v in batch.items()}


# ---- the target device's autocast and attention kernels ----------------------------------------
# CUDA autocast policies, from PyTorch's ATen/autocast_mode.h (AT_FORALL_LOWER_PRECISION_FP,
# AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE), by the name of the Python
# function that reaches each aten op (F.interpolate reaches the upsample_* ops).
AUTOCAST_LOWER = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "__matmul__", "__rmatmul__", "einsum", "mm", "mv",
    "linalg_vecdot", "vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "multi_dot", "linalg_multi_dot",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
})
AUTOCAST_FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "rms_norm", "group_norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "interpolate",
})
AUTOCAST_FP32_OPT_DTYPE = frozenset({
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "vector_norm", "matrix_norm",
})
AUTOCAST_PROMOTE = frozenset({
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sample", "index_put", "tensordot",
    "scatter_add",
})
PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _sdp_priority() -> list[int]:
    """PyTorch's SDPA backend order (flash, efficient, math, cudnn by default)."""
    try:
        return list(torch._C._get_sdp_priority_order())
    except (AttributeError, RuntimeError):  # older torch: the documented default order
        return [1, 2, 0, 3]


def _holds_tensor(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    return isinstance(data, (list, tuple)) and any(_holds_tensor(x) for x in data)


class DeviceSemantics(TorchFunctionMode):
    """Makes ``meta`` behave like the target device: its autocast and its attention kernels.

    Autocast (``autocast()`` region, bf16/fp16 only) casts the floating arguments of each listed
    op that live on the simulated device, like CUDA autocast: lower-precision ops to the
    autocast dtype, float32 ops and softmax-like ops to float32, promote ops to the widest
    type. Inside the forward region fp32 leaf tensors that require grad (trained weights) are
    cast once and cached until the region ends, as ``torch.autocast`` does; the cached copies
    stay alive while autograd holds them. Casting stays on through backward (where only
    checkpoint recomputation calls these functions: the real one re-enters autocast) without
    the cache, which a real recomputation clears at the end of each block.

    Why a TorchFunctionMode: autocast and SDPA's kernel choice happen above autograd, so the
    casts and the kernel's saved tensors must be visible to autograd, which a dispatch-level
    mode (below autograd) would not give; and ``torch.autocast`` has no ``meta`` backend.
    """

    def __init__(self, target: str, precision: str) -> None:
        super().__init__()
        self.target = target
        self.dtype = PRECISION_DTYPES.get(precision)  # None: float32, nothing to cast
        self.casting = False
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    @contextlib.contextmanager
    def autocast(self, cache: bool = True) -> Iterator[None]:
        """The autocast region (a no-op without a mixed precision); cache: the forward's weight-cast cache."""
        before = (self.casting, self.cache)
        self.casting = self.dtype is not None
        self.cache = {} if (cache and self.casting) else None
        try:
            yield
        finally:
            self.casting, self.cache = before

    # -- casting -----------------------------------------------------------------------------
    def _eligible(self, x: Any) -> bool:
        return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
                and x.device.type == DEVICE.type)

    def _cast(self, x: Any, to: torch.dtype) -> Any:
        if isinstance(x, (list, tuple)):
            return type(x)(self._cast(y, to) for y in x)
        if not self._eligible(x) or x.dtype == to:
            return x
        if (self.cache is not None and to == self.dtype and x.dtype == torch.float32 and x.requires_grad
                and x.is_leaf and not x._is_view()):
            hit = self.cache.get(id(x))
            if hit is None or hit[0] is not x:
                hit = self.cache[id(x)] = (x, x.to(to))
            return hit[1]
        return x.to(to)

    def _cast_all(self, args: tuple, kwargs: dict, to: torch.dtype) -> tuple[tuple, dict]:
        return tuple(self._cast(a, to) for a in args), {k: self._cast(v, to) for k, v in kwargs.items()}

    def _widest(self, args: tuple, kwargs: dict) -> torch.dtype | None:
        order = {torch.float16: 0, torch.bfloat16: 0, torch.float32: 1}
        found = [x.dtype for x in (*args, *kwargs.values()) if self._eligible(x)]
        if not found:
            return None
        return max(found, key=lambda d: order.get(d, 2))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if name in ("tensor", "as_tensor") and args and not _holds_tensor(args[0]) \
                and torch.device(kwargs.get("device") or "cpu").type == "cpu":
            # A tensor made from Python data on the host holds real values (seeds, sizes, ids)
            # that code reads back with tolist(): keep it real. It is a few bytes.
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if self.casting and name is not None:
            if name in AUTOCAST_LOWER:
                args, kwargs = self._cast_all(args, kwargs, self.dtype)
            elif name in AUTOCAST_FP32:
                args, kwargs = self._cast_all(args, kwargs, torch.float32)
            elif name in AUTOCAST_FP32_OPT_DTYPE:
                if kwargs.get("dtype") is None and any(
                    self._eligible(x) and x.dtype != torch.float32 for x in (*args, *kwargs.values())
                ):
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif name in AUTOCAST_PROMOTE:
                widest = self._widest(args, kwargs)
                if widest is not None:
                    args, kwargs = self._cast_all(args, kwargs, widest)
        if name == "scaled_dot_product_attention":
            return self._attention(func, args, kwargs)
        return func(*args, **kwargs)

    # -- attention ---------------------------------------------------------------------------
    def _attention(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """F.scaled_dot_product_attention with the kernel the target device would run.

        On ``meta`` PyTorch always decomposes SDPA into the math path (it materialises the L x L
        scores and keeps them for backward); the target picks a fused kernel whose memory is
        O(L). The fused kernels' own aten ops have meta implementations and derivatives, so
        calling them gives the real kernels' outputs and saved tensors.
        """
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        p = dict(zip(names, args))
        p.update(kwargs)
        q, k, v = p.get("query"), p.get("key"), p.get("value")
        mask, dropout, causal = p.get("attn_mask"), float(p.get("dropout_p", 0.0)), bool(p.get("is_causal", False))
        scale = p.get("scale")
        if (not all(isinstance(t, torch.Tensor) and t.device.type == DEVICE.type for t in (q, k, v))
                or p.get("enable_gqa") or q.dim() != 4 or not (q.dtype == k.dtype == v.dtype)):
            return func(*args, **kwargs)
        head, dtype = q.shape[-1], q.dtype
        same_heads = q.shape[-1] == k.shape[-1] == v.shape[-1]
        ops = torch.ops.aten
        if self.target == "cpu":
            if torch.backends.cuda.flash_sdp_enabled() and same_heads:
                return ops._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, dropout, causal, attn_mask=mask, scale=scale)[0]
            return func(*args, **kwargs)
        half = dtype in (torch.float16, torch.bfloat16)
        needs_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        for backend in _sdp_priority():
            if backend == 1 and torch.backends.cuda.flash_sdp_enabled() and half and mask is None and same_heads \
                    and head <= 256 and head % 8 == 0:
                return ops._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False, scale=scale)[0]
            if backend == 2 and torch.backends.cuda.mem_efficient_sdp_enabled() \
                    and dtype in (torch.float32, torch.float16, torch.bfloat16) and head % (8 if half else 4) == 0 \
                    and v.shape[-1] % (8 if half else 4) == 0:
                return ops._scaled_dot_product_efficient_attention(
                    q, k, v, mask, needs_lse, dropout, causal, scale=scale)[0]
            if backend == 3 and torch.backends.cuda.cudnn_sdp_enabled() and half and same_heads and head <= 128 \
                    and head % 8 == 0:
                return ops._scaled_dot_product_cudnn_attention(
                    q, k, v, mask, needs_lse, dropout, causal, False, scale=scale)[0]
            if backend == 0 and torch.backends.cuda.math_sdp_enabled():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class SimulatedAccelerator:
    """What plugins and the step read from ``ctx.accelerator``, for the simulated device."""

    def __init__(self, semantics: DeviceSemantics, precision: str) -> None:
        self.semantics = semantics
        self.mixed_precision = precision
        self.device = DEVICE

    def autocast(self) -> Any:
        return self.semantics.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        # The C++ engine entry, not loss.backward(): Tensor.backward goes through the function
        # mode, which is switched off while it handles a call, so checkpoint recomputation in
        # backward would run without the target's autocast and attention kernels.
        from torch.autograd.graph import _engine_run_backward

        with self.semantics.autocast(cache=False):  # the forward ran under autocast: so do recomputations
            _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (),
                                 allow_unreachable=True, accumulate_grad=True)

    @torch.no_grad()
    def clip_grad_norm_(self, params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` as a run computes it: with the foreach kernels.

        The real step (foreach=None) takes the foreach path on CUDA and CPU tensors; on ``meta``
        PyTorch refuses it, although the foreach kernels have meta implementations. Same steps
        as PyTorch's: per-dtype norms, their norm, one clamped coefficient, an in-place scale.
        The loop alternative is two ops per parameter (~3,400 for SDXL) for the same bytes.
        """
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                groups.setdefault(p.grad.dtype, []).append(p.grad)
        if not groups:
            return torch.zeros(())
        norms = [n for grads in groups.values() for n in torch._foreach_norm(grads, 2.0)]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
        return total

    def prepare(self, *objs: Any) -> Any:
        return objs[0] if len(objs) == 1 else objs


# ---- the plan -----------------------------------------------------------------------------------
@dataclass
class PhasePeak:
    """The steady-state peak of one phase of the simulated step, on one device."""

    name: str  # setup | forward | backward | optimizer (with "#2" for the second micro-batch)
    where: str  # innermost phase at the peak (e.g. "encode" inside forward)
    peak_bytes: int
    by_module: dict[str, dict[str, int]]  # top-level module -> category -> bytes


@dataclass
class Plan:
    """The predicted memory of one training step. Bytes are exact counts of live tensor storage."""

    target: str  # "cuda" or "cpu": the device whose autocast and kernels were simulated
    peak_bytes: int  # device
    peak_phase: str
    margin_bytes: int  # kernel workspaces (see CUDA_WORKSPACE_MARGIN_BYTES), added for the fit check
    budget_bytes: int | None
    by_category: dict[str, int]  # at the device peak
    by_module: dict[str, dict[str, int]]  # at the device peak: top-level module -> category -> bytes
    phases: dict[str, int]  # steady-state device peak of each phase
    host_peak_bytes: int
    host_peak_phase: str
    host_steady_bytes: int  # host tensors during training (after setup)
    host_pinned_bytes: int
    optimizer_state_bytes: dict[str, int]  # per device ("meta" = the accelerator, "cpu" = host)
    run: dict[str, Any]  # what was planned: trainer, size, resolution, batch, precision, plugins ...
    notes: dict[str, Any] = field(default_factory=dict)
    suggestions: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def required_bytes(self) -> int:
        return self.peak_bytes + self.margin_bytes

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.required_bytes <= self.budget_bytes

    @property
    def host_pageable_bytes(self) -> int:
        return max(self.host_peak_bytes - self.host_pinned_bytes, 0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(required_bytes=self.required_bytes, fits=self.fits, host_pageable_bytes=self.host_pageable_bytes)
        return d

    def write_json(self, path: Path) -> Path:
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return path

    def format_table(self) -> str:
        return format_plan(self)


def _unit(n: int) -> tuple[float, str]:
    return (GiB, "GiB") if abs(n) >= GiB // 2 else (2**20, "MiB")


def _size(n: int | float, unit: tuple[float, str] | None = None) -> str:
    div, name = unit or _unit(int(n))
    return f"{n / div:.2f} {name}"


def format_plan(plan: Plan) -> str:
    """The plan as a readable table (what ``mode=plan`` prints)."""
    s = plan.run
    unit = _unit(plan.peak_bytes)
    lines = [
        f"Plan: {s['trainer']} ({s['size']}), {s['resolution']} px, batch {s['batch_size']} "
        f"({s['micro_batches']} x micro-batch {s['micro_batch_size']}), {s['precision_text']} on a "
        f"{plan.target.upper()} device",
        f"  plugins: {s['plugins']}; optimizer: {s['optimizer']}; trained: {s['trained']}",
        "",
    ]
    need = f"{_size(plan.peak_bytes)} at the peak ({plan.peak_phase})"
    if plan.margin_bytes:
        need += f" + {plan.margin_bytes / 2**20:.0f} MiB kernel workspaces = {_size(plan.required_bytes)}"
    if plan.budget_bytes is None:
        verdict = "no budget_gb set: nothing to compare with"
    else:
        verdict = (f"budget_gb {plan.budget_bytes / GiB:g} -> "
                   + ("FITS" if plan.fits else f"DOES NOT FIT (over by {_size(plan.required_bytes - plan.budget_bytes)})"))
    lines += [f"device memory: {need}", f"  {verdict}", ""]
    mods = sorted(plan.by_module.items(), key=lambda kv: -sum(kv[1].values()))
    cats = [c for c in CATEGORIES if any(per.get(c) for _, per in mods)]
    short = {"optimizer_state": "optimizer", "temporaries": "temporary", "activations": "activation"}
    lines.append(f"  {'at the peak, ' + unit[1]:<22}" + "".join(f"{short.get(c, c):>12}" for c in cats) + f"{'total':>12}")
    for name, per in mods:
        lines.append(f"  {name:<22}" + "".join(f"{per.get(c, 0) / unit[0]:>12.3f}" for c in cats)
                     + f"{sum(per.values()) / unit[0]:>12.3f}")
    lines.append(f"  {'all':<22}" + "".join(f"{plan.by_category.get(c, 0) / unit[0]:>12.3f}" for c in cats)
                 + f"{plan.peak_bytes / unit[0]:>12.3f}")
    lines += ["", "  steady-state peak by phase: " + ", ".join(f"{k} {_size(v, unit)}" for k, v in plan.phases.items())]
    state = ", ".join(f"{'device' if d == DEVICE.type else 'host' if d == HOST.type else d} {_size(n)}"
                      for d, n in plan.optimizer_state_bytes.items() if n)
    if state:
        lines.append(f"  optimizer state (kept between steps, included above): {state}")
    lines += [
        "",
        f"host RAM (tensors): peak {_size(plan.host_peak_bytes)} (in {plan.host_peak_phase}), during training "
        f"{_size(plan.host_steady_bytes)}; pinned {_size(plan.host_pinned_bytes)}, "
        f"pageable {_size(plan.host_pageable_bytes)}",
    ]
    if plan.suggestions:
        lines += ["", "would save the most (estimates from the breakdown above, not re-planned; "
                      "confirm with mode=plan and the override):"]
        for sug in plan.suggestions:
            after = plan.required_bytes - sug["saves_bytes"]
            ok = plan.budget_bytes is not None and after <= plan.budget_bytes
            bound = "up to " if sug.get("upper_bound") else ""
            lines.append(f"  {sug['override']:<28} saves {bound}{_size(sug['saves_bytes'])} -> "
                         f"{_size(after)}, {'fits' if ok else 'still over'}")
            lines.append(f"  {'':<28}   ({sug['how']})")
    timings = plan.notes.get("timings_s") or {}
    detail = f" ({', '.join(f'{k} {v:.1f} s' for k, v in timings.items())})" if timings else ""
    lines += ["", f"simulated in {plan.seconds:.1f} s{detail}"]
    return "\n".join(lines)


# ---- planning ----------------------------------------------------------------------------------
def default_target(cfg: Any) -> str:
    """The device a plan is for: CUDA unless ``train.device=cpu``."""
    return "cpu" if str(cfg.train.device) == "cpu" else "cuda"


def effective_precision(cfg: Any, target: str) -> str:
    """The precision the loop would use there (runner.loop.make_accelerator: CPU is float32 unless asked)."""
    precision = str(cfg.train.mixed_precision)
    if target == "cpu" and not bool(cfg.train.get("cpu_autocast", False)):
        return "no"
    return precision


def note_pinned_bytes(ctx: Any, nbytes: int) -> None:
    """For plugins: record host bytes page-locked (or to be, on the target GPU) by this run."""
    ctx.state["pinned_host_bytes"] = int(ctx.state.get("pinned_host_bytes", 0) or 0) + int(nbytes)


def _pinned(ctx: Any) -> int:
    value = ctx.state.get("pinned_host_bytes", 0) or 0
    return int(sum(value.values())) if isinstance(value, dict) else int(value)


def _isolated(trainer: Any) -> Any:
    """A deep copy of the trainer for the simulation.

    Trainers keep objects that move their tensors to the device they are used on (diffusers'
    DDPMScheduler stores ``alphas_cumprod`` moved to the batch's device) and plugins may patch
    ``trainer.encode``; simulating on the run's own trainer would leave fake tensors and patches
    in it. The protocol forbids building models in ``__init__``, so a copy is cheap. A trainer
    that cannot be deep-copied is simulated on a shallow copy (its dicts and lists copied) and
    a warning says so.
    """
    try:
        return copy.deepcopy(trainer)
    except Exception as e:  # noqa: BLE001 - any object graph can refuse a deep copy
        log.warning("planner: %s cannot be deep-copied (%s); simulating on a shallow copy, so objects it "
                    "holds may keep fake tensors", type(trainer).__name__, e)
        twin = copy.copy(trainer)
        for k, v in vars(trainer).items():
            if isinstance(v, (dict, list)):
                setattr(twin, k, copy.copy(v))
        return twin


def _example(trainer: Any, raw: bool, batch_size: int) -> dict[str, Any]:
    with unset_fake_temporarily():  # shape-only tensors on real meta; seeds as real CPU ints
        if raw:
            return trainer.example_raw_batch(batch_size, DEVICE)
        return trainer.example_batch(batch_size, DEVICE)


class _Recorder:
    """Per-phase snapshots of the tracker (taken at the end of each phase, then peaks reset)."""

    def __init__(self, tracker: LiveBytesTracker, top_level: set[str]) -> None:
        self.tracker = tracker
        self.top_level = top_level
        self.phases: list[tuple[str, dict[str, Any]]] = []

    def top(self, label: str) -> str:
        head = label.split(".", 1)[0]
        if head in self.top_level:
            return head
        return OUTSIDE if label == NO_MODULE else label

    def take(self, name: str) -> None:
        snap = self.tracker.snapshot()["devices"]
        per_dev = {}
        for dev, d in snap.items():
            by_module: dict[str, dict[str, int]] = {}
            for label, cats in d["peak_by_module"].items():
                agg = by_module.setdefault(self.top(label), {})
                for c, n in cats.items():
                    agg[c] = agg.get(c, 0) + n
            per_dev[dev] = PhasePeak(name, d["peak_phase"], d["peak_bytes"], by_module)
        self.phases.append((name, per_dev))
        self.tracker.reset_peaks()


def plan_step(
    cfg: Any,
    trainer: Any = None,
    schedule: Any = None,
    *,
    target: str | None = None,
) -> Plan:
    """Simulate one training step of ``cfg`` (with ``trainer`` and plugin ``schedule`` if given).

    ``cfg``: the composed run config (``runner.validate.compose_config``); ``trainer``: any object
    following the trainer protocol (default: built from ``cfg.trainer``); ``schedule``: a
    :class:`~runner.plugin.PluginSchedule` (default: the plugins ``cfg`` names); ``target``:
    ``"cuda"`` or ``"cpu"`` (default :func:`default_target`). Nothing real is allocated.
    """
    from runner.run import build_plugins, build_trainer

    started = time.perf_counter()
    with _one_thread(), _old_objects_frozen():
        sim = _Simulation(
            cfg,
            _isolated(trainer if trainer is not None else build_trainer(cfg)),
            schedule if schedule is not None else build_plugins(cfg),
            target or default_target(cfg),
        )
        with sim.mode:
            try:
                with sim.tracker, sim.semantics:
                    sim.timed("setup", sim.setup)
                    for i in range(sim.n_micro):
                        sim.timed("forward+backward", sim.forward_backward, i)
                    sim.timed("optimizer", sim.optimizer_step)
            finally:
                sim.tracker.detach_module_hooks()
                sim.ctx.run_phase("teardown")
    return _assemble(sim, time.perf_counter() - started)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """No intra-op threads while planning: nothing is computed, and on a busy machine the thread
    pool's barriers made the few real CPU ops (LoRA init) take milliseconds each."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _old_objects_frozen() -> Iterator[None]:
    """Keep the garbage collector off the objects that existed before the plan.

    A full collection walks every tracked object: after importing torch, diffusers and
    transformers that is millions, ~0.3 s a pass, and a plan triggers several (imports of the
    model classes, the park plugin's collect after dropping modules). Frozen objects are
    skipped, not leaked: they return to the collector when the plan ends. Objects the plan
    creates are collected as usual, so a dropped module is still freed when a plugin asks.
    """
    if gc.get_freeze_count():  # the application froze objects itself: leave its choice alone
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _Simulation:
    """The state of one simulated step; each method is one part of the step, in order."""

    def __init__(self, cfg: Any, trainer: Any, schedule: Any, target: str) -> None:
        from runner.context import RunContext

        self.cfg, self.trainer, self.target = cfg, trainer, target
        self.precision = effective_precision(cfg, target)
        self.batch_size = int(cfg.train.batch_size)
        self.micro = self.batch_size // int(cfg.train.grad_accum)
        self.n_micro = min(int(cfg.train.grad_accum), 2)  # later micro-batches repeat the second one
        self.notes: dict[str, Any] = {"timings_s": {}}
        t0 = time.perf_counter()
        self.models = trainer.build_models(DEVICE)  # real meta tensors: shapes only
        self.part_shapes = _encode_part_shapes(trainer, self.models, self.micro)
        self.notes["timings_s"]["build"] = round(time.perf_counter() - t0, 2)
        self.semantics = DeviceSemantics(target, self.precision)
        self.ctx = RunContext(cfg=cfg, schedule=schedule, device=DEVICE, simulate=True, host=HOST)
        self.ctx.trainer = trainer
        self.ctx.accelerator = SimulatedAccelerator(self.semantics, self.precision)
        self.tracker = LiveBytesTracker(count_inputs=False)  # every pre-existing tensor is tracked explicitly
        self.recorder = _Recorder(self.tracker, set(self.models.modules))
        self.owner: dict[int, str] = {}  # id(parameter) -> top-level module
        self.mode = simulation_mode()
        self.params: list[nn.Parameter] = []
        self.raw = False
        self.cached: set[str] = set()
        self.state_by_dev: dict[str, dict[str, dict[str, int]]] = {}
        self.host_steady = 0

    def timed(self, name: str, fn: Any, *args: Any) -> None:
        t0 = time.perf_counter()
        fn(*args)
        timings = self.notes["timings_s"]
        timings[name] = round(timings.get(name, 0.0) + time.perf_counter() - t0, 2)

    def setup(self) -> None:
        """Models onto the fake host, then the plugins' setup phases and placement, as a run does."""
        tracker, ctx = self.tracker, self.ctx
        memo: dict[int, torch.Tensor] = {}
        for name, module in self.models.items():
            fake_module(module, HOST, memo)
            tracker.track(module, "weights", module=name)
        memo.clear()  # a module a plugin drops must be freed, as in a real run
        ctx.models = self.models
        with tracker.phase("setup", category="weights"):
            ctx.apply_setup_phases()
        for name, module in ctx.models.items():  # device copies were born unlabelled
            tracker.track(module, "weights", module=name)
            for p in module.parameters():
                self.owner[id(p)] = name
            tracker.attach_module_hooks(module, depth=1, prefix=name)
        self.recorder.take("setup")
        from runner.optim import build_optimizer

        self.params = list(ctx.models.trainable_parameters())
        ctx.optimizer = build_optimizer(self.cfg.optimizer, self.params, simulate=True)
        ctx.run_phase("wrap_optimizer")
        trainer = self.trainer
        self.raw = (ctx.state.get("encode_on_device", True) is not False
                    and callable(getattr(trainer, "example_raw_batch", None)) and callable(getattr(trainer, "encode", None)))
        self.cached = _cached_parts(trainer, ctx) if self.raw else set()
        self.notes["batch"] = ("raw batch (pixels, captions) encoded on the device" if self.raw
                               else "encoded example batch (no encode step on the device)")
        if self.cached:
            self.notes["batch"] += f"; read from the cache: {', '.join(sorted(self.cached))}"
        ctx.run_phase("on_step_start", 0)

    def forward_backward(self, i: int) -> None:
        """One micro-batch, as runner.loop.forward_backward runs it."""
        tracker, ctx, trainer = self.tracker, self.ctx, self.trainer
        suffix = f" #{i + 1}" if self.n_micro > 1 else ""
        host_batch = _fake_batch(_example(trainer, self.raw, self.micro), HOST)
        tracker.track(host_batch, "other", module="(batch)")
        batch = _move_batch(host_batch, DEVICE)
        tracker.track(batch, "other", module="(batch)")
        with tracker.phase("forward"), ctx.step_context(), ctx.accelerator.autocast():
            if self.raw:
                with tracker.phase("encode", category="activations"), torch.no_grad():
                    enc = _encode(trainer, ctx.models, batch, self.cached, self.part_shapes)
            else:
                enc = batch
            loss = trainer.loss(ctx.models, enc)
        self.recorder.take("forward" + suffix)
        with tracker.phase("backward"):
            ctx.accelerator.backward(loss * (self.micro / self.batch_size))
        del loss, enc, batch, host_batch  # the loop holds them until its backward returns
        for p in self.params:
            if p.grad is not None:
                tracker.track(p.grad, "gradients", module=self.owner.get(id(p)))
        self.recorder.take("backward" + suffix)

    def optimizer_step(self) -> None:
        tracker, ctx = self.tracker, self.ctx
        with tracker.phase("optimizer"):
            if float(self.cfg.train.max_grad_norm) > 0:
                ctx.accelerator.clip_grad_norm_([p for p in self.params if p.grad is not None],
                                                float(self.cfg.train.max_grad_norm))
            ctx.optimizer.step()
        _label_optimizer_state(tracker, ctx.optimizer, self.owner)
        self.recorder.take("optimizer")
        self.state_by_dev = {dev: tracker.module_bytes(dev) for dev in tracker.current}
        ctx.optimizer.zero_grad(set_to_none=True)
        ctx.run_phase("on_step_end", 1)
        self.host_steady = tracker.current_bytes(HOST.type)


def _encode_part_shapes(trainer: Any, models: Any, micro: int) -> dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """Shapes and dtypes of each cacheable encode part, from a run of the encoders on real ``meta``.

    A plugin may serve some parts from a cache and drop the modules that compute them; the
    simulated step then needs those parts' tensors without the modules. Shape-only meta kernels
    make this a fraction of a second even for T5-XXL. Empty for trainers without the split.
    """
    needed = ("encode_parts", "encode_part", "finish_encode", "example_raw_batch")
    if not all(callable(getattr(trainer, m, None)) for m in needed):
        return {}
    raw = trainer.example_raw_batch(micro, DEVICE)
    shapes: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
    with torch.no_grad():
        for part in trainer.encode_parts():
            out = trainer.encode_part(models, part, raw)
            shapes[part] = {k: (tuple(v.shape), v.dtype) for k, v in out.items() if isinstance(v, torch.Tensor)}
    return shapes


def _cached_parts(trainer: Any, ctx: Any) -> set[str]:
    """Encode parts the run reads from a cache rather than computes on the device.

    ``ctx.state["cached_encode_parts"]`` when a plugin says so; otherwise every part that needs
    a module the plugins removed from the ModelSet (it cannot be computed, so it is cached).
    """
    if not callable(getattr(trainer, "encode_parts", None)):
        return set()
    declared = ctx.state.get("cached_encode_parts")
    if declared is not None:
        return set(declared)
    return {part for part, spec in trainer.encode_parts().items() if any(m not in ctx.models for m in spec.modules)}


def _encode(trainer: Any, models: Any, batch: dict[str, Any], cached: set[str],
            shapes: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]) -> dict[str, Any]:
    """``trainer.encode``, with cached parts arriving on the device as a cache read gives them."""
    if not cached:
        return trainer.encode(models, batch)
    parts = {}
    for part in trainer.encode_parts():
        if part in cached:
            parts[part] = {k: torch.empty(shape, dtype=dtype, device=DEVICE) for k, (shape, dtype) in shapes[part].items()}
        else:
            parts[part] = trainer.encode_part(models, part, batch)
    return trainer.finish_encode(parts, batch)


def _label_optimizer_state(tracker: LiveBytesTracker, optimizer: Any, owner: dict[int, str]) -> None:
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict):
        return
    for p, st in state.items():
        tensors = [v for v in (st.values() if isinstance(st, dict) else []) if isinstance(v, torch.Tensor)]
        if tensors:
            tracker.track(tensors, "optimizer_state", module=owner.get(id(p)))


def _assemble(sim: _Simulation, seconds: float) -> Plan:
    cfg, trainer, ctx, recorder = sim.cfg, sim.trainer, sim.ctx, sim.recorder
    target, precision, micro, n_micro = sim.target, sim.precision, sim.micro, sim.n_micro
    state_by_dev, host_steady = sim.state_by_dev, sim.host_steady
    notes = dict(sim.notes)
    notes.update({k: v for k, v in ctx.notes.items() if isinstance(v, (int, float, str, bool))})
    # Optimizer state per device and top-level module, as it stands after the step.
    state: dict[str, dict[str, int]] = {}
    for dev, mods in state_by_dev.items():
        for label, cats in mods.items():
            n = cats.get("optimizer_state", 0)
            if n:
                per = state.setdefault(dev, {})
                per[recorder.top(label)] = per.get(recorder.top(label), 0) + n
    best: dict[str, PhasePeak] = {}
    phases: dict[str, int] = {}
    for name, per_dev in recorder.phases:
        for dev, pk in per_dev.items():
            if name.startswith(("forward", "backward")):  # steady state: the state lives through them
                extra = state.get(dev, {})
                by_module = {m: dict(c) for m, c in pk.by_module.items()}
                for m, n in extra.items():
                    by_module.setdefault(m, {})["optimizer_state"] = by_module.get(m, {}).get("optimizer_state", 0) + n
                pk = PhasePeak(name, pk.where, pk.peak_bytes + sum(extra.values()), by_module)
            if dev == DEVICE.type:
                phases[name] = pk.peak_bytes
            if dev not in best or pk.peak_bytes > best[dev].peak_bytes:
                best[dev] = pk
    empty = PhasePeak("setup", "setup", 0, {})
    dev_peak, host_peak = best.get(DEVICE.type, empty), best.get(HOST.type, empty)
    by_category = {c: sum(per.get(c, 0) for per in dev_peak.by_module.values()) for c in CATEGORIES}
    where = dev_peak.name if dev_peak.where in (dev_peak.name.split(" ")[0], "(reset)") else f"{dev_peak.name}, in {dev_peak.where}"
    c = cfg
    plugins = ", ".join(f"{k}={c[k].name}" for k in ("allocator", "quantization", "offload", "checkpoint", "tiling")
                        if k in c and c[k].get("name") not in (None, "none"))
    budget = c.get("budget_gb")
    run = {
        "trainer": type(trainer).__name__,
        "size": str(c.model.size),
        "resolution": int(c.data.resolution),
        "batch_size": int(c.train.batch_size),
        "micro_batch_size": micro,
        "micro_batches": int(c.train.grad_accum),
        "micro_batches_simulated": n_micro,
        "precision": precision,
        "precision_text": f"{precision} autocast" if precision != "no" else "float32 (no autocast)",
        "plugins": plugins or "none",
        "optimizer": str(c.optimizer.get("name", "?")),
        "trained": ", ".join(sorted(ctx.models.trained)) if ctx.models is not None else "?",
        "model_train": str(c.model.get("train", "?")),
        "model_dtype": str(c.model.get("dtype", "?")),
        "modules": sorted(ctx.models.modules) if ctx.models is not None else [],
    }
    plan = Plan(
        target=target,
        peak_bytes=dev_peak.peak_bytes,
        peak_phase=where,
        margin_bytes=CUDA_WORKSPACE_MARGIN_BYTES if target == "cuda" else 0,
        budget_bytes=int(float(budget) * GiB) if budget is not None else None,
        by_category=by_category,
        by_module={m: {k: v for k, v in cats.items() if v} for m, cats in dev_peak.by_module.items()
                   if any(cats.values())},
        phases=phases,
        host_peak_bytes=host_peak.peak_bytes,
        host_peak_phase=host_peak.name,
        host_steady_bytes=host_steady,
        host_pinned_bytes=_pinned(ctx),
        optimizer_state_bytes={dev: sum(v.values()) for dev, v in state.items()},
        run=run,
        notes=notes,
        seconds=seconds,
    )
    if not plan.fits:
        plan.suggestions = suggest(plan, cfg)
    return plan


# ---- suggestions ---------------------------------------------------------------------------------
def _available(kind: str) -> list[str]:
    from runner import registry

    try:
        return registry.plugin_names(kind)
    except Exception:  # a registry without the kind: nothing to suggest
        return []


def _optimizer_names() -> list[str]:
    try:
        from runner.optim import OPTIMIZERS
    except ImportError:
        return ["adamw"]
    return list(OPTIMIZERS)


def _bytes_per_element(dtype_name: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype_name, 4)


def suggest(plan: Plan, cfg: Any) -> list[dict[str, Any]]:
    """Settings that would lower the peak the most, each with an *estimated* saving.

    Every figure is arithmetic on the measured breakdown at the peak; ``how`` says which. They
    do not add up (two suggestions may save the same bytes), and savings marked ``upper_bound``
    are at most the figure. Only options that exist in this installation are suggested.
    """
    cats, mods = plan.by_category, plan.by_module
    trained = set(plan.run["modules"]) & {t.strip() for t in plan.run["trained"].split(",")}
    frozen = [m for m in plan.run["modules"] if m not in trained]
    weights = {m: mods.get(m, {}).get("weights", 0) for m in plan.run["modules"]}
    out: list[dict[str, Any]] = []

    def add(override: str, saves: float, how: str, upper_bound: bool = False) -> None:
        if saves > 0:
            out.append({"override": override, "saves_bytes": int(saves), "how": how, "upper_bound": upper_bound,
                        "kind": "estimate"})

    ckpt = cfg.checkpoint.get("name", "none")
    if ckpt == "none" and "blocks" in _available("checkpoint"):
        acts = sum(mods.get(m, {}).get("activations", 0) for m in trained)
        add("checkpoint=blocks", acts, "activations of the trained modules alive at the peak; blocks keep "
            "only their inputs, so the saving is this minus the block boundaries", upper_bound=True)
    elif ckpt == "blocks" and cfg.checkpoint.get("mode") == "every_n":
        acts = sum(mods.get(m, {}).get("activations", 0) for m in trained)
        add("checkpoint.mode=full", acts * (1 - 1 / max(int(cfg.checkpoint.get("every_n", 2)), 1)),
            "the share of blocks every_n leaves unchecked, of the activations at the peak", upper_bound=True)
    if str(cfg.model.get("train")) == "full":
        base = _bytes_per_element(str(cfg.model.get("dtype", "float32")))
        dn = sum(weights[m] for m in trained)
        saved = cats.get("gradients", 0) + cats.get("optimizer_state", 0) + dn * (1 - base / 4)
        add("model.train=lora", saved, f"gradients + optimizer state at the peak, and the trained weights stored in "
            f"model.dtype ({base} B) instead of float32 master weights; LoRA's own few MB not subtracted")
    if str(cfg.model.get("train", "full")) == "full" and str(cfg.model.get("train_dtype", "")) == "float32":
        adamw = str(cfg.optimizer.get("name", "adamw")) == "adamw"  # torch AdamW keeps moments in the weights' dtype
        trained_bytes = (sum(weights[m] for m in trained) + cats.get("gradients", 0)
                         + (cats.get("optimizer_state", 0) if adamw else 0))
        add("model.train_dtype=bfloat16", trained_bytes / 2, "trained weights and their gradients"
            + (" and AdamW moments" if adamw else "") + " in bfloat16 instead of float32 (kohya's --full_bf16); "
            "the autocast copies of the weights it also removes are not counted")
    if str(cfg.model.get("dtype", "float32")) == "float32":
        frozen_w = sum(weights[m] for m in frozen)
        if str(cfg.model.get("train")) == "lora":
            frozen_w += sum(weights[m] for m in trained)  # the frozen base of a LoRA
        add("model.dtype=bfloat16", frozen_w / 2, "half of the float32 frozen weights at the peak")
    opt = str(cfg.optimizer.get("name", "adamw"))
    state = cats.get("optimizer_state", 0)
    if opt == "adamw" and state:
        names = _optimizer_names()
        if "adamw8bit" in names:
            add("optimizer=adamw8bit", state * 0.75 - state / 4 * 8 / 256 / 2,
                "AdamW's two float32 moments (8 B/param) become two uint8 moments plus absmax per 256 (~2.03 B/param)")
        if "adafactor" in names:
            add("optimizer=adafactor", state * 0.95, "no first moment and a factored second moment: ~5% of AdamW's "
                "state for matrices (upper bound: vectors keep a full moment)", upper_bound=True)
    if cfg.quantization.get("name", "none") == "none":
        q = _available("quantization")
        frozen_w = sum(weights[m] for m in frozen)
        if str(cfg.model.get("train")) == "lora":
            frozen_w += sum(weights[m] for m in trained)
        per = _bytes_per_element(str(cfg.model.get("dtype", "float32")))
        for name, bytes_per in (("nf4", 0.5 + 4 / 64), ("int8", 1.0 + 4 / 64), ("fp8", 1.0)):
            if name in q:
                add(f"quantization={name}", frozen_w * max(0.0, 1 - bytes_per / per),
                    f"frozen weights at {bytes_per:.2f} B/param instead of {per} (Linear layers only: an upper bound)",
                    upper_bound=True)
                break
    if cfg.offload.get("name", "none") == "none" and "park" in _available("offload") and frozen:
        frozen_w = sum(weights[m] for m in frozen)
        enc = 0
        if "encode" in plan.peak_phase:
            enc = cats.get("temporaries", 0) + cats.get("activations", 0)
        add("offload=park", frozen_w + enc, "frozen modules' weights on the device at the peak"
            + (" and the encode step's activations (the peak is in encode)" if enc else "")
            + "; with cached latents and embeddings they never reach the device")
    micro = int(plan.run["micro_batch_size"])
    if micro > 1:
        acts = cats.get("activations", 0) + cats.get("temporaries", 0)
        add(f"train.grad_accum={plan.run['batch_size']}", acts * (1 - 1 / micro),
            f"activations and temporaries scale with the micro-batch ({micro} -> 1)", upper_bound=True)
    out.sort(key=lambda s: -s["saves_bytes"])
    return out


def verify_suggestions(overrides: Sequence[str], plan: Plan, top: int = 3) -> list[dict[str, Any]]:
    """Re-plan the ``top`` suggestions of ``plan`` (made from ``overrides``): their measured savings.

    Costs one full simulation each. Returns the suggestions with ``measured_saves_bytes``.
    """
    from runner.validate import compose_config, validate

    out = []
    for sug in plan.suggestions[:top]:
        cfg = compose_config([*overrides, sug["override"]])
        validate(cfg)
        again = plan_step(cfg, target=plan.target)
        out.append({**sug, "measured_saves_bytes": plan.peak_bytes - again.peak_bytes, "measured_peak_bytes": again.peak_bytes})
    return out


# ---- entry points for the CLI ------------------------------------------------------------------
def plan_command(cfg: Any, out: Path) -> Plan:
    """``mode=plan``: simulate, print the table, write plan.json; PlanDoesNotFit when over budget."""
    plan = plan_step(cfg)
    print(plan.format_table())
    path = plan.write_json(out / PLAN_FILE)
    log.info("plan written to %s", path)
    if not plan.fits:
        raise PlanDoesNotFit(_over_budget(plan, path))
    return plan


def preflight(cfg: Any, trainer: Any, out: Path, device: torch.device) -> Plan | None:
    """Plan the run about to start, at its configured size, on the device it will use.

    Refuses (PlanDoesNotFit, exit 3) when the plan is over ``budget_gb``; without a budget it
    only logs the predicted peak. ``train.preflight=false`` skips it. A configuration the
    planner cannot simulate is logged and the run starts without a plan: the planner must never
    be the reason a run that would fit cannot start.
    """
    if not bool(cfg.train.get("preflight", True)):
        return None
    try:
        plan = plan_step(cfg, trainer, target="cuda" if device.type == "cuda" else "cpu")
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("preflight: the planner could not simulate this run (%s: %s); starting without a plan "
                    "(train.preflight=false skips it)", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    path = plan.write_json(out / PLAN_FILE)
    log.info("preflight: predicted peak %s on %s in %s (%.1f s to plan)%s; %s", _size(plan.required_bytes),
             plan.target, plan.peak_phase, plan.seconds,
             "" if plan.budget_bytes is None else f", budget_gb {plan.budget_bytes / GiB:g}", path)
    if not plan.fits:
        print(plan.format_table())
        raise PlanDoesNotFit(_over_budget(plan, path) + " The run was not started (train.preflight=false starts it anyway).")
    return plan


def _over_budget(plan: Plan, path: Path) -> str:
    best = plan.suggestions[0]["override"] if plan.suggestions else None
    return (f"The plan needs {plan.required_bytes / GiB:.2f} GiB of device memory at its peak ({plan.peak_phase}), "
            f"more than budget_gb={plan.budget_bytes / GiB:g}. "
            + (f"The largest estimated saving is {best}; " if best else "")
            + f"see the table above and {path}.")
