"""``train.compile`` / ``train.compile_mode``: what may be compiled, checked before anything is built (no torch).

Regional compilation (runner/compile/regional.py) compiles each repeated block's ``forward`` once
per block class and reuses the graph for every instance, as diffusers' ``compile_repeated_blocks``
does: seconds of compilation instead of minutes for the whole model, and the same kernels.
The combinations refused here are the ones it cannot do, each with its reason.
"""
from __future__ import annotations

from typing import Any

from runner.errors import UserError

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
"""torch.compile modes that suit a training step. ``reduce-overhead``/``max-autotune`` capture CUDA
graphs, which need static memory addresses: refused (offload and checkpointing move tensors)."""


def check_compile_config(cfg: Any) -> None:
    """``train.compile`` and ``train.compile_mode`` are valid, and the run can compile its blocks."""
    train = cfg.train
    mode = str(train.get("compile_mode", "default"))
    if mode not in COMPILE_MODES:
        why = (" (it captures CUDA graphs, which need tensors at fixed addresses: offload, checkpointing "
               "and the caching allocator's reuse move them)") if mode in ("reduce-overhead", "max-autotune") else ""
        raise UserError(f"train.compile_mode={mode!r} is not valid{why}. Valid modes: {', '.join(COMPILE_MODES)}.")
    if not train.get("compile", False):
        return
    dist = cfg.get("dist") or {}
    if str(dist.get("name", "none")) == "fsdp":
        raise UserError(
            "train.compile=true with dist=fsdp is not supported yet: FSDP2 must shard each block after it is "
            "compiled, and that order is not built or tested here. Use dist=ddp (each rank compiles its own "
            "blocks) or train.compile=false.")
