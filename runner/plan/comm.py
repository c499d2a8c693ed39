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
``link`` in conf/devices.yaml). A ring whose ranks span nodes (``world_size > dist.ranks_per_node``)
crosses the network: NCCL runs parallel rings (channels), each crossing nodes on its own NIC, so
with one NIC per GPU (the assumption conf/devices.yaml states) the network gives each rank
``ranks of the ring per node x one NIC's rate`` (``dist.inter_node_interconnect``), bounded by the
node's link; hybrid_shard's replica ring (one rank per node) gets one NIC's rate. Seconds per collective:
NCCL's own cost model, ``latency + bytes / (bandwidth x LINK_EFFICIENCY)``, with its base latency
and a hop latency per ring step (intra-node steps at the node's link, inter-node ones at the network's).

Overlap, the assumption. FSDP2 prefetches the next unit's all-gather while the current one computes
and reduce-scatters a unit's gradients while the next one's backward runs, on separate CUDA streams;
so a phase takes ``max(compute, communication not exposed) + exposed``, where the exposed part is
what nothing can hide: in forward the first gather (the root's rest and one block, before any
compute), in backward the last reduce-scatters (the root's and one block's, after the last compute).
Simple on purpose: it ignores the compute slowdown while NCCL's kernels share the SMs and the
bandwidth taken by copies of ``offload`` plugins; ``dist.cpu_offload``'s host<->device copies of the
shards are not counted here. DDP here does not overlap at all: runner/distributed/runtime.py runs the passes
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
    nodes: int  # nodes the ring spans (its inter-node steps)
    gathered_bytes: int  # per micro-batch: the bytes of the full tensors (all-gather output, reduce-scatter input)
    sent_bytes: int  # per micro-batch: what one rank sends, (n-1)/n (all-reduce 2(n-1)/n) of gathered_bytes
    calls: int  # collectives per micro-batch (one per unit, or per parameter)
    repeats: int  # micro-batches it runs in per optimizer step (dist=ddp: once per step)
    link: str
    seconds: float  # per optimizer step (every micro-batch)
    exposed: bool = False  # the part of a phase's communication no compute hides (counted within another row too)


