"""The EMA's file names and readers, shared by the whole-copy (runner/ema/average.py) and the sharded
(runner/ema/shards.py) checkpoint formats."""
from __future__ import annotations

from pathlib import Path

import torch

from runner.errors import UserError

FILE = "ema.safetensors"
SHARDED_META = "ema.json"  # a sharded checkpoint's EMA: names, shapes and metadata (the tensors are in its DCP folder)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter (a DTensor), or the tensor itself."""
    return t.to_local() if is_sharded_param(t) else t


def is_sharded_param(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def read_ema_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of an ``ema.safetensors``; a UserError naming the file when it is corrupt."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise UserError(f"Checkpoint file {path} is corrupt (the EMA weights could not be read: "
                        f"{(str(e).splitlines() or [type(e).__name__])[0]}). Resume from an earlier checkpoint, or "
                        "set ema.enabled=false to resume without the average.") from None
