"""Frozen base weights stored in 8-bit floating point (``quantization=fp8``).

Each selected ``nn.Linear`` of the frozen base (see :mod:`plugins.quant_common` for which
modules and layers) becomes a :class:`Float8StorageLinear`: its weight is kept as
``float8_e4m3fn`` (or ``float8_e5m2``) with one float32 scale per layer, 1 B/param + 4 B, and
is upcast to ``compute_dtype`` right before each matmul. The biases keep their dtype (they are
tiny). This is kohya's ``--fp8_base`` and diffusers' layerwise casting, for training.

Why not diffusers' ``apply_layerwise_casting`` (the library path, which we would prefer): its
hooks upcast a layer's weight in a pre-forward hook and cast it back after, but ``F.linear``
saves the upcast weight for the input gradient. In a module that gradients flow through (a
LoRA-trained denoiser, the case fp8 storage is for) every layer's compute-dtype copy then stays
alive until backward: the model is held twice, once in fp8 and once in bf16, which is more than
plain bf16. tests/plugins/quantization/test_quantization.py measures this with the live-bytes tracker. Here an
autograd function saves the fp8 weight and upcasts again in backward, so only one layer's
upcast copy exists at a time (a temporary), in forward and in backward alike. The hook also
casts every supported layer type including LoRA's own ``lora_A``/``lora_B`` unless told to
skip them, and covers convolutions; we keep to the same Linear layers as ``nf4``/``int8``.

Scale: the weight is divided by ``amax / finfo.max`` before the cast (per-tensor scaling, as in
torchao's and Transformer Engine's float8). Without it every weight under 2^-9 in magnitude
(e4m3's smallest subnormal) would become 0 and small weights would lose most of their
precision; with it the largest weight maps to the format's largest value. Cost: 4 bytes and
one multiply per upcast.

The fp8 bits are stored as a ``uint8`` view: ``Module.to(dtype)`` casts every floating-point
parameter, float8 included, so ``model.to(torch.bfloat16)`` would otherwise silently undo the
storage (diffusers' hooks refuse to be undone for the same reason), and integer storage keeps
helpers that take "the first floating-point parameter" as the compute dtype from picking fp8.

Planner: plain torch ops, so the real path runs on meta and fake tensors unchanged (the
``ctx.simulate`` path is the real one, with the same bytes).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import UserError, valid_list
from runner.plugins.quantization.common import (
    DEFAULT_SKIP,
    LinearQuantization,
    LinearTarget,
    QuantizationResult,
    replace_layers,
    select_linear_layers,
)
from runner.plugins.schemas import Fp8Config
from runner.registry import register_plugin

if TYPE_CHECKING:
    from runner.context import RunContext

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float8_e4m3fn": torch.float8_e4m3fn,  # 3 mantissa bits, range +-448: the usual choice for weights
    "float8_e5m2": torch.float8_e5m2,  # 2 mantissa bits, range +-57344
}


class _Float8Matmul(torch.autograd.Function):
    """``linear(x, upcast(w))`` that saves the fp8 weight, not its upcast copy, for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bits: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                layer: "Float8StorageLinear") -> torch.Tensor:
        cdt = layer.compute_dtype
        weight = layer.upcast(bits, scale)
        y = F.linear(x.to(cdt), weight, None if bias is None else bias.to(cdt))
        ctx.save_for_backward(bits, scale)
        ctx.layer = layer
        ctx.x_dtype = x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        bits, scale = ctx.saved_tensors
        layer = ctx.layer
        grad_x = None
        if ctx.needs_input_grad[0]:
            weight = layer.upcast(bits, scale)
            grad_x = grad.to(layer.compute_dtype).matmul(weight).to(ctx.x_dtype)
        return grad_x, None, None, None, None


class Float8StorageLinear(nn.Module):
    """A frozen Linear whose weight lives in fp8 (as uint8 bits) and computes in ``compute_dtype``."""

    def __init__(self, layer: nn.Linear, storage_dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        w = layer.weight.detach()
        fmax = torch.finfo(storage_dtype).max
        amax = w.abs().amax().float()
        scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
        # clamp: casting to e4m3fn does not saturate, rounding just above the max gives NaN
        bits = (w.float() / scale).clamp_(-fmax, fmax).to(storage_dtype).view(torch.uint8)
        self.weight = nn.Parameter(bits, requires_grad=False)
        self.register_buffer("weight_scale", scale)
        self.bias = layer.bias

    def upcast(self, bits: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The dense weight in ``compute_dtype`` (a new tensor each call)."""
        bits = self.weight if bits is None else bits
        scale = self.weight_scale if scale is None else scale
        return bits.view(self.storage_dtype).to(self.compute_dtype) * scale.to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Float8Matmul.apply(x, self.weight, self.weight_scale, self.bias, self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"storage={str(self.storage_dtype).replace('torch.', '')}, compute={str(self.compute_dtype).replace('torch.', '')}")


def apply_fp8_storage(
    module: nn.Module,
    *,
    storage_dtype: torch.dtype = torch.float8_e4m3fn,
    compute_dtype: torch.dtype = torch.bfloat16,
    skip: Sequence[str] = DEFAULT_SKIP,
    keep: Sequence[str] = (),
    read: Callable[[str, nn.Module], None] | None = None,
) -> QuantizationResult:
    """Store ``module``'s frozen ``nn.Linear`` weights in fp8, upcast per layer in forward/backward.

    In place and one layer at a time. Works on real, meta and fake tensors alike. Trained
    (``requires_grad``) Linear layers are an error; LoRA adapters are never touched. ``read``: reads
    a layer's weights just before it is stored in fp8 (:func:`replace_layers`).
    """
    sel = select_linear_layers(module, skip, keep)
    if sel.trainable:
        raise ValueError(f"cannot store trained Linear layers in fp8 ({', '.join(sel.trainable[:3])}, ...); freeze them first")

    def make(t: LinearTarget) -> nn.Module:
        return Float8StorageLinear(t.layer, storage_dtype, compute_dtype)

    return replace_layers(module, sel, make, read=read)


@register_plugin
class Fp8Storage(LinearQuantization):
    name = "fp8"
    Config = Fp8Config

    def storage_dtype(self) -> torch.dtype:
        value = str(self.config.storage_dtype)
        if value not in STORAGE_DTYPES:
            raise UserError(
                f"{self.setting('storage_dtype')}={value!r} is not valid. Valid values: {valid_list(value, STORAGE_DTYPES)}."
            )
        return STORAGE_DTYPES[value]

    def validate(self) -> None:
        super().validate()
        self.storage_dtype()

    def quantize(self, module: nn.Module, skip: Sequence[str], keep: Sequence[str], ctx: RunContext,
                 read: Callable[[str, nn.Module], None] | None = None) -> QuantizationResult:
        return apply_fp8_storage(
            module, storage_dtype=self.storage_dtype(), compute_dtype=self.compute_dtype(), skip=skip, keep=keep,
            read=read,
        )
