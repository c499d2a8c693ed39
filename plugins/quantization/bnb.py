"""Frozen base weights in 4-bit NF4 (``quantization=nf4``) or 8-bit (``quantization=int8``).

Both replace selected ``nn.Linear`` layers of the frozen base (see :mod:`plugins.quant_common`
for which modules and layers, and why it runs after LoRA is attached) with bitsandbytes layers:

* ``nf4``: ``bnb.nn.Linear4bit(quant_type="nf4")``, QLoRA's 4-bit NormalFloat in blocks of 64
  weights. Per layer: ``ceil(n/2)`` bytes of packed weights + one float32 absmax per block
  (0.0625 B/param), or with ``double_quant`` (bnb's ``compress_statistics``, QLoRA's double
  quantization; default on, as in bnb's Linear4bit) one uint8 absmax per block + a float32 per
  256 blocks + a 4 B offset + a 1 KiB copy of the 8-bit code; plus a 64 B NF4 code table. About
  0.52 B/param for large layers: an eighth of float32, a quarter of bf16. The layer dequantizes
  to ``compute_dtype`` for each matmul (a temporary the size of one layer in that dtype), in
  forward and again in backward for the input gradient.
* ``int8``: ``bnb.nn.Linear8bitLt(has_fp16_weights=False)``, LLM.int8(): 1 B/param + one
  float32 scale per output row. ``threshold`` (default 6.0, as transformers/diffusers) keeps
  activation columns with outliers above it in 16-bit on CUDA; 0 disables the decomposition.
  On CPU, bitsandbytes trains through a dequantize-then-matmul path instead.

They share 90% of their code (selection, replacement, simulation, the plugin), so one file
registers both; ``fp8`` has no bitsandbytes part and lives in ``plugins/quantization/fp8.py``.

Why the layers are built here rather than with diffusers'/transformers' ``replace_with_bnb_linear``:
those helpers build *empty* layers on ``meta`` for ``from_pretrained``'s quantizer to fill from a
checkpoint, and match ``modules_to_not_convert`` partly by the layer's short name, so skipping a
top-level ``proj_out`` would also skip every ``single_transformer_blocks.N.proj_out`` of Flux,
and adapter layers (``lora_A``/``lora_B``, also ``nn.Linear``) would be converted unless each
were listed. We use bitsandbytes' own documented path instead (put the original weights into a
``Linear4bit``/``Linear8bitLt``, then ``.to(device)`` quantizes), one layer at a time.

One CPU detail: bitsandbytes repacks a 4-bit weight into an AVX512-BF16 layout the first time an
eval-mode layer runs without grad on such a CPU; that layout asserts on shapes that are not a
multiple of its tile and changes the bytes. We turn it off per layer
(``support_avx512bf16_for_cpu = False``) so a layer keeps the one layout that CUDA uses and the
planner simulates. It costs CPU inference speed only.

Planner simulation (``ctx.simulate``): bitsandbytes kernels cannot run on fake/meta tensors,
so each selected layer becomes a :class:`SimulatedQuantLinear` that holds uninitialised
(meta or fake) tensors of exactly the real layout (:func:`nf4_layout`, :func:`int8_layout`;
tests/plugins/quantization/test_quantization.py checks them against real bitsandbytes byte for byte), and whose
forward/backward allocate the temporaries the real kernels do (the dequantized weight for nf4;
int8 row-quantized activations in forward and a dequantized weight in backward for int8) and
return outputs of the real shape and dtype.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from runner.side_streams import cuda_like
from runner.plugins.quantization.common import (
    DEFAULT_SKIP,
    LinearQuantization,
    LinearTarget,
    QuantizationResult,
    empty_like_device,
    replace_layers,
    select_linear_layers,
)
from runner.plugins.schemas import Int8Config, NF4Config
from runner.registry import register_plugin

if TYPE_CHECKING:
    from runner.context import RunContext

METHODS = ("nf4", "int8")
NF4_BLOCKSIZE = 64  # bitsandbytes' default 4-bit block
NESTED_BLOCKSIZE = 256  # double quantization quantizes the absmax values in blocks of 256

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


# ---- exact layouts ------------------------------------------------------------------------------
def nf4_layout(out_features: int, in_features: int, double_quant: bool) -> Layout:
    """The tensors bitsandbytes 0.50 keeps for one NF4 ``Linear4bit`` weight (bias excluded)."""
    n = out_features * in_features
    blocks = math.ceil(n / NF4_BLOCKSIZE)
    layout: Layout = {"weight": (((n + 1) // 2, 1), torch.uint8), "code": ((16,), torch.float32)}
    if double_quant:
        layout["absmax"] = ((blocks,), torch.uint8)
        layout["offset"] = ((), torch.float32)
        layout["nested_absmax"] = ((math.ceil(blocks / NESTED_BLOCKSIZE),), torch.float32)
        layout["nested_code"] = ((256,), torch.float32)
    else:
        layout["absmax"] = ((blocks,), torch.float32)
    return layout


def int8_layout(out_features: int, in_features: int) -> Layout:
    """The tensors of one ``Linear8bitLt`` weight: int8 values and one float32 scale per row."""
    return {"weight": ((out_features, in_features), torch.int8), "SCB": ((out_features,), torch.float32)}


def layout_bytes(layout: Layout) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())


# ---- simulation ---------------------------------------------------------------------------------
class _SimulatedQuantMatmul(torch.autograd.Function):
    """Shapes, dtypes and temporaries of bitsandbytes' 4/8-bit matmuls, without their kernels."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                layer: "SimulatedQuantLinear") -> torch.Tensor:
        out_f, in_f = layer.out_features, layer.in_features
        if layer.method == "nf4":
            cdt = layer.compute_dtype
            dequantized = empty_like_device(x, (out_f, in_f), cdt)  # what gemm_4bit materialises
            y = F.linear(x.to(cdt), dequantized, None if bias is None else bias.to(cdt))
            del dequantized  # freed inside gemm_4bit, before Linear4bit casts its output back to the input's dtype
            y = y.to(x.dtype)
            ctx.save_for_backward(weight)  # MatMul4Bit keeps only the packed weight
        else:
            rows = x.numel() // x.shape[-1]
            quantized_x = empty_like_device(x, tuple(x.shape), torch.int8)  # int8_vectorwise_quant(A)
            row_scales = empty_like_device(x, (rows,), torch.float32)
            y = empty_like_device(x, (*x.shape[:-1], out_f), x.dtype)  # int8_scaled_mm's output
            del quantized_x, row_scales
            ctx.save_for_backward(weight, x)  # MatMul8bitLt keeps the input A for backward
        ctx.layer = layer
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        layer = ctx.layer
        dequantized = empty_like_device(grad, (layer.out_features, layer.in_features), grad.dtype)
        grad_x = grad.matmul(dequantized).to(ctx.x_dtype)
        return grad_x, None, None, None


