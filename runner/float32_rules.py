"""Which weights a model keeps in float32: the libraries' own rules, read from the model class.

transformers and diffusers models declare modules that must not be stored in half precision
(``_keep_in_fp32_modules``, ``_keep_in_fp32_modules_strict``): T5's ``wo`` overflows in float16,
and Wan keeps its rope tables, time embedder and norms in float32 under bfloat16 too. Two
callers apply these rules: the trainers when they build and cast modules
(runner/families/common/loading.py) and the quantization plugins when they choose the layers to leave
unquantized (plugins/quantization/common.py). They live here, apart from both, so that a plugin
needs no trainer internals.
"""
from __future__ import annotations

import torch
from torch import nn


def is_transformers_model(cls: type) -> bool:
    """Whether ``cls`` is a transformers model (the text encoders): its float32 rules differ from diffusers'."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return issubclass(cls, PreTrainedModel)


def keep_in_fp32(module: nn.Module, dtype: torch.dtype) -> set[str]:
    """Name parts whose weights ``module`` keeps in float32 when stored in ``dtype``.

    transformers' rule: ``_keep_in_fp32_modules`` (T5's ``wo``, which overflows in float16) under
    float16, ``_keep_in_fp32_modules_strict`` under bf16 too. diffusers' rule (``from_pretrained``
    with any ``torch_dtype``): ``_keep_in_fp32_modules`` under float16 and bfloat16 alike (Wan's
    rope tables, time embedder, modulation tables and norms).
    """
    keep: set[str] = set()
    diffusers_model = not is_transformers_model(type(module))
    if dtype == torch.float16 or (diffusers_model and dtype == torch.bfloat16):
        keep |= set(getattr(module, "_keep_in_fp32_modules", None) or [])
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(module, "_keep_in_fp32_modules_strict", None) or [])
    return keep


def keep_unquantized(module: nn.Module, compute_dtype: torch.dtype) -> set[str]:
    """Name parts whose layers a quantization plugin leaves alone: :func:`keep_in_fp32` at the
    compute dtype, plus a diffusers model's ``_keep_in_fp32_modules`` at any dtype, as diffusers'
    own quantizers skip them (Wan's time embedder: its forward casts the timestep to its first
    weight's dtype, which a 4-bit layer would make uint8)."""
    keep = keep_in_fp32(module, compute_dtype)
    if not is_transformers_model(type(module)):
        keep |= set(getattr(module, "_keep_in_fp32_modules", None) or [])
    return keep