@dataclass
class CommTime:
    """A rank's communication per optimizer step: seconds by phase, the part no compute hides, and its collectives."""

    links: str
    micro_batches: int = 1
    phases: dict[str, float] = field(default_factory=dict)
    exposed: dict[str, float] = field(default_factory=dict)
    overlap: str = ""
    collectives: list[Collective] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    def to_dict(self) -> dict[str, Any]:
        return {"links": self.links, "micro_batches": self.micro_batches, "seconds": self.seconds,
                "phases": dict(self.phases), "exposed": dict(self.exposed),
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
    def gbps(self) -> float:
        """GB/s per rank of the ring: the node's link within one node; across nodes each node's ranks run
        parallel rings (NCCL's channels), each crossing on its own GPU's NIC, so the network gives
        ``ranks of the ring per node x one NIC``, and the node's link still bounds the hops inside it."""
        if self.nodes <= 1:
            return self.intra.gbps
        per_node = max(self.n // self.nodes, 1)
        net = self.inter.gbps * per_node
        return net if per_node == 1 else min(net, self.intra.gbps)

    @property
    def link(self) -> str:
        """The name of the link that bounds the ring."""
        if self.nodes <= 1:
            return self.intra.name
        return self.inter.name if self.inter.gbps * max(self.n // self.nodes, 1) <= self.gbps else self.intra.name

    def seconds(self, sent: int, calls: int, kind: str) -> float:
        """NCCL's ring model: base + hop latencies per call, the sent bytes over the slowest link."""
        if self.n <= 1 or not calls:
            return 0.0
        steps = 2 * (self.n - 1) if kind == "all-reduce" else self.n - 1
        inter_steps = min(steps, (2 if kind == "all-reduce" else 1) * (self.nodes - 1))
        lat_us = NCCL_BASE_LATENCY_US + (steps - inter_steps) * self.intra.hop_latency_us \
            + inter_steps * self.inter.hop_latency_us
        return calls * lat_us * 1e-6 + sent / (self.gbps * 1e9 * LINK_EFFICIENCY)


def _ring(n: int, ranks_per_node: int, intra: LinkSpec, inter: LinkSpec) -> Ring:
    return Ring(n=n, nodes=-(-n // max(ranks_per_node, 1)), intra=intra, inter=inter)


def _add(out: list[Collective], kind: str, phase: str, what: str, r: Ring, nbytes: int, calls: int,
         micro_batches: int, exposed: bool = False) -> None:
    sent = ring_sent(nbytes, r.n, kind)
    out.append(Collective(kind, phase, what, r.n, r.nodes, nbytes, sent, calls, micro_batches, r.link,
                          micro_batches * r.seconds(sent, calls, kind), exposed))


def fsdp_collectives(layout: Any, ring: Ring, replicas: Ring | None, micro_batches: int) -> list[Collective]:
    """The collectives of ``dist=fsdp`` per the module docstring, from ``layout``'s unit sizes; the
    ``exposed`` rows are the first gather and the last reduce-scatters (also inside the full rows)."""
    out: list[Collective] = []
    blocks = layout.units - 1
    _add(out, "all-gather", "forward", "every unit's weights", ring, layout.gathered, layout.units, micro_batches)
    if layout.reshard_after_forward:
        _add(out, "all-gather", "backward", "the blocks' weights again (resharded after forward)", ring,
             layout.gathered - layout.root_gathered, blocks, micro_batches)
    _add(out, "reduce-scatter", "backward", "every trainable unit's gradients", ring, layout.grads_reduced,
         layout.units, micro_batches)
    if replicas is not None and replicas.n > 1:
        _add(out, "all-reduce", "backward", "each gradient shard across the replicas (hybrid_shard)", replicas,
             layout.grads_reduced // ring.n, layout.units, micro_batches)
    _add(out, "all-gather", "forward", "the first gather: the root's rest and one block, before any compute", ring,
         layout.root_gathered + layout.largest_gathered, 2, micro_batches, exposed=True)
    _add(out, "reduce-scatter", "backward", "the last reduce-scatters: one block's and the root's, after the "
         "last compute", ring, layout.root_grads + layout.largest_unit_grads, 2, micro_batches, exposed=True)
    return out


def _sum_phases(out: CommTime) -> CommTime:
    out.phases, out.exposed = {}, {}
    for c in out.collectives:
        into = out.exposed if c.exposed else out.phases
        into[c.phase] = into.get(c.phase, 0.0) + c.seconds
    return out


def comm_time(spec: Any, layout: Any, *, intra: LinkSpec, inter: LinkSpec, micro_batches: int,
              grad_bytes: int, grad_tensors: int, fused: bool) -> CommTime | None:
    """A rank's communication of one optimizer step; None for one process. ``spec``: the run's
    :class:`~runner.distributed.config.DistSpec`; ``layout``: runner/plan/dist.py's (fsdp: required);
    ``grad_bytes``/``grad_tensors``: the trained gradients (dist=ddp's all-reduce)."""
    if not spec.active:
        return None
    rpn = spec.ranks_per_node
    world = _ring(spec.world_size, rpn, intra, inter)
    out = CommTime(links=_links_text(world), micro_batches=micro_batches)
    if spec.name == "fsdp":
        replicas = None
        if spec.shard_size < spec.world_size:  # hybrid_shard: the shard's replicas, one per node
            k = spec.world_size // spec.shard_size
            replicas = Ring(n=k, nodes=k, intra=intra, inter=inter)
        out.collectives = fsdp_collectives(layout, _ring(spec.shard_size, rpn, intra, inter), replicas, micro_batches)
        out.overlap = ("FSDP2 prefetches gathers and reduce-scatters on their own streams: a phase takes "
                       "max(compute, communication) + the first gather (forward) / last reduce-scatters (backward)")
    else:
        calls = grad_tensors if fused else max(1, -(-grad_bytes // max(int(spec.bucket_mb * 2**20), 1)))
        phase = "backward" if fused else "optimizer"
        _add(out.collectives, "all-reduce", phase, "every trained gradient", world, grad_bytes, calls, 1)
        _add(out.collectives, "all-reduce", phase, "all of it: nothing overlaps", world, grad_bytes, calls, 1,
             exposed=True)
        out.overlap = ("not overlapped: the gradients are all-reduced " +
                       ("in each parameter's hook, before it steps" if fused else "once, after the passes"))
    return _sum_phases(out)


def _links_text(world: Ring) -> str:
    if world.nodes <= 1:
        return world.intra.name
    return f"{world.intra.name} within a node, {world.inter.name} between {world.nodes} nodes"


def repriced(comm: dict[str, Any], intra: LinkSpec, inter: LinkSpec, ranks_per_node: int | None = None) -> CommTime:
    """A plan's communication (``step_time["comm"]`` of plan.json) over other links: the same collectives,
    bytes and calls, priced again (bench/dist_plan.py's interconnect columns, without planning again).
    ``ranks_per_node``: the ranks placed on nodes of that size instead (rings of one rank per node, as
    hybrid_shard's replicas, stay so)."""
    out = CommTime(links="", micro_batches=int(comm["micro_batches"]), overlap=str(comm["overlap"]))
    for c in comm["collectives"]:
        n, nodes = int(c["group"]), int(c["nodes"])
        if ranks_per_node and nodes < n:
            nodes = -(-n // ranks_per_node)
        c = {**c, "nodes": nodes}
        r = Ring(n=n, nodes=nodes, intra=intra, inter=inter)
        seconds = int(c["repeats"]) * r.seconds(int(c["sent_bytes"]), int(c["calls"]), c["kind"])
        out.collectives.append(Collective(**{**c, "link": r.link, "seconds": seconds}))
    widest = max((Ring(n=c.group, nodes=c.nodes, intra=intra, inter=inter) for c in out.collectives),
                 key=lambda r: r.n)
    out.links = _links_text(widest)
    return _sum_phases(out)


def step_seconds(step_time: dict[str, Any], comm: CommTime) -> float:
    """A plan's s/step (``step_time`` of plan.json) with ``comm`` in place of its own communication."""
    compute = step_time["comm"]["compute_phases"]
    return sum(phase_with_comm(t, comm.phases.get(k, 0.0), comm.exposed.get(k, 0.0)) for k, t in compute.items())


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