class SimulatedQuantLinear(nn.Module):
    """Stands in for a bitsandbytes layer in the planner: the real layout on meta/fake tensors.

    The quantization statistics are registered as buffers (bitsandbytes keeps them on a
    ``QuantState`` object instead) so that anything counting a module's parameters and
    buffers sees every byte.
    """

    def __init__(self, layer: nn.Linear, method: str, compute_dtype: torch.dtype, double_quant: bool = True) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.method = method
        self.compute_dtype = compute_dtype
        src = layer.weight
        layout = (
            nf4_layout(self.out_features, self.in_features, double_quant)
            if method == "nf4"
            else int8_layout(self.out_features, self.in_features)
        )
        for key, (shape, dtype) in layout.items():
            t = empty_like_device(src, shape, dtype)
            if key == "weight":
                self.weight = nn.Parameter(t, requires_grad=False)
            else:
                self.register_buffer(key, t)
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SimulatedQuantMatmul.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, method={self.method} (simulated)"


# ---- the real layers -----------------------------------------------------------------------------
def _bnb_layer(
    target: LinearTarget,
    method: str,
    compute_dtype: torch.dtype,
    double_quant: bool,
    threshold: float,
    device: torch.device | None,
) -> nn.Module:
    import bitsandbytes as bnb

    layer = target.layer
    home = layer.weight.device
    work = torch.device(device) if device is not None else home
    has_bias = layer.bias is not None
    if method == "nf4":
        new = bnb.nn.Linear4bit(
            layer.in_features, layer.out_features, bias=has_bias, compute_dtype=compute_dtype,
            compress_statistics=double_quant, quant_type="nf4", quant_storage=torch.uint8, device="meta",
        )
        new.weight = bnb.nn.Params4bit(
            layer.weight.data, requires_grad=False, compress_statistics=double_quant, quant_type="nf4",
            quant_storage=torch.uint8, module=new,
        )
        new.support_avx512bf16_for_cpu = False  # keep the canonical layout (module docstring)
    else:
        new = bnb.nn.Linear8bitLt(
            layer.in_features, layer.out_features, bias=has_bias, has_fp16_weights=False, threshold=threshold,
            device="meta",
        )
        # Int8Params quantizes only when it leaves the CPU (or stays there); weights already on
        # an accelerator (hosted mode) take one trip through host memory.
        data = layer.weight.data if home.type == "cpu" else layer.weight.data.cpu()
        new.weight = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False)
    if has_bias:
        new.bias = nn.Parameter(layer.bias.data, requires_grad=False)
    new = new.to(work)  # bitsandbytes quantizes when the layer moves to a real device
    if work != home:
        new = new.to(home)
    return new


