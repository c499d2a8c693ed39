"""One rank's plan: ``mode=plan dist=ddp|fsdp dist.world_size=N`` (and a multi-process run's preflight).

How it is made. The planner simulates one step of *one rank* with fake tensors: the micro-batch
is the rank's (``ResolvedRun.micro_batch`` = batch / world / grad_accum), so activations,
batches, encoders and every plugin are simulated as on that rank. What the simulation cannot
see is what the distribution adds or removes, so each phase's peak is then corrected from unit
sizes the planner measures on the simulated models (every parameter's shape and dtype, each
FSDP unit's members: the repeated blocks of runner/blocks.py, as runner/distributed/runtime.py shards
them, and the rest of the module as the root unit). Why computed and not simulated: FSDP2 needs
a process group of N ranks (in a training run's preflight the real group is already in use), and
it frees and re-allocates its gathered weights by resizing storages, which the simulation's
dispatch mode does not see (the live-bytes tracker of a real run follows them). The terms, per rank:

``dist=fsdp`` (trained module ``m``; ``shard(x)``: FSDP2's dim-0 shard, padded to a multiple of
the shard group, bytes exact per parameter)

* weights of ``m``: ``shard(weights)`` instead of all of them; quantized weights (nf4, int8,
  fp8), which stay whole, count whole;
* all-gather buffers (row ``(fsdp all-gather)``): at setup, the largest unit (or the root's rest)
  whole, moved to the device by ``fully_shard`` before it keeps a shard; the root unit's weights,
  gathered for the whole forward and backward (FSDP2 does not reshard the root after forward); in forward the
  largest unit twice (its gathered weights and the all-gather output they are copied from);
  in backward the largest unit three times (the unit computing, the next one prefetched, and its
  all-gather output). ``dist.reshard_after_forward=false`` keeps every unit gathered from its
  forward to its backward: the whole module instead;
* gradients of ``m``: ``shard(gradients)``, plus in backward (row ``(fsdp reduce-scatter)``) the
  largest unit's unsharded gradients and the reduce-scatter input they are copied into;
* optimizer state of ``m``: its share, ``shard(trainable) / trainable`` of it; the EMA copy of ``m``
  (``ema.enabled``, category ``ema``) the same share: each rank keeps the EMA of its own shards
  (runner/ema/average.py), on the device or the host wherever the one-process copy was;
* ``dist.cpu_offload=true``: sharded weights, gradients, optimizer state (and an EMA kept beside the
  weights, ``ema.device=device``) are on the host
  (added to the host figures), only the gathered copies and reduce-scatter buffers on the device;
* mixed precision (``ResolvedRun.fsdp_param_dtype``: bf16/fp16 autocast, float32 trained weights,
  FSDP2's ``MixedPrecisionPolicy``, runner/distributed/runtime.py): every gathered byte above is counted in
  the autocast dtype (a float32 unit is gathered at half its size), the unit's unsharded gradients
  too, and the reduce-scatter input in float32; the shards, their gradients and the optimizer state
  stay float32. The weights reach the unit's ops already in bf16, so no op casts them and autocast
  caches no copy: the simulation's casts of these weights (runner/memory/semantics.py) are neither
  cached nor counted (``LiveBytesTracker.uncounted``), since the gathered copy they stand for is
  the window above, one unit at a time. Without the policy the simulation's autocast casts and
  caches each float32 weight as one process does: a low-precision copy of every block's weights
  through the forward (``dist.mixed_precision=false`` plans that).

With ``optimizer.fused_backward`` the simulation's own gradients are the few alive in the hooks (runner/optim/fused.py), and
the shard term above is their share: each rank steps and frees its shards right after the unit's reduce-scatter.

``dist=ddp``: everything of one process, and DDP's gradient buckets (row ``(ddp buckets)``): the
trained gradients live in them for the whole run (runner/distributed/runtime.py), so every phase holds
all trained gradients once, where one process holds them only from its backward on; around the
optimizer step twice: the gradient all-reduce runs just before it, and at the second step DDP
rebuilds its buckets in the order gradients arrived, copying every gradient once.

Host RAM at setup (:func:`host_setup`, :func:`host_per_node`). ``dist=ddp``, and ``dist=fsdp`` when
the ranks load the trained module whole (LoRA, a user's trainer: runner/distributed/loading.py
``load_mode``) or read a quantized base layer by layer (``quantized``, which the simulation itself
runs: runner/plan/quantized_reads.py): every rank's host peak is one process's. ``dist=fsdp`` loading by slices or by
broadcast: a rank holds the frozen modules as one process does, and of the trained module only one
tensor (or slice) in flight: its shards are made on the device (with ``dist.cpu_offload`` on the host),
filled after the plugins' setup; rank 0, when it broadcasts, holds the whole module (less the units
already sent) from its build on. The frozen modules
only rank 0 loads (runner/distributed/loading.py ``rank0_only_modules``: under ``offload=park`` on one node,
those whose outputs it caches) are left out of the other ranks' setup peak: the simulated peak less
their bytes at its instant, or the host after setup (they are dropped by then), whichever is larger;
rank 0's keeps them. Per node: rank 0's peak plus
``dist.ranks_per_node - 1`` times the others' (they all peak in setup, together).

The backward phase is at least the forward's end (every activation still alive, no new gradient):
a rank whose gradients are sharded, or always allocated (DDP's buckets), may peak right at the
start of backward, where one process peaks later. The peak is re-taken over the corrected phases.
The figures are an estimate of the FSDP2 terms, not a count: the per-rank truth test
(tests/runner/distributed/) holds it within 5 % of a real 2-process step measured with the live-bytes
tracker on each rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

ALL_GATHER = "(fsdp all-gather)"
REDUCE_SCATTER = "(fsdp reduce-scatter)"
DDP_BUCKETS = "(ddp buckets)"
EMA = "ema"  # runner.ema.average.CATEGORY (not imported: the plan's dist terms stay free of the EMA's code)


def _bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def shard_bytes(p: torch.Tensor, shards: int) -> int:
    """One rank's bytes of ``p`` split on dim 0 over ``shards`` ranks, padded as FSDP2 pads it."""
    if p.dim() == 0:
        return _bytes(p)
    rows = math.ceil(p.shape[0] / shards)
    return rows * (p.numel() // max(p.shape[0], 1)) * p.element_size()


@dataclass
class RankLayout:
    """What the distribution does to one rank's bytes (module docstring), measured on the simulated models."""

    name: str  # ddp | fsdp
    module: str = ""  # the trained module (fsdp: the one sharded)
    world: int = 1
    shards: int = 1
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    weights: int = 0  # every parameter of the module, full
    weights_shard: int = 0  # one rank's: sharded ones' shards + quantized ones whole
    whole: int = 0  # quantized weights FSDP leaves whole on every rank
    root: int = 0  # the root unit's shardable weights, full
    largest_unit: int = 0  # the largest block unit's shardable weights, full
    largest_unit_grads: int = 0  # its trainable parameters, full
    # The same in the dtype FSDP2 all-gathers in (``ResolvedRun.fsdp_param_dtype``; the stored dtype without
    # a MixedPrecisionPolicy): what is gathered in forward and backward, and the unsharded gradients.
    param_dtype: Any = None
    gathered: int = 0  # every shardable weight of the module, gathered
    root_gathered: int = 0
    largest_gathered: int = 0
    largest_grads_gathered: int = 0
    trainable: int = 0  # trainable parameters of the trained modules, full (their gradients' bytes)
    # fsdp, for the communication time (runner/plan/comm.py): the gradients reduce-scattered (trainable shardable
    # parameters, stored dtype: float32 under the MixedPrecisionPolicy's reduce dtype), all and the root's rest
    grads_reduced: int = 0
    root_grads: int = 0
    trainable_shard: int = 0
    units: int = 0
    last_forward: Any = None  # the previous forward phase's per-rank peak (see rank_phase)
    # Host RAM at setup (host_setup): how the ranks get the trained module (runner/distributed/loading.py: whole |
    # slices | broadcast), its largest tensor (the one slice or tensor in flight), the host bytes once the
    # plugins' setup is done (the frozen modules park kept), and rank 0's setup peak when it broadcasts.
    load: str = "whole"
    load_why: str = ""
    largest_tensor: int = 0
    host_after_setup: int = 0
    ranks_per_node: int = 1
    host_rank0: int = 0
    # Frozen modules only rank 0 loads (runner/distributed/loading.py rank0_only_modules: they only fill the
    # encoder cache) -> their parameters' bytes: the other ranks hold only their buffers.
    rank0_only: dict[str, int] = field(default_factory=dict)

    @property
    def state_share(self) -> float:
        return self.trainable_shard / self.trainable if self.trainable else 1.0


def _gathered_bytes(p: torch.Tensor, param_dtype: torch.dtype | None) -> int:
    """Bytes of ``p`` as FSDP2 all-gathers it: float32 weights in ``param_dtype`` under a
    MixedPrecisionPolicy (runner/distributed/runtime.py), every other weight in its stored dtype."""
    if param_dtype is not None and p.dtype == torch.float32:
        return p.numel() * param_dtype.itemsize
    return _bytes(p)


def gathered_params(layout: RankLayout | None, models: Any) -> frozenset[int]:
    """ids of the weights FSDP2 all-gathers in the autocast dtype (none without a MixedPrecisionPolicy):
    the simulation neither caches nor counts their casts (runner/memory/semantics.py), since the
    layout counts them per unit (module docstring)."""
    from runner.distributed.runtime import _unshardable_params

    if layout is None or layout.name != "fsdp" or layout.param_dtype is None:
        return frozenset()
    module = models[layout.module]
    whole = _unshardable_params(module)
    return frozenset(id(p) for p in module.parameters() if p not in whole and p.dtype == torch.float32)


def rank0_only_params(cfg: Any, trainer: Any, plugins: list[Any], spec: Any, models: Any) -> dict[str, int]:
    """The frozen modules only rank 0 loads (runner/distributed/loading.py ``rank0_only_modules``) -> their
    parameters' bytes on the simulated ``models``, before setup (the other ranks keep only their buffers)."""
    from runner.distributed.loading import rank0_only_modules

    names = rank0_only_modules(cfg, trainer, plugins, spec)[0]
    return {n: sum(_bytes(p) for p in models[n].parameters()) for n in names if n in models}


def measure(spec: Any, models: Any, param_dtype: torch.dtype | None = None,
            load: tuple[str, str] = ("whole", ""), host_after_setup: int = 0,
            rank0_only: dict[str, int] | None = None) -> RankLayout | None:
    """The layout of one rank of ``spec`` (a :class:`~runner.distributed.config.DistSpec`) on the simulated
    ``models`` after the plugins' setup; None for one process. ``param_dtype``: the run's
    ``fsdp_param_dtype`` (runner/resolved.py), the dtype each unit is all-gathered in. ``rank0_only``:
    the frozen modules only rank 0 loads -> their parameters' bytes (:func:`host_setup`)."""
    from runner.blocks import find_repeated_blocks
    from runner.distributed.runtime import _unshardable_params

    if not spec.active:
        return None
    trained = [models[n] for n in sorted(models.trained)]
    trainable = sum(_bytes(p) for m in trained for p in m.parameters() if p.requires_grad)
    if spec.name == "ddp":
        return RankLayout("ddp", world=spec.world_size, trainable=trainable, trainable_shard=trainable,
                          ranks_per_node=spec.ranks_per_node, load_why=load[1], host_after_setup=host_after_setup,
                          rank0_only=dict(rank0_only or {}))
    name = sorted(models.trained)[0]
    module: nn.Module = models[name]
    whole = _unshardable_params(module)
    blocks = models.blocks.get(name) or find_repeated_blocks(module)
    in_blocks: set[int] = set()
    unit_sizes, unit_grads, unit_gathered, unit_grads_gathered = [], [], [], []
    for block in blocks:
        params = [p for p in block.parameters() if p not in whole]
        in_blocks.update(id(p) for p in block.parameters())
        unit_sizes.append(sum(_bytes(p) for p in params))
        unit_grads.append(sum(_bytes(p) for p in params if p.requires_grad))
        unit_gathered.append(sum(_gathered_bytes(p, param_dtype) for p in params))
        unit_grads_gathered.append(sum(_gathered_bytes(p, param_dtype) for p in params if p.requires_grad))
    n = spec.shard_size
    params = list(module.parameters())
    rest = [p for p in params if id(p) not in in_blocks and p not in whole]
    return RankLayout(
        "fsdp", param_dtype=param_dtype,
        gathered=sum(_gathered_bytes(p, param_dtype) for p in params if p not in whole),
        root_gathered=sum(_gathered_bytes(p, param_dtype) for p in rest),
        largest_gathered=max(unit_gathered, default=0), largest_grads_gathered=max(unit_grads_gathered, default=0),
        module=name, world=spec.world_size, shards=n, reshard_after_forward=spec.reshard_after_forward,
        cpu_offload=spec.cpu_offload,
        weights=sum(_bytes(p) for p in params),
        weights_shard=sum(_bytes(p) if p in whole else shard_bytes(p, n) for p in params),
        whole=sum(_bytes(p) for p in params if p in whole),
        root=sum(_bytes(p) for p in rest),
        grads_reduced=sum(_bytes(p) for p in params if p.requires_grad and p not in whole),
        root_grads=sum(_bytes(p) for p in rest if p.requires_grad),
        largest_unit=max(unit_sizes, default=0), largest_unit_grads=max(unit_grads, default=0),
        trainable=trainable, trainable_shard=sum(shard_bytes(p, n) for p in params if p.requires_grad),
        units=len(blocks) + 1, load=load[0], load_why=load[1], ranks_per_node=spec.ranks_per_node,
        host_after_setup=host_after_setup, rank0_only=dict(rank0_only or {}),
        largest_tensor=max((_bytes(p) for p in params), default=0),
    )


def per_rank_phase(layout: RankLayout | None, phase: str, by_module: dict[str, dict[str, int]]
                   ) -> tuple[dict[str, dict[str, int]], int]:
    """One phase's device breakdown at its peak for one rank; (breakdown, bytes moved to the host)."""
    if layout is None:
        return by_module, 0
    out = {m: dict(c) for m, c in by_module.items()}
    step = phase.split(" ")[0]  # "forward #2" -> "forward"
    if layout.name == "ddp":
        grads = sum(c.get("gradients", 0) for m, c in out.items() if m != DDP_BUCKETS)
        for c in out.values():  # the buckets hold the trained gradients; nothing else does
            c.pop("gradients", None)
        buckets = max(layout.trainable, grads)
        if step == "optimizer":  # the gradient all-reduce runs just before the step: DDP re-buckets once, at the
            buckets *= 2         # second step, copying every gradient into new buckets (both alive for a moment)
        out[DDP_BUCKETS] = {"gradients": buckets}
        return out, 0
    mine = out.setdefault(layout.module, {})
    grads = mine.get("gradients", 0)
    share = layout.state_share
    to_host = 0
    weights = layout.weights_shard
    sharded_grads = int(grads * share)
    state = int(mine.get("optimizer_state", 0) * share)
    ema = int(mine.get(EMA, 0) * share)  # the EMA of this rank's shards
    if layout.cpu_offload:  # sharded weights, gradients and optimizer state on the host; quantized ones stay
        to_host = weights - layout.whole + sharded_grads + state + ema
        weights, sharded_grads, state, ema = layout.whole, 0, 0, 0
    mine["weights"] = weights
    mine["gradients"] = sharded_grads
    mine["optimizer_state"] = state
    if EMA in mine:
        mine[EMA] = ema
    if step == "setup":  # fully_shard moves one unit (or the root's rest) whole to the device, then keeps a shard
        out[ALL_GATHER] = {"weights": max(layout.largest_unit, layout.root)}
    elif step in ("forward", "backward"):
        if not layout.reshard_after_forward:
            window = layout.gathered  # every unit stays gathered from its forward to its backward
        elif step == "forward":
            window = layout.root_gathered + 2 * layout.largest_gathered
        else:
            window = layout.root_gathered + 3 * layout.largest_gathered
        out[ALL_GATHER] = {"weights": window}
        if step == "backward":  # the unit's unsharded gradients (gathered dtype) and the float32 reduce-scatter input
            out[REDUCE_SCATTER] = {"gradients": layout.largest_grads_gathered + layout.largest_unit_grads}
    return out, to_host


def rank_phase(layout: RankLayout, pk: Any, on_device: bool, moved: int) -> tuple[Any, int]:
    """runner/plan/simulate.py's hook: one phase's :class:`~runner.plan.result.PhasePeak` for one rank.
    The device's comes first and returns the bytes it moves to the host; the host's adds them."""
    from runner.plan.result import PhasePeak

    if on_device:
        by_module, moved = per_rank_phase(layout, pk.name, pk.by_module)
        total = sum(sum(c.values()) for c in by_module.values())
        out = PhasePeak(pk.name, pk.where, pk.peak_bytes + total - sum(sum(c.values()) for c in pk.by_module.values()),
                        by_module)
        step = pk.name.split(" ")[0]
        if step == "forward":
            layout.last_forward = out
        elif step == "backward" and layout.last_forward is not None \
                and layout.last_forward.peak_bytes > out.peak_bytes:
            # The start of backward holds what the end of forward held (every activation, no new gradient
            # yet). One process peaks later in backward, when the gradients have grown; a rank whose
            # gradients are sharded (FSDP) or always allocated (DDP's buckets) may peak right at its start.
            f = layout.last_forward
            out = PhasePeak(pk.name, f.where, f.peak_bytes, {m: dict(c) for m, c in f.by_module.items()})
        return out, moved
    if pk.name.split(" ")[0] == "setup":
        pk = host_setup(layout, pk, moved)
    if not moved:
        return pk, moved
    by_module = {m: dict(c) for m, c in pk.by_module.items()}
    mine = by_module.get(layout.module, {})
    less = 0
    if layout.name == "fsdp" and mine.get(EMA):  # ema.device=cpu: this rank's share of the host copy
        less = mine[EMA] - int(mine[EMA] * layout.state_share)
        mine[EMA] -= less
    if not moved and not less:
        return pk, moved
    by_module.setdefault(layout.module, mine)["weights"] = mine.get("weights", 0) + moved
    return PhasePeak(pk.name, pk.where, pk.peak_bytes + moved - less, by_module), moved


def host_setup(layout: RankLayout, pk: Any, moved: int) -> Any:
    """The setup phase's host peak of one rank under ``dist=fsdp``'s sharded load (runner/distributed/loading.py).

    The simulation holds every module whole on the host at its start, as one process (and every rank
    before the sharded load) does. With ``slices`` or ``broadcast`` a rank (rank 0 aside when it
    broadcasts) holds the trained module only as its shards, filled after the plugins' setup (park
    has cached the text encoders' outputs and dropped them by then): its peak is the larger of the
    start without the trained module (the frozen modules, loaded as before) and what is left after
    setup plus one tensor in flight (its shards are made on the device, planned there). Rank 0 when it
    broadcasts holds the module whole from its build until it has sent it unit by unit:
    ``layout.host_rank0``. With ``dist.cpu_offload`` the shards are added afterwards as ``moved`` (they
    stay on the host)."""
    from runner.plan.result import PhasePeak

    layout.host_rank0 = pk.peak_bytes + moved
    # The cache-only modules at the peak: the other ranks never hold them (rank 0 alone loads them). Their
    # peak is the simulated one less these, or the host after setup (park has dropped them by then on every
    # rank), whichever is larger: an estimate from the peak's instant, not a second timeline.
    skipped = {m: min(c.get("weights", 0), layout.rank0_only[m]) for m, c in pk.by_module.items()
               if m in layout.rank0_only}
    if layout.name != "fsdp" or layout.load in ("whole", "quantized"):  # quantized: simulated (plan/base_reads.py)
        if not skipped:
            return pk
        peak = max(pk.peak_bytes - sum(skipped.values()), layout.host_after_setup)
        return PhasePeak(pk.name, pk.where, peak, _without(pk.by_module, skipped))
    trained = pk.by_module.get(layout.module, {}).get("weights", 0)
    without = pk.peak_bytes - trained
    others = without - sum(skipped.values())
    # The shards are made on the device (runner/distributed/loading.py shard_units: ``materialize(module, device)``;
    # with dist.cpu_offload on the host, added as ``moved``): the host holds one tensor (or slice) in flight.
    fill = layout.host_after_setup + layout.largest_tensor
    peak = max(others, fill)
    if layout.load == "broadcast":  # the whole module, less each unit as it is sent and sharded on the device
        layout.host_rank0 = max(pk.peak_bytes, layout.host_after_setup + layout.weights) + moved
    else:
        layout.host_rank0 = max(without, fill) + moved
    by_module = _without(pk.by_module, skipped)
    by_module.setdefault(layout.module, {})["weights"] = peak - others
    return PhasePeak(pk.name, pk.where, peak, by_module)


def _without(by_module: dict[str, dict[str, int]], skipped: dict[str, int]) -> dict[str, dict[str, int]]:
    """A breakdown less the ``skipped`` weight bytes of each module (what a rank other than 0 never loads)."""
    out = {m: dict(c) for m, c in by_module.items()}
    for m, n in skipped.items():
        out[m]["weights"] = out[m].get("weights", 0) - n
    return out


def host_per_node(layout: RankLayout | None, host_peak: int) -> dict[str, Any] | None:
    """The plan's host lines for ``dist``: per rank, rank 0 (when it holds more), and per node:
    rank 0's peak + (``ranks_per_node`` - 1) x the other ranks' (every rank's peak in setup, all at once)."""
    if layout is None:
        return None
    rank0 = max(host_peak, layout.host_rank0)
    n = layout.ranks_per_node
    return {"ranks_per_node": n, "per_rank_bytes": host_peak, "rank0_bytes": rank0,
            "per_node_bytes": rank0 + (n - 1) * host_peak, "load": layout.load, "why": layout.load_why}


def rank_state_bytes(layout: RankLayout | None, by_device: dict[str, int]) -> dict[str, int]:
    """The plan's optimizer-state line for one rank: FSDP's share (on the host with cpu_offload); the EMA
    line's too (runner/plan/ema.py), which is sharded and placed like the optimizer state."""
    if layout is None or layout.name != "fsdp":
        return by_device
    from runner.plan.target import DEVICE, HOST

    out = {dev: int(n * layout.state_share) for dev, n in by_device.items()}
    if layout.cpu_offload:
        out[HOST.type] = out.get(HOST.type, 0) + out.pop(DEVICE.type, 0)
    return out
