"""The processes of one run: the launcher's world (from the environment) and the distribution the
resolved run records (``ResolvedRun.dist``), decided once. The ``dist`` schemas and their checks are in
runner/distributed/config.py; joining the process group is runner/distributed/launch.py.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from runner.errors import UserError, valid_list

CHOICES = ("none", "ddp", "fsdp")


@dataclass(frozen=True)
class ProcessWorld:
    """The processes this one was launched with (1 when launched alone)."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "none"  # torchrun (also accelerate launch) | submitit | none

    def describe(self) -> str:
        if self.world_size == 1:
            return "launched as one process"
        return f"launched by {self.launcher} as {self.world_size} processes ({self.local_world_size} on this node)"


def _adopt_submitit() -> None:
    """A SLURM (or submitit local) job with several tasks: export torch's env:// variables from
    submitit's job environment, once. Single-task jobs and other processes are left alone."""
    if "WORLD_SIZE" in os.environ or "SUBMITIT_EXECUTOR" not in os.environ:
        return
    try:
        from submitit import JobEnvironment
        from submitit.helpers import TorchDistributedEnvironment
    except ImportError:  # a job environment without submitit importable cannot be a submitit job
        return
    if JobEnvironment().num_tasks > 1:
        # CUDA_VISIBLE_DEVICES is left as SLURM set it: the runner picks cuda:LOCAL_RANK itself.
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        os.environ["RUNNER_LAUNCHER"] = "submitit"


def process_world() -> ProcessWorld:
    """This process's place among the processes launched together (from the environment)."""
    _adopt_submitit()
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return ProcessWorld()
    launcher = env.get("RUNNER_LAUNCHER") or ("accelerate launch" if "ACCELERATE_DYNAMO_BACKEND" in env
                                              or "ACCELERATE_MIXED_PRECISION" in env else "torchrun")
    return ProcessWorld(world_size=world, rank=int(env.get("RANK", "0")), local_rank=int(env.get("LOCAL_RANK", "0")),
                        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))), launcher=launcher)


