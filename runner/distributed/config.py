"""``dist=none|ddp|fsdp``: the config group, its checks, and what the resolved run records of it.

The group's options are dataclass schemas (Hydra checks types and keys when it composes), stored
at ``dist`` like any other group; ``python -m runner --help`` lists them and ``mode=plugins`` prints
them with their defaults. :func:`resolve_distribution` turns the node plus the process's launch
environment (runner/distributed/launch.py) into the :class:`DistSpec` that ``ResolvedRun.dist`` holds:
the choice, the world size and this process's rank, decided once. Nothing else reads
``WORLD_SIZE`` or ``cfg.dist``.

Precision. ``dist.mixed_precision`` (default true): under a bf16/fp16 autocast with float32 trained
weights, FSDP2 all-gathers each unit in the autocast dtype from float32 shards and reduce-scatters
gradients in float32 (``MixedPrecisionPolicy``; decided once as ``ResolvedRun.fsdp_param_dtype``,
runner/resolved.py). false: float32 gathers, and autocast keeps a bf16 copy of every weight it casts
until the forward ends.

World size. Training: the launcher's (``torchrun``/``accelerate launch``/a SLURM job's tasks);
``dist.world_size``, when set, must equal it (a guard against launching the wrong number of
processes). ``mode=plan``: ``dist.world_size`` (default: the launcher's, else 1) is the number of
ranks the plan is for; the plan is one rank's.

Links. ``dist.interconnect`` (between one node's GPUs; null: the device's ``link`` in
conf/devices.yaml), ``dist.inter_node_interconnect`` and ``dist.ranks_per_node`` (null: the launcher's
LOCAL_WORLD_SIZE; ``mode=plan``: min(world_size, 8)) price the step's collectives in the plan's s/step
(runner/plan/comm.py); nothing in training reads them. An unknown link name is refused with the valid ones.
Ranks per node: also the ranks sharing one machine's host RAM, for the plan's host RAM
per node (runner/plan/dist.py); ``hybrid_shard`` shards within that many ranks (a plan of it needs the
key set: the shard group is not guessed).

Combinations refused before anything is built, each naming both sides:

* ``dist=none`` under a launcher with more than one process (each process would train the whole
  batch on its own and all would write the same files);
* ``dist=fsdp`` with ``offload=stream`` (a streamed block's weights are host tensors copied in
  per call; FSDP shards the same weights and all-gathers them itself), with ``offload=optimizer``
  (the host optimizer keeps its own full master copies; ``dist.cpu_offload=true`` is FSDP's own way
  to keep sharded weights, gradients and the optimizer step on the host), and with optimizers
  other than AdamW (bitsandbytes' 8-bit kernels and transformers' Adafactor take plain tensors,
  not FSDP's DTensor shards);
* any ``dist`` with ``offload.optimizer.offload_gradients=true`` or ``implementation=torchao``
  (gradients leave the device during backward, before ranks have averaged them), and
  ``dist=ddp`` with ``offload=stream`` (streamed weights and gradients live on the host, outside
  DDP's buckets; FSDP's ``dist.cpu_offload`` is the multi-GPU way to keep weights on the host);
* a global batch that does not split evenly: ``train.batch_size`` must be a multiple of
  ``world_size x train.grad_accum`` (every rank takes the same share, so the averaged gradient is
  the one-process gradient of the global batch).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from runner.errors import UserError, valid_list
from runner.world import CHOICES, DistSpec, dist_node, resolve_distribution  # noqa: F401 (callers take them from here)

log = logging.getLogger("runner")

SHARDING_STRATEGIES = ("full_shard", "hybrid_shard")
# Optimizers whose step runs on FSDP's sharded parameters (DTensors): torch's AdamW. bitsandbytes'
# 8-bit kernels take plain tensors; transformers' Adafactor mixes DTensors with plain tensors in its
# update (torch 2.13: "aten.add_.Tensor got mixed torch.Tensor and DTensor").
FSDP_OPTIMIZERS = ("adamw",)


@dataclass
class NoDistConfig:
    """``dist=none``: one process (the default)."""

    name: str = "none"
    world_size: Optional[int] = None  # must stay 1 (or unset); ddp/fsdp use more


@dataclass
class DDPConfig:
    """``dist=ddp``: every rank holds the whole model; gradients are averaged across ranks (torch DDP)."""

    name: str = "ddp"
    world_size: Optional[int] = None  # processes; null: the launcher's (WORLD_SIZE); mode=plan: ranks to plan for
    bucket_mb: float = 25.0  # size of DDP's gradient all-reduce buckets (MiB)
    ranks_per_node: Optional[int] = None  # GPUs per node; null: the launcher's LOCAL_WORLD_SIZE (mode=plan: min(world_size, 8))
    interconnect: Optional[str] = None  # link between one node's GPUs (conf/devices.yaml interconnects); null: the device's
    inter_node_interconnect: str = "ib_100"  # link between nodes, when world_size > ranks_per_node (conf/devices.yaml)


@dataclass
class FSDPConfig:
    """``dist=fsdp``: FSDP2 (``fully_shard``): the trained module's weights, gradients and optimizer
    state are split across ranks; each block's weights are all-gathered just for its forward/backward."""

    name: str = "fsdp"
    world_size: Optional[int] = None  # processes; null: the launcher's (WORLD_SIZE); mode=plan: ranks to plan for
    # full_shard: over every rank | hybrid_shard: within a node, replicated across nodes
    sharding_strategy: str = "full_shard"
    # GPUs per node (hybrid_shard's shard group; where the ring crosses nodes); null: the launcher's LOCAL_WORLD_SIZE,
    # mode=plan: min(world_size, 8) (hybrid_shard in mode=plan: required, it decides what each rank holds)
    ranks_per_node: Optional[int] = None
    interconnect: Optional[str] = None  # link between one node's GPUs (conf/devices.yaml interconnects); null: the device's
    inter_node_interconnect: str = "ib_100"  # link between nodes, when world_size > ranks_per_node (conf/devices.yaml)
    reshard_after_forward: bool = True  # free a block's gathered weights after its forward (gather again in backward)
    cpu_offload: bool = False  # sharded weights, gradients and the optimizer step on the host (FSDP2 CPUOffloadPolicy)
    # With bf16/fp16 autocast and float32 trained weights: each unit all-gathered in the autocast dtype from
    # float32 shards, gradients reduce-scattered in float32 (FSDP2 MixedPrecisionPolicy); false: gathered in
    # float32 and cast by autocast, which caches a low-precision copy of every weight through the forward
    mixed_precision: bool = True


