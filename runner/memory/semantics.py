"""The simulated device behaves like the target device: its autocast and attention kernels.

``meta`` has no autocast and no fused attention kernels, so :class:`DeviceSemantics` (a
``TorchFunctionMode``) gives it the target's: CUDA autocast (the op lists of PyTorch's
``ATen/autocast_mode.h``: lower-precision, float32 and promote ops, and the cast cache of fp32
weights within the autocast region) when ``train.mixed_precision`` is bf16/fp16, and the
attention kernel PyTorch would pick (flash, memory-efficient, cuDNN or math, in PyTorch's
priority order and within the ``sdpa_kernel`` settings of the tiling plugin). Without this a
1024 px Flux step would count several GiB of L x L attention matrices that no GPU run allocates.
The target is CUDA unless ``train.device=cpu`` (or the preflight of a run that resolved to the
CPU): then float32 unless ``train.cpu_autocast``, and PyTorch's CPU flash attention.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from runner.compat import (
    engine_run_backward,
    foreach_mul_,
    foreach_norm,
    sdp_priority_order,
    unset_fake_temporarily,
)

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


def _holds_tensor(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    return isinstance(data, (list, tuple)) and any(_holds_tensor(x) for x in data)


_SPECIAL = frozenset({"tensor", "as_tensor", "scaled_dot_product_attention"})
_PASSES_THROUGH: dict[Any, bool] = {}  # function -> DeviceSemantics never changes its call


def _passes_through(func: Any) -> bool:
    name = getattr(func, "__name__", None)
    return name is None or not (name in _SPECIAL or name in AUTOCAST_LOWER or name in AUTOCAST_FP32
                                or name in AUTOCAST_FP32_OPT_DTYPE or name in AUTOCAST_PROMOTE)


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

    def __init__(self, target: str, precision: str, on_device: Any = None, cpu_kernels: bool = False) -> None:
        """``on_device``: whether a tensor is on the simulated device (default: on ``meta``, the
        planner's); ``cpu_kernels``: tensors hold real CPU values (``train.device=cuda_sim``), so where
        CUDA would run a fused attention kernel, PyTorch's CPU flash attention runs (the same O(L)
        memory: the output and a float32 log-sum-exp per query), since CUDA's own cannot run there."""
        super().__init__()
        self.on_device = on_device or (lambda x: x.device.type == "meta")
        self.cpu_kernels = cpu_kernels
        self.target = target
        self.dtype = PRECISION_DTYPES.get(precision)  # None: float32, nothing to cast
        self.casting = False
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        # dist=fsdp with a MixedPrecisionPolicy: ids of the float32 weights FSDP2 all-gathers in the autocast
        # dtype. Their casts are neither cached nor counted (``uncounted``, the tracker's): they stand for the
        # gathered copy of the unit, which runner/plan/dist.py counts one unit at a time.
        self.gathered: frozenset[int] = frozenset()
        self.uncounted: Any = contextlib.nullcontext

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

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run as on plain ``meta`` (no casting): for work inside a plan that is not part of the step."""
        before = (self.casting, self.cache)
        self.casting, self.cache = False, None
        try:
            yield
        finally:
            self.casting, self.cache = before

    # -- casting -----------------------------------------------------------------------------
    def _eligible(self, x: Any) -> bool:
        return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
                and self.on_device(x))

    def _cast(self, x: Any, to: torch.dtype) -> Any:
        if isinstance(x, (list, tuple)):
            return type(x)(self._cast(y, to) for y in x)
        if not self._eligible(x) or x.dtype == to:
            return x
        if self.gathered and to == self.dtype and id(x) in self.gathered:
            with self.uncounted():  # FSDP2 hands the op this weight in ``to`` already (see __init__)
                return x.to(to)
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
        # Most calls (Tensor properties and methods, views, elementwise ops) are none of the
        # functions below: answered from a per-function verdict, without the name checks.
        try:
            passes = _PASSES_THROUGH[func]
        except KeyError:
            passes = _passes_through(func)
            if not isinstance(getattr(func, "__self__", None), torch.Tensor):  # never keep a tensor alive
                _PASSES_THROUGH[func] = passes
        except TypeError:  # pragma: no cover - an unhashable callable
            passes = False
        if passes:
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if name in ("tensor", "as_tensor") and args and not _holds_tensor(args[0]):
            # A tensor made from Python data on the host holds real values (seeds, sizes, ids)
            # that code reads back with tolist(): keep it real. It is a few bytes. Made on the
            # simulated device, it is that real tensor moved there (a move keeps its value:
            # runner/plan/known_values.py).
            device = kwargs.get("device")
            with unset_fake_temporarily():
                real = func(*args, **{**kwargs, "device": "cpu"})
            return real if torch.device(device or "cpu").type == "cpu" else real.to(device)
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
        if (not all(isinstance(t, torch.Tensor) and self.on_device(t) for t in (q, k, v))
                or p.get("enable_gqa") or q.dim() != 4 or not (q.dtype == k.dtype == v.dtype)):
            return func(*args, **kwargs)
        dtype = q.dtype
        same_heads = q.shape[-1] == k.shape[-1] == v.shape[-1]
        ops = torch.ops.aten
        if self.target == "cpu":
            if torch.backends.cuda.flash_sdp_enabled() and same_heads:
                if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:  # converted at SDPA's entry on the
                    mask = _additive_mask(mask, dtype)  # CPU too: the kernel saves the float mask for backward
                return ops._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, dropout, causal, attn_mask=mask, scale=scale)[0]
            return func(*args, **kwargs)
        half = dtype in (torch.float16, torch.bfloat16)
        needs_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if self.cpu_kernels:
            return self._cpu_attention(func, args, kwargs, q, k, v, mask, dropout, causal, scale, half, same_heads)
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            # SDPA's entry turns a boolean mask into an additive one in the query's dtype before any
            # fused kernel sees it (attention.cpp: convert_boolean_attn_mask): a mask-sized allocation.
            mask = _additive_mask(mask, dtype)
        backend = self._cuda_backend(q, k, v, mask, half, same_heads)
        if backend == 1:
            return ops._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False, scale=scale)[0]
        if backend == 2:
            return ops._scaled_dot_product_efficient_attention(q, k, v, mask, needs_lse, dropout, causal, scale=scale)[0]
        if backend == 3:
            return ops._scaled_dot_product_cudnn_attention(
                q, k, v, mask, needs_lse, dropout, causal, False, scale=scale)[0]
        return func(*args, **kwargs)  # the math path


    @staticmethod
    def _cuda_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, half: bool, same_heads: bool) -> int:
        """The backend CUDA would pick (sdp_priority_order's numbering: 0 math, 1 flash, 2 efficient, 3 cuDNN)."""
        head = q.shape[-1]
        for backend in sdp_priority_order():
            if backend == 1 and torch.backends.cuda.flash_sdp_enabled() and half and mask is None and same_heads \
                    and head <= 256 and head % 8 == 0:
                return 1
            if backend == 2 and torch.backends.cuda.mem_efficient_sdp_enabled() \
                    and q.dtype in (torch.float32, torch.float16, torch.bfloat16) and head % (8 if half else 4) == 0 \
                    and v.shape[-1] % (8 if half else 4) == 0:
                return 2
            if backend == 3 and torch.backends.cuda.cudnn_sdp_enabled() and half and same_heads and head <= 128 \
                    and head % 8 == 0:
                return 3
            if backend == 0 and torch.backends.cuda.math_sdp_enabled():
                return 0
        return 0

    def _cpu_attention(self, func: Any, args: tuple, kwargs: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: Any, dropout: float, causal: bool, scale: Any, half: bool, same_heads: bool) -> Any:
        """Real values on the CPU for a CUDA target: a fused CUDA kernel becomes the CPU's fused one."""
        if self._cuda_backend(q, k, v, mask, half, same_heads) == 0:
            # CUDA's math path materialises the L x L scores; the CPU's own SDPA would pick its flash kernel
            return torch.ops.aten._scaled_dot_product_attention_math(
                q, k, v, mask, dropout, causal, scale=scale)[0]
        if not same_heads:
            return func(*args, **kwargs)
        if isinstance(mask, torch.Tensor) and mask.dim() == 3:  # SDPA broadcasts it as (1, ...); the CPU kernel
            mask = mask.unsqueeze(0)  # takes 2 or 4 dims (HunyuanVideo 1.5's VAE passes a (B, L, L) causal mask)
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:  # as SDPA's own entry converts it
            mask = _additive_mask(mask, q.dtype)
        elif isinstance(mask, torch.Tensor) and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)  # the CPU kernel takes a float mask only in the query's dtype
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout, causal, attn_mask=mask, scale=scale)[0]


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as SDPA's entry converts it: 0 where attended, -inf elsewhere."""
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(~mask, float("-inf"))


class SimulatedAccelerator:
    """What plugins and the step read from ``ctx.accelerator``, for the simulated device."""

    def __init__(self, semantics: DeviceSemantics, precision: str) -> None:
        self.semantics = semantics
        self.mixed_precision = precision
        self.device = torch.device("meta")  # the simulated accelerator

    def autocast(self) -> Any:
        return self.semantics.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        # The C++ engine entry, not loss.backward(): Tensor.backward goes through the function
        # mode, which is switched off while it handles a call, so checkpoint recomputation in
        # backward would run without the target's autocast and attention kernels.
        with self.semantics.autocast(cache=False):  # the forward ran under autocast: so do recomputations
            engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (),
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
        norms = [n for grads in groups.values() for n in foreach_norm(grads, 2.0)]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for grads in groups.values():
            foreach_mul_(grads, coef)
        return total

    def prepare(self, *objs: Any) -> Any:
        return objs[0] if len(objs) == 1 else objs