def apply_bnb_quantization(
    module: nn.Module,
    method: str = "nf4",
    *,
    skip: Sequence[str] = DEFAULT_SKIP,
    keep: Sequence[str] = (),
    compute_dtype: torch.dtype = torch.bfloat16,
    double_quant: bool = True,
    threshold: float = 6.0,
    device: torch.device | str | None = None,
    simulate: bool = False,
    read: Callable[[str, nn.Module], None] | None = None,
) -> QuantizationResult:
    """Replace ``module``'s frozen ``nn.Linear`` layers by NF4 or int8 bitsandbytes layers, in place.

    ``skip``: regexes of layer names to leave alone; ``keep``: module names kept in full
    precision (``_keep_in_fp32_modules``); ``device``: where bitsandbytes runs the quantization
    (e.g. ``cuda``, much faster than the CPU); layers return to where they were.
    ``simulate``: for meta/fake models, use :class:`SimulatedQuantLinear` (same bytes, no kernels).
    ``read``: reads a layer's weights just before it is quantized (:func:`replace_layers`).
    Trained (``requires_grad``) Linear layers are an error; LoRA adapters are never touched.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    sel = select_linear_layers(module, skip, keep)
    if sel.trainable:
        raise ValueError(f"cannot quantize trained Linear layers ({', '.join(sel.trainable[:3])}, ...); freeze them first")
    if simulate:
        def make(t: LinearTarget) -> nn.Module:
            return SimulatedQuantLinear(t.layer, method, compute_dtype, double_quant)
    else:
        dev = torch.device(device) if device is not None else None

        def make(t: LinearTarget) -> nn.Module:
            return _bnb_layer(t, method, compute_dtype, double_quant, threshold, dev)

    return replace_layers(module, sel, make, read=read)


def dequantized_weight(layer: nn.Module) -> torch.Tensor:
    """The dense weight a bitsandbytes layer computes with (for tests and comparisons)."""
    import bitsandbytes as bnb

    w = layer.weight
    if getattr(w, "quant_state", None) is not None:
        return bnb.functional.dequantize_4bit(w.data, w.quant_state)
    state = getattr(layer, "state", None)
    cb = w.CB if getattr(w, "CB", None) is not None else state.CB
    scb = w.SCB if getattr(w, "SCB", None) is not None else state.SCB
    return bnb.functional.int8_vectorwise_dequant(cb, scb)


# ---- the plugins ---------------------------------------------------------------------------------
def quantize_device(ctx: RunContext) -> torch.device | None:
    """Quantize on the training GPU when there is one (fast; one layer's weights there at a time); on
    the layer's own device otherwise. The simulated card takes the GPU's branch (runner/side_streams.py)."""
    return ctx.device if cuda_like(ctx.device) else None


@register_plugin
class NF4Quantization(LinearQuantization):
    name = "nf4"
    Config = NF4Config

    def quantize(self, module: nn.Module, skip: Sequence[str], keep: Sequence[str], ctx: RunContext,
                 read: Callable[[str, nn.Module], None] | None = None) -> QuantizationResult:
        return apply_bnb_quantization(
            module, "nf4", skip=skip, keep=keep, compute_dtype=self.compute_dtype(),
            double_quant=bool(self.config.double_quant), device=quantize_device(ctx), simulate=ctx.simulate, read=read,
        )


@register_plugin
class Int8Quantization(LinearQuantization):
    name = "int8"
    Config = Int8Config

    def quantize(self, module: nn.Module, skip: Sequence[str], keep: Sequence[str], ctx: RunContext,
                 read: Callable[[str, nn.Module], None] | None = None) -> QuantizationResult:
        _say_casts_once()
        return apply_bnb_quantization(
            module, "int8", skip=skip, keep=keep, compute_dtype=self.compute_dtype(),
            threshold=float(self.config.threshold), device=quantize_device(ctx), simulate=ctx.simulate, read=read,
        )


class _Once(logging.Filter):
    """Each distinct message once: bitsandbytes' int8 matmul warns on every call that it casts its
    input to float16 (36 identical lines in 3 tiny steps); the first says it, the repeats drown the log."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def _say_casts_once() -> None:
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _Once) for f in logger.filters):
        logger.addFilter(_Once())
