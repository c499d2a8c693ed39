"""Communication seconds of one rank's step under ``dist=ddp|fsdp``, beside the compute of runner/plan/speed.py.

What is sent. Every collective is NCCL's ring: in an all-gather or a reduce-scatter over a group of
``n`` ranks each rank sends (and receives) ``(n-1)/n`` of the gathered bytes, in ``n-1`` steps; an
all-reduce is a reduce-scatter and an all-gather, ``2(n-1)/n`` of the bytes in ``2(n-1)`` steps. The
bytes are the planner's unit sizes (runner/plan/dist.py's :class:`~runner.plan.dist.RankLayout`,
measured on the simulated models), per micro-batch:

* ``dist=fsdp``: forward all-gathers every unit (the repeated blocks and the root's rest) in the
  dtype FSDP2 gathers in (``ResolvedRun.fsdp_param_dtype``: bf16 under the mixed-precision policy,
  else the stored dtype); backward all-gathers the blocks again when ``dist.reshard_after_forward``
  (FSDP2 keeps the root gathered); backward reduce-scatters every trainable shardable gradient in
  the reduce dtype (float32 under the policy: the stored float32; otherwise the stored dtype, which
  is the same bytes). ``hybrid_shard`` then all-reduces each rank's gradient shard across the
  replicas (one per node) over the inter-node link. Quantized weights FSDP leaves whole are not sent.
  The padding FSDP2 adds to make dim 0 divisible is left out (a few rows per parameter).
* ``dist=ddp``: one all-reduce of every trained gradient (stored dtype) per optimizer step.

Over which link. A ring within one node runs at ``dist.interconnect`` (default: the device's
``link`` in conf/devices.yaml); a ring whose ranks span nodes (``world_size > dist.ranks_per_node``)
is bounded by its slowest hop, so it runs at the lower of that and ``dist.inter_node_interconnect``
(one NIC per GPU assumed, conf/devices.yaml says how to read the figures). Seconds per collective:
NCCL's own cost model, ``latency + bytes / (bandwidth x LINK_EFFICIENCY)``, with its base latency
and a hop latency per ring step (intra-node steps at the node's link, inter-node ones at the network's).

Overlap, the assumption. FSDP2 prefetches the next unit's all-gather while the current one computes
and reduce-scatters a unit's gradients while the next one's backward runs, on separate CUDA streams;
so a phase takes ``max(compute, communication not exposed) + exposed``, where the exposed part is
what nothing can hide: in forward the first gather (the root's rest and one block, before any
compute), in backward the last reduce-scatters (the root's and one block's, after the last compute).
Simple on purpose: it ignores the compute slowdown while NCCL's kernels share the SMs and the
bandwidth taken by copies of ``offload`` plugins; ``dist.cpu_offload``'s host<->device copies of the
shards are not counted here. DDP here does not overlap at all: runner/dist/runtime.py runs the passes
on the unwrapped modules and all-reduces the whole gradient once after them (its docstring says why),
so the all-reduce adds its full time to the optimizer phase; with fused backward each gradient is
all-reduced in its hook, synchronously, before its parameter steps: full time in backward.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from runner.devices import LinkSpec

LINK_EFFICIENCY = 0.80  # achieved share of a link's per-direction bandwidth by NCCL's ring for large messages (assumption)
NCCL_BASE_LATENCY_US = 8.4  # NCCL's cost model (src/graph/tuning.cc, baseLat, Ring algorithm, Simple protocol)


@dataclass
class Collective:
    """One kind of collective in one phase of a step: per-rank bytes sent and its seconds."""

    kind: str  # all-gather | reduce-scatter | all-reduce
    phase: str  # forward | backward | optimizer
    what: str
    group: int  # ranks in the ring
    gathered_bytes: int  # per micro-batch: the bytes of the full tensors (all-gather output, reduce-scatter input)
    sent_bytes: int  # per micro-batch: what one rank sends, (n-1)/n (all-reduce 2(n-1)/n) of gathered_bytes
    calls: int  # collectives per micro-batch (one per unit, or per parameter)
    link: str
    seconds: float  # per optimizer step (every micro-batch)


@dataclass
class CommTime:
    """A rank's communication per optimizer step: seconds by phase, the part no compute hides, and its collectives."""

    links: str
    phases: dict[str, float] = field(default_factory=dict)
    exposed: dict[str, float] = field(default_factory=dict)
    overlap: str = ""
    collectives: list[Collective] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    def to_dict(self) -> dict[str, Any]:
        return {"links": self.links, "seconds": self.seconds, "phases": dict(self.phases), "exposed": dict(self.exposed),
                "overlap": self.overlap, "collectives": [asdict(c) for c in self.collectives]}


def ring_sent(nbytes: int, n: int, kind: str) -> int:
    """Bytes one rank sends in a ring ``kind`` over ``n`` ranks whose full tensors are ``nbytes``."""
    if n <= 1:
        return 0
    steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
    return nbytes * steps // n


@dataclass(frozen=True)
class Ring:
    """A group of ``n`` ranks and the links its steps cross."""

    n: int
    nodes: int  # nodes the ring spans
    intra: LinkSpec
    inter: LinkSpec

    @property
    def link(self) -> LinkSpec:
        return self.intra if self.nodes <= 1 or self.inter.gbps >= self.intra.gbps else self.inter

    def seconds(self, sent: int, calls: int, kind: str) -> float:
        """NCCL's ring model: base + hop latencies per call, the sent bytes over the slowest link."""
        if self.n <= 1 or not calls:
            return 0.0
        steps = 2 * (self.n - 1) if kind == "all-reduce" else self.n - 1
        inter_steps = (2 if kind == "all-reduce" else 1) * (self.nodes - 1)
        lat_us = NCCL_BASE_LATENCY_US + (steps - inter_steps) * self.intra.hop_latency_us \
            + inter_steps * self.inter.hop_latency_us
        return calls * lat_us * 1e-6 + sent / (self.link.gbps * 1e9 * LINK_EFFICIENCY)


