"""The planner's side of a base read layer by layer as it is quantized (runner/meta_weights.py).

When a run loads the trained module's base that way (runner/distributed/loading.py ``load_mode``
``quantized``: one process, and every rank under ``dist=fsdp``), the simulation does what the run
does: the base's parameters stay on plain ``meta`` (not faked, not counted), ``ModelSet.unread``
carries an :class:`~runner.meta_weights.UnreadWeights` whose read makes a fake host tensor of the
stored shape and dtype (from the safetensors headers; nothing else of the files is read), and the
quantization plugin and the runner read through it at the same points as in a run. So the setup's
host peak is the quantized base plus one tensor in flight (and its conversion to ``model.dtype``),
simulated, not corrected afterwards; the per-rank figures (runner/plan/dist.py) follow with no
term of their own.
"""
from __future__ import annotations

from typing import Any

import torch

# safetensors' dtype names (the header's "dtype" field) -> torch
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def stored_layout(files: dict[str, tuple[str, str]]) -> dict[tuple[str, str], tuple[tuple[int, ...], torch.dtype]]:
    """(file, key) -> (shape, dtype) of every tensor ``files`` names, from the files' headers."""
    from safetensors import safe_open

    out: dict[tuple[str, str], tuple[tuple[int, ...], torch.dtype]] = {}
    for file in sorted({f for f, _ in files.values()}):
        with safe_open(file, framework="pt", device="cpu") as f:
            keys = f.keys()  # a safe_open handle is not iterable
            for key in keys:
                part = f.get_slice(key)
                out[(file, key)] = (tuple(part.get_shape()), _DTYPES[part.get_dtype()])
    return out


def leave_unread(models: Any, trainer: Any, load: tuple[str, str], host: torch.device) -> set[int]:
    """For load ``quantized``: the ids of the trained module's parameters left unread (on meta), with
    ``models.unread`` set up to make them as fake tensors on ``host`` when read; empty otherwise."""
    if load[0] != "quantized":
        return set()
    from runner.meta_weights import UnreadWeights

    name = trainer.denoiser
    files = trainer.weight_files(name)
    layout = stored_layout(files)

    def read(file: str, key: str) -> torch.Tensor:
        shape, dtype = layout[(file, key)]
        return torch.empty(shape, dtype=dtype, device=host)  # under the simulation's fake mode: a fake tensor

    models.unread[name] = UnreadWeights(files, read=read)
    return {id(p) for p in models[name].parameters() if not p.requires_grad}


def load_note(trainer: Any, cfg: Any, train_mode: str, load: tuple[str, str]) -> dict[str, str]:
    """The plan's note ``base load``: how a quantized LoRA base reaches the host (read layer by layer,
    or whole first and why: random init, DoRA ...), for a LoRA run with a quantization plugin on its
    base; no note otherwise."""
    from runner.distributed.loading import quantizers

    builtin = callable(getattr(trainer, "weight_files", None)) and hasattr(trainer, "empty_modules")
    if str(train_mode) == "full" or not builtin or not quantizers(trainer, cfg):
        return {}
    return {"base load": f"{trainer.denoiser}'s base: {load[1]}"}
