"""The EMA copy in sharded checkpoints, and either checkpoint format into either kind of run.

Under ``dist=fsdp`` each rank keeps the EMA of its own shards (runner/ema/average.py). A checkpoint
of such a run keeps the copy sharded too: :meth:`EMA.shards` views each rank's shard as a DTensor
placed like its parameter, and runner/distributed/checkpoint.py:save_sharded writes them into the same DCP
folder as the weights (key ``ema``; every rank its own shards, nothing gathered), while rank 0
writes ``ema.json`` (names, global shapes, the update count and settings: what ``ema.safetensors``
keeps in its metadata).

Resume, the same table as the weights' (runner/distributed/checkpoint.py):

* ``ema.safetensors`` into whole parameters: copied; into FSDP shards: each rank reads the file
  and keeps its shard (``distribute_tensor`` with ``src_data_rank=None``: the same chunking as
  FSDP2's dim-0 shards, and no communication, since every rank holds the whole tensor);
* a sharded checkpoint's EMA into FSDP shards: DCP re-splits it for this world size; into whole
  parameters (one process, DDP, ``mode=export``): DCP reads whole tensors.

The DCP targets are in the saved dtype and cast into the copy after, so a resume may change
``ema.dtype`` as with ``ema.safetensors``. Trade-off: a full checkpoint into FSDP reads the whole
file on every rank (host RAM of one EMA copy per rank while it loads), as the weights do.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from runner.ema.files import FILE, SHARDED_META, is_sharded_param, local, read_ema_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def placed_like(shard: torch.Tensor, param: torch.Tensor) -> Any:
    """``shard`` (this rank's part of the copy) as a DTensor with ``param``'s mesh, placements and global
    shape: a view, no copy (DCP writes it as this rank's shard of the whole tensor)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(shard, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def write_sharded_meta(ema: Any, path: Path) -> list[str]:
    """Rank 0's ``ema.json`` of a sharded checkpoint; the files written."""
    shapes = {n: list(p.shape) for n, p in zip(ema.names, ema.params)}
    path.write_text(json.dumps({"metadata": ema.metadata(), "shapes": shapes}, indent=1))
    return [path.name]


def read_saved_ema(ckpt: Path) -> tuple[Path, dict[str, tuple[int, ...]], dict[str, str], Any] | None:
    """(the file that describes ``ckpt``'s EMA, its tensors' global shapes, its metadata, the tensors of
    ``ema.safetensors`` or None for a sharded checkpoint's, read later by :func:`load_into`); None without one."""
    if (ckpt / FILE).is_file():
        tensors, meta = read_ema_file(ckpt / FILE)
        return ckpt / FILE, {n: tuple(t.shape) for n, t in tensors.items()}, meta, tensors
    if (ckpt / SHARDED_META).is_file():
        from runner.errors import UserError

        try:
            info = json.loads((ckpt / SHARDED_META).read_text())
            shapes = {n: tuple(s) for n, s in info["shapes"].items()}
            return ckpt / SHARDED_META, shapes, dict(info["metadata"]), None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"Checkpoint file {ckpt / SHARDED_META} is corrupt ({type(e).__name__}: {e}). Resume from "
                            "an earlier checkpoint, or set ema.enabled=false to resume without the average.") from None
    return None


@torch.no_grad()
def load_into(ema: Any, ckpt: Path, meta: dict[str, str], tensors: dict[str, torch.Tensor] | None) -> None:
    """Copy ``ckpt``'s EMA (checked against ``ema`` already) into ``ema``'s copy: ``tensors`` (of
    ``ema.safetensors``), or the sharded checkpoint's, read now."""
    if tensors is not None:
        for n, s, p in zip(ema.names, ema.shadow, ema.params):
            s.copy_(local_part(tensors.pop(n), p))
        return
    saved = DTYPES.get(str(meta.get("dtype", "float32")), torch.float32)
    for n, loaded in read_sharded(ckpt, ema.names, ema.params, saved).items():
        ema.shadow[ema.names.index(n)].copy_(local(loaded))


def local_part(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full`` when ``param`` is sharded (FSDP2's dim-0 chunking), else ``full``."""
    if not is_sharded_param(param):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


def read_sharded(ckpt: Path, names: list[str], params: list[torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """The EMA tensors of the sharded checkpoint ``ckpt`` in ``dtype``: this rank's shards (DTensors) for
    sharded ``params`` (a collective read), whole tensors on the host for whole ones (read by this process alone)."""
    import torch.distributed.checkpoint as dcp

    from runner.distributed.checkpoint import EMA_KEY
    from runner.state.checkpoint import SHARDED
    from runner.errors import UserError

    target: dict[str, Any] = {}
    for n, p in zip(names, params):
        if is_sharded_param(p):
            target[n] = placed_like(torch.empty(local(p).shape, dtype=dtype, device=local(p).device), p)
        else:
            target[n] = torch.empty(p.shape, dtype=dtype, device="cpu")
    # whole tensors: this process reads alone (mode=export on rank 0 beside a group, DDP, one process)
    alone = not any(is_sharded_param(p) for p in params)
    try:
        dcp.load({EMA_KEY: target}, checkpoint_id=str(ckpt / SHARDED), no_dist=alone)
    except Exception as e:  # noqa: BLE001 - DCP's own errors name keys; make them one paragraph
        raise UserError(f"The EMA in checkpoint {ckpt / SHARDED} could not be read ({type(e).__name__}: "
                        f"{(str(e).strip().splitlines() or [''])[0]}). Resume from another checkpoint, or set "
                        "ema.enabled=false to resume without the average.") from None
    return target