OPTIONS = {"none": NoDistConfig, "ddp": DDPConfig, "fsdp": FSDPConfig}


def store_dist_schemas() -> None:
    """``dist=none|ddp|fsdp`` as a Hydra group (package ``dist``)."""
    cs = ConfigStore.instance()
    for name, cls in OPTIONS.items():
        cs.store(group="dist", name=name, node=cls(), package="dist")


def describe_options() -> list[str]:
    """Lines for ``mode=plugins``: each option and its keys with defaults."""
    from runner.registry import describe_config

    lines = ["Distribution (select with dist=<name>; launch with torchrun, accelerate launch or a SLURM sweep):"]
    for name, cls in OPTIONS.items():
        lines.append(f"  {name:<12} {(cls.__doc__ or '').strip().splitlines()[0]}")
        for fname, ftype, default in describe_config(cls):
            lines.append(f"      dist.{fname}: {ftype} = {default!r}")
    return lines


def validate_dist(cfg: Any, spec: DistSpec) -> None:
    """Value checks and refused combinations (module docstring), before anything is built: every
    conflict at once, so a command that breaks three rules is not refused three times."""
    problems = _dist_problems(cfg, spec)
    if len(problems) == 1:
        raise UserError(problems[0])
    if problems:
        raise UserError(f"{len(problems)} settings cannot be combined with dist={spec.name} as given; all of them:\n"
                        + "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1)))


def _dist_problems(cfg: Any, spec: DistSpec) -> list[str]:
    """Every refusal of :func:`validate_dist`, in the order they were checked one by one before."""
    problems: list[str] = []
    node = dist_node(cfg)
    get = (lambda k, d: node.get(k, d)) if hasattr(node, "get") else (lambda k, d: getattr(node, k, d))
    if spec.name == "fsdp":
        strategy = str(get("sharding_strategy", "full_shard"))
        if strategy not in SHARDING_STRATEGIES:
            problems.append(f"dist.sharding_strategy={strategy!r} is not valid. "
                            f"Valid values: {valid_list(strategy, SHARDING_STRATEGIES)}.")
    if spec.name != "none":
        problems += _link_problems(get, spec)
    if spec.name == "ddp" and float(get("bucket_mb", 25.0)) <= 0:
        problems.append(f"dist.bucket_mb={get('bucket_mb', 25.0)!r} is not valid: it must be a number > 0 (MiB).")
    if spec.world_size <= 1 or spec.name == "none":
        return problems
    train = cfg.train
    share = spec.world_size * int(train.grad_accum)
    if int(train.batch_size) % share:
        problems.append(
            f"train.batch_size={train.batch_size} does not split evenly over {spec.world_size} ranks x "
            f"train.grad_accum={train.grad_accum}: every rank takes the same share of each step's global batch. "
            f"Use a multiple of {share} (e.g. train.batch_size={share * max(1, int(train.batch_size) // share)}), "
            "or change train.grad_accum.")
    offload = cfg.get("offload") or {}
    opt_offload = offload.get("optimizer") if hasattr(offload, "get") else None
    if opt_offload is not None and bool(opt_offload.get("offload_gradients", False)):
        problems.append(
            f"dist={spec.name} and offload.optimizer.offload_gradients=true cannot be combined: gradients would leave "
            "the device during backward, before the ranks have averaged them. Set "
            "offload.optimizer.offload_gradients=false (the optimizer step stays on the host).")
    if opt_offload is not None and str(opt_offload.get("implementation", "auto")) == "torchao":
        problems.append(
            f"dist={spec.name} and offload.optimizer.implementation=torchao cannot be combined: torchao copies each "
            "gradient to the host during backward, before the ranks have averaged them. Use "
            "offload.optimizer.implementation=builtin (or auto, which picks it with several processes).")
    if "stream" in offload and spec.name == "fsdp":
        problems.append(
            "dist=fsdp and offload=stream cannot be combined: offload=stream copies each block's weights in from "
            "host memory per call, while FSDP shards the same weights across ranks and all-gathers them itself. "
            "Use dist=fsdp dist.cpu_offload=true (sharded weights on the host): each GPU then holds only the "
            "blocks being computed.")
    elif "stream" in offload:
        problems.append(
            "dist=ddp and offload=stream cannot be combined yet: a streamed block's weights (and, in a full "
            "fine-tune, its gradients) live in host memory outside their calls, where DDP's gradient buckets cannot "
            "average them. Use dist=fsdp dist.cpu_offload=true, which keeps the shards on the host the same way.")
    if spec.name != "fsdp":
        return problems
    if opt_offload is not None:
        problems.append(
            "dist=fsdp and offload=optimizer cannot be combined: offload=optimizer keeps full host copies of the "
            "weights it steps, FSDP keeps them sharded across ranks. Use dist.cpu_offload=true (FSDP steps its "
            "sharded weights on the host), or dist=ddp with offload=optimizer.")
    optimizer = str(cfg.optimizer.get("name", "adamw"))
    if optimizer not in FSDP_OPTIMIZERS:
        whole = ", not FSDP's sharded parameters"
        why = {"lion": "bitsandbytes' kernels take whole tensors" + whole,
               "prodigy": "its step-size sums read each parameter whole (and its FSDP mode is FSDP1's flat parameters)",
               "came": "its factored moments need each matrix's whole rows and columns",
               "adamw_schedulefree": "its step and train/eval switches have been tested on whole parameters only"}.get(
            optimizer, "bitsandbytes' 8-bit kernels take whole tensors" + whole if "8bit" in optimizer else
            "its update mixes FSDP's sharded parameters with plain tensors, which torch refuses")
        problems.append(
            f"dist=fsdp and optimizer={optimizer} cannot be combined: {why}. Use "
            "optimizer=adamw (its state is sharded too; model.train_dtype=bfloat16 halves it), or dist=ddp with "
            f"optimizer={optimizer}.")
    return problems


def _link_problems(get: Any, spec: DistSpec) -> list[str]:
    """``dist.ranks_per_node`` and the interconnect names (conf/devices.yaml, runner/devices.py)."""
    from runner.devices import link_spec

    problems: list[str] = []
    if spec.ranks_per_node < 1:
        problems.append(f"dist.ranks_per_node={spec.ranks_per_node} is not valid: give the GPUs of one node (>= 1), "
                        "or leave it unset (the launcher's LOCAL_WORLD_SIZE; mode=plan: min(world_size, 8)).")
    for key, value in (("dist.interconnect", spec.interconnect), ("dist.inter_node_interconnect",
                                                                   spec.inter_node_interconnect)):
        if value:
            try:
                link_spec(value, key)
            except UserError as e:
                problems.append(str(e))
    return problems
