"""Several processes training one run: ``dist=none|ddp|fsdp``.

The engines are torch.distributed's (DDP, FSDP2's ``fully_shard``, ``torch.distributed.checkpoint``)
driven through accelerate's state, and the launchers are the ecosystem's (``torchrun``,
``accelerate launch``, hydra-submitit-launcher for SLURM); nothing here starts a process.

* ``config``: the config group, its checks and :class:`DistSpec` (``ResolvedRun.dist``);
* ``launch``: the launch environment, the process group, one run directory, rank-0-only output;
* ``runtime``: :class:`Distribution`, the loop's side: each rank's shard of the global batch,
  wrapping the trained modules, averaged gradients and losses, agreement on out-of-memory
  retries, the encoder cache filled by rank 0 first;
* ``agree``: how ranks agree on an out-of-memory retry without waiting on each other forever;
* ``checkpoint``: a full checkpoint written by rank 0 (DDP) or a sharded one through
  ``torch.distributed.checkpoint`` (FSDP), and resume across both and across world sizes;
* ``plan``: the per-rank plan (``mode=plan dist=fsdp dist.world_size=N``).
"""
from runner.distributed.config import DistSpec, describe_options, resolve_distribution, store_dist_schemas, validate_dist

__all__ = ["DistSpec", "describe_options", "resolve_distribution", "store_dist_schemas", "validate_dist"]
