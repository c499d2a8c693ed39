"""What each optimizer keeps per parameter: the state layouts the planner allocates on fake tensors.

Split from runner/optim/build.py (its factory table names these). Each layout is written from the
library's source and checked against the real optimizer's state after real steps, tensor for tensor
and byte for byte, in tests/runner/optim/test_optimizers.py; a run's preflight plan against its
checkpointed state in tests/runner/state/test_train_state.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

BNB_BLOCKSIZE = 256  # bitsandbytes' blockwise 8-bit optimizer state block
PAGED_MIN_NUMEL = 100_000  # bitsandbytes pages only state tensors of at least this many elements


@dataclass(frozen=True)
class StateTensor:
    """One tensor an optimizer keeps for one parameter.

    ``where``: ``"param"`` (the parameter's device), ``"host"`` (CPU, e.g. torch AdamW's step
    counter) or ``"paged"`` (CUDA unified memory). ``shared``: a key when one tensor serves every
    parameter on a device (bitsandbytes' quantile maps), counted once.
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    where: str = "param"
    shared: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _adamw_layout(cfg: Any, p: torch.Tensor) -> list[StateTensor]:
    shape = tuple(p.shape)
    return [
        StateTensor("step", (), torch.get_default_dtype(), "host"),
        StateTensor("exp_avg", shape, p.dtype),
        StateTensor("exp_avg_sq", shape, p.dtype),
    ]


def _adamw8bit_layout(cfg: Any, p: torch.Tensor, paged: bool = False) -> list[StateTensor]:
    shape, n = tuple(p.shape), p.numel()
    where = "paged" if paged and p.device.type != "cpu" and n >= PAGED_MIN_NUMEL else "param"
    if n < int(cfg.min_8bit_size):
        return [StateTensor("state1", shape, torch.float32, where), StateTensor("state2", shape, torch.float32, where)]
    blocks = math.ceil(n / BNB_BLOCKSIZE)
    return [
        StateTensor("state1", shape, torch.uint8, where),
        StateTensor("qmap1", (256,), torch.float32, shared="dynamic"),
        StateTensor("state2", shape, torch.uint8, where),
        StateTensor("qmap2", (256,), torch.float32, shared="udynamic"),
        StateTensor("absmax1", (blocks,), torch.float32),
        StateTensor("absmax2", (blocks,), torch.float32),
    ]


def _upcast(p: torch.Tensor) -> torch.dtype:
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype  # Adafactor, CAME: grads upcast


def _prodigy_layout(cfg: Any, p: torch.Tensor) -> list[StateTensor]:
    sliced = (math.ceil(p.numel() / int(cfg.slice_p)),)  # p.flatten()[::slice_p]
    out = [StateTensor("s", sliced, p.dtype), StateTensor("p0", sliced, p.dtype)]
    if float(cfg.betas[0]) > 0:
        out.append(StateTensor("exp_avg", tuple(p.shape), p.dtype))
    out.append(StateTensor("exp_avg_sq", tuple(p.shape), p.dtype))
    return out  # "step" is a Python int


def _schedulefree_layout(cfg: Any, p: torch.Tensor) -> list[StateTensor]:
    return [StateTensor("z", tuple(p.shape), p.dtype), StateTensor("exp_avg_sq", tuple(p.shape), p.dtype)]


def _lion_layout(cfg: Any, p: torch.Tensor, eight_bit: bool = False) -> list[StateTensor]:
    shape, n = tuple(p.shape), p.numel()
    if not eight_bit or n < int(cfg.min_8bit_size):
        return [StateTensor("state1", shape, torch.float32)]  # bitsandbytes' 32-bit state, whatever the weights' dtype
    return [
        StateTensor("state1", shape, torch.uint8),
        StateTensor("qmap1", (256,), torch.float32, shared="dynamic"),
        StateTensor("absmax1", (math.ceil(n / BNB_BLOCKSIZE),), torch.float32),
    ]


def _came_layout(cfg: Any, p: torch.Tensor) -> list[StateTensor]:
    shape, dtype = tuple(p.shape), _upcast(p)
    out = [StateTensor("exp_avg", shape, dtype)]
    if len(shape) >= 2:
        row, col = shape[:-1], shape[:-2] + shape[-1:]
        out += [StateTensor("exp_avg_sq_row", row, dtype), StateTensor("exp_avg_sq_col", col, dtype),
                StateTensor("exp_avg_res_row", row, dtype), StateTensor("exp_avg_res_col", col, dtype)]
    else:
        out.append(StateTensor("exp_avg_sq", shape, dtype))
    out.append(StateTensor("RMS", (), p.dtype))  # the weights' RMS, computed from p itself (not upcast)
    return out


def _adafactor_layout(cfg: Any, p: torch.Tensor) -> list[StateTensor]:
    shape = tuple(p.shape)
    dtype = _upcast(p)
    out = []
    if cfg.beta1 is not None:
        out.append(StateTensor("exp_avg", shape, dtype))
    if len(shape) >= 2:
        out.append(StateTensor("exp_avg_sq_row", shape[:-1], dtype))
        out.append(StateTensor("exp_avg_sq_col", shape[:-2] + shape[-1:], dtype))
    else:
        out.append(StateTensor("exp_avg_sq", shape, dtype))
    out.append(StateTensor("RMS", (), dtype))
    return out