@dataclass(frozen=True)
class DistSpec:
    """What the run distributes, decided once (``ResolvedRun.dist``)."""

    name: str = "none"  # none | ddp | fsdp, as configured
    world_size: int = 1  # processes training together (planned ranks in mode=plan)
    rank: int = 0  # this process (0 in a plan: every rank plans the same)
    local_rank: int = 0  # this process's index on its node (its GPU)
    shard_size: int = 1  # fsdp: ranks one copy of the weights is split over (world_size, or a node's ranks)
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    bucket_mb: float = 25.0
    mixed_precision: bool = True  # fsdp: MixedPrecisionPolicy when autocast is low-precision (runner/resolved.py)
    ranks_per_node: int = 1  # GPUs per node: ranks beyond it talk over the inter-node link (runner/plan/comm.py); the plan's host RAM per node (runner/plan/dist.py)
    interconnect: str = ""  # conf/devices.yaml interconnects row between one node's GPUs; "": the device's link
    inter_node_interconnect: str = "ib_100"  # the row between nodes

    @property
    def nodes(self) -> int:
        """Nodes the ranks span (the last one may be partly used)."""
        return -(-self.world_size // max(self.ranks_per_node, 1))

    @property
    def active(self) -> bool:
        """More than one process and a distribution chosen: collectives run."""
        return self.world_size > 1 and self.name != "none"

    @property
    def sharded(self) -> bool:
        return self.active and self.name == "fsdp"

    @property
    def is_main(self) -> bool:
        """The rank that writes the run's files (rank 0)."""
        return self.rank == 0

    def describe(self) -> str:
        if not self.active:
            return "one process"
        what = {"ddp": "DDP (replicated weights, averaged gradients)",
                "fsdp": f"FSDP2 (sharded over {self.shard_size} rank{'s' if self.shard_size != 1 else ''}"
                        + (f", replicated {self.world_size // self.shard_size} times" if self.shard_size < self.world_size
                           else "")
                        + (", weights on the host" if self.cpu_offload else "")
                        + ("" if self.reshard_after_forward else ", gathered weights kept from forward to backward")
                        + ")"}[self.name]
        return f"rank {self.rank} of {self.world_size}, {what}"


def dist_node(cfg: Any) -> Any:
    node = cfg.get("dist") if hasattr(cfg, "get") else None
    return node if node is not None else {}  # dist unset: one process


def resolve_distribution(cfg: Any, planning: bool) -> DistSpec:
    """The :class:`DistSpec` of ``cfg`` in this process (see the module docstring). UserError on a
    mismatch between the config and the launch."""
    node = dist_node(cfg)
    name = str(node.get("name", "none")) if hasattr(node, "get") else node.name
    if name not in CHOICES:
        raise UserError(f"dist={name!r} is not valid. Valid values: {valid_list(name, CHOICES)}.")
    want = node.get("world_size") if hasattr(node, "get") else node.world_size
    world = process_world()
    if want is not None and int(want) < 1:
        raise UserError(f"dist.world_size={want} is not valid: give the number of processes (>= 1), or leave it unset.")
    if planning:
        size = int(want) if want is not None else world.world_size
        rank, local = 0, 0
    else:
        size, rank, local = world.world_size, world.rank, world.local_rank
        if want is not None and int(want) != size:
            raise UserError(
                f"dist.world_size={want}, but this run was launched with {size} process{'es' if size > 1 else ''} "
                f"({world.describe()}). Launch {want} processes (torchrun --nproc_per_node={want} -m runner ..., or "
                "accelerate launch --num_processes ...), or drop dist.world_size to take the launcher's.")
    if name == "none" and size > 1:
        raise UserError(
            f"{'dist.world_size=' + str(size) if planning else world.describe()} but dist=none: each process would "
            "train the whole batch on its own and all would write the same files. Add dist=ddp (replicated weights) "
            "or dist=fsdp (sharded weights), or run one process.")
    get = (lambda k, d: node.get(k, d)) if hasattr(node, "get") else (lambda k, d: getattr(node, k, d))
    shard = size
    if name == "fsdp" and str(get("sharding_strategy", "full_shard")) == "hybrid_shard":
        per_node = get("ranks_per_node", None)
        per_node = int(per_node) if per_node is not None else (None if planning else world.local_world_size)
        if per_node is None:
            raise UserError("dist.sharding_strategy=hybrid_shard in mode=plan needs dist.ranks_per_node (the GPUs "
                            "of one node, which one copy of the weights is sharded over).")
        if per_node < 1 or size % per_node:
            raise UserError(f"dist.ranks_per_node={per_node} must divide the world size {size} "
                            "(hybrid_shard shards within each node and replicates across nodes).")
        shard = per_node
    return DistSpec(name=name, world_size=size, rank=rank, local_rank=local, shard_size=shard,
                    ranks_per_node=_ranks_per_node(get("ranks_per_node", None), size, planning, world),
                    reshard_after_forward=bool(get("reshard_after_forward", True)),
                    cpu_offload=bool(get("cpu_offload", False)), bucket_mb=float(get("bucket_mb", 25.0)),
                    mixed_precision=bool(get("mixed_precision", True)),
                    interconnect=str(get("interconnect", None) or ""),
                    inter_node_interconnect=str(get("inter_node_interconnect", "ib_100") or "ib_100"))


def _ranks_per_node(given: Any, size: int, planning: bool, world: Any) -> int:
    """``dist.ranks_per_node``: as given; null: ``min(world_size, 8)`` in a plan (8 GPUs a node), the
    launcher's ``LOCAL_WORLD_SIZE`` in training. (``hybrid_shard`` takes its shard group from it too,
    and in a plan refuses to guess it: above.)"""
    if given is not None:
        if int(given) < 1:
            raise UserError(f"dist.ranks_per_node={given} is not valid: give the ranks (GPUs) of one node, >= 1.")
        return min(int(given), size)
    return min(size, 8) if planning else max(1, min(size, int(world.local_world_size)))