def _ring(n: int, ranks_per_node: int, intra: LinkSpec, inter: LinkSpec) -> Ring:
    return Ring(n=n, nodes=-(-n // max(ranks_per_node, 1)), intra=intra, inter=inter)


def fsdp_collectives(layout: Any, ring: Ring, replicas: Ring | None, micro_batches: int) -> list[Collective]:
    """The collectives of ``dist=fsdp`` per the module docstring, from ``layout``'s unit sizes."""
    n, out = ring.n, []

    def add(kind: str, phase: str, what: str, r: Ring, nbytes: int, calls: int) -> None:
        sent = ring_sent(nbytes, r.n, kind)
        out.append(Collective(kind, phase, what, r.n, nbytes, sent, calls, r.link.name,
                              micro_batches * r.seconds(sent, calls, kind)))

    blocks = layout.units - 1
    add("all-gather", "forward", "every unit's weights", ring, layout.gathered, layout.units)
    if layout.reshard_after_forward:
        add("all-gather", "backward", "the blocks' weights again (resharded after forward)", ring,
            layout.gathered - layout.root_gathered, blocks)
    add("reduce-scatter", "backward", "every trainable unit's gradients", ring, layout.grads_reduced, layout.units)
    if replicas is not None and replicas.n > 1:
        add("all-reduce", "backward", "each gradient shard across the replicas (hybrid_shard)", replicas,
            layout.grads_reduced // n, layout.units)
    return out


def comm_time(spec: Any, layout: Any, *, intra: LinkSpec, inter: LinkSpec, micro_batches: int,
              grad_bytes: int, grad_tensors: int, fused: bool) -> CommTime | None:
    """A rank's communication of one optimizer step; None for one process. ``spec``: the run's
    :class:`~runner.dist.config.DistSpec`; ``layout``: runner/plan/dist.py's (fsdp: required);
    ``grad_bytes``/``grad_tensors``: the trained gradients (dist=ddp's all-reduce)."""
    if not spec.active:
        return None
    rpn = spec.ranks_per_node
    world = _ring(spec.world_size, rpn, intra, inter)
    links = intra.name if world.nodes <= 1 else f"{intra.name} within a node, {inter.name} between {world.nodes} nodes"
    out = CommTime(links=links)
    if spec.name == "fsdp":
        shard = _ring(spec.shard_size, rpn, intra, inter)
        replicas = None
        if spec.shard_size < spec.world_size:  # hybrid_shard: one rank per replica, each on another node
            k = spec.world_size // spec.shard_size
            replicas = Ring(n=k, nodes=k, intra=inter, inter=inter)
        out.collectives = fsdp_collectives(layout, shard, replicas, micro_batches)
        first = shard.seconds(ring_sent(layout.root_gathered + layout.largest_gathered, shard.n, "all-gather"), 2,
                              "all-gather")
        last = shard.seconds(ring_sent(layout.root_grads + layout.largest_unit_grads, shard.n, "reduce-scatter"), 2,
                             "reduce-scatter")
        out.exposed = {"forward": micro_batches * first, "backward": micro_batches * last}
        out.overlap = ("FSDP2 prefetches gathers and reduce-scatters on their own streams: a phase takes "
                       "max(compute, communication) + the first gather (forward) / last reduce-scatters (backward)")
    else:
        sent = ring_sent(grad_bytes, world.n, "all-reduce")
        calls = grad_tensors if fused else max(1, -(-grad_bytes // max(int(spec.bucket_mb * 2**20), 1)))
        phase = "backward" if fused else "optimizer"
        seconds = world.seconds(sent, calls, "all-reduce")
        out.collectives = [Collective("all-reduce", phase, "every trained gradient", world.n, grad_bytes, sent, calls,
                                      world.link.name, seconds)]
        out.exposed = {phase: seconds}
        out.overlap = ("not overlapped: the gradients are all-reduced " +
                       ("in each parameter's hook, before it steps" if fused else "once, after the passes"))
    for c in out.collectives:
        out.phases[c.phase] = out.phases.get(c.phase, 0.0) + c.seconds
    return out


def rank_comm(run: Any, layout: Any, *, grad_bytes: int, grad_tensors: int, fused: bool) -> CommTime | None:
    """runner/plan/simulate.py's hook: the :func:`comm_time` of ``run`` (a ResolvedRun) over its configured
    links; None for one process or a CPU target (no GPU links to price)."""
    from runner.devices import intra_node_link, link_spec, reference_spec

    dist = run.dist
    if not dist.active or run.target == "cpu" or (dist.name == "fsdp" and layout is None):
        return None
    intra = intra_node_link(dist.interconnect, run.gpu or reference_spec())
    inter = link_spec(dist.inter_node_interconnect, "dist.inter_node_interconnect")
    return comm_time(dist, layout, intra=intra, inter=inter, micro_batches=run.grad_accum,
                     grad_bytes=grad_bytes, grad_tensors=grad_tensors, fused=fused)


def phase_with_comm(compute: float, comm: float, exposed: float) -> float:
    """A phase's seconds with its communication: the exposed part adds, the rest hides behind compute."""
    return max(compute, comm - exposed) + exposed
