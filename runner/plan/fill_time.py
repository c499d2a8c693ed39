"""How long the encoder cache's pre-pass takes, planned: park's fill on the device or on the host.

The planner runs one batch of each part the pre-pass encodes (runner/plan/prepass.py) and counts its
ops, FLOPs, bytes and copies apart (runner/plan/cost.py, phase "cache fill"). One batch's time is the
step-time model's, simplified (runner/plan/speed.py): on a GPU the larger of the device's roofline
work (scaled by the fitted card-time factor) and the host's dispatch (ops x host cost per op), plus
the host-to-device copies on the compute stream (park moves each encoder in for its call; out is a pointer
swap) at the link's rate, plus
the ops on host tensors at the host's roofline. ``offload.park.fill=host`` runs every op on the host:
its roofline (a GPU machine's assumed CPU rates, speed.py's HOST_GFLOPS and HOST_GBPS; this CPU's
measured ones for ``train.device=cpu``) plus dispatch, one after the other.

Batches per part: the entries to encode over the batch size. The preflight counts them (the entries
missing); ``mode=plan`` reads no data, so it assumes a cold cache of the demo set's samples (both
orientations with ``data.random_flip``; a caption part at most one per sample), or, with a data folder,
states the time per sample only.
"""
from __future__ import annotations

import math
from typing import Any

from runner.plan.cost import PhaseCost
from runner.plan.speed import HOST_GBPS, HOST_GFLOPS, Target


def batch_seconds(c: PhaseCost, target: Target) -> tuple[float, str]:
    """One pre-pass batch's seconds on ``target`` from its counts, and what bounds it."""
    scale = target.host_costs.device_scale if target.host_costs is not None else 1.0
    device, dispatch = c.device_s * scale, c.ops * target.host_op_s
    copies = c.h2d_bytes / target.h2d_bytes_per_s  # (moving a parked encoder out is a pointer swap: no copy)
    compute = device + dispatch if target.serial else max(device, dispatch)
    terms = {"device work": device, "host dispatch": dispatch, "copies to the device": copies,
             "host compute": c.host_s}
    return compute + copies + c.host_s, max(terms, key=lambda k: terms[k])


def cold_entries(cfg: Any, specs: dict[str, Any], parts: list[str]) -> dict[str, int] | None:
    """Entries a cold cache needs per part, from the config alone: the demo set's samples (data.path unset),
    both orientations of image parts with ``data.random_flip``; None with a data folder (not read by mode=plan)."""
    data = cfg.data
    flip = bool(data.get("random_flip", False))
    if data.get("path") or data.get("sets"):
        return None
    samples = int(data.get("demo_size", 0) or 0) + int(data.get("demo_prior", 0) or 0)
    return {p: samples * (1 if tuple(specs[p].inputs) == ("caption",) or not flip else 2) for p in parts}


def fill_time(sim: Any, report: dict[str, Any] | None, target: Target) -> dict[str, Any] | None:
    """The pre-pass's planned time (plan.json's ``cache_fill.fill``): where it runs, seconds per batch and
    entries per part, the total (None when the data set's size is unknown); None without a pre-pass."""
    fill = sim.cache_fill
    if report is None or fill is None or not fill.get("costs"):
        return None
    on_host = bool(fill["host_parts"])
    parts = fill["host_parts"] or fill["parts"]
    if report["read"]:
        entries: dict[str, int] | None = {p: m - n for p, (n, m) in report["entries"].items() if p in parts}
    else:
        entries = cold_entries(sim.cfg, sim.trainer.encode_parts(), parts)
    batch = int(fill["batch_size"])
    per_batch, bound = {}, {}
    for part, cost in fill["costs"].items():
        per_batch[part], bound[part] = batch_seconds(cost, target)
    total = None if entries is None else sum(math.ceil(entries[p] / batch) * s for p, s in per_batch.items())
    slowest = max(per_batch, key=lambda p: per_batch[p])
    streamed = bool(sim.ctx.notes.get("cache fill streamed"))  # offload.park.fill=stream: block by block
    where = ("the host CPU" + ("" if target.serial else f" ({HOST_GFLOPS:g} GFLOP/s, {HOST_GBPS:g} GB/s assumed)")
             if on_host else target.label + (", block by block" if streamed else ""))
    return {"on": "host" if on_host else "stream" if streamed else "device", "where": where, "batch_size": batch, "entries": entries,
            "seconds_per_batch": {p: round(s, 6) for p, s in per_batch.items()},
            "flops_per_batch": {p: c.flops + c.host_flops for p, c in fill["costs"].items()},
            "h2d_bytes_per_batch": {p: int(c.h2d_bytes) for p, c in fill["costs"].items()},
            "seconds_per_sample": round(sum(per_batch.values()) / batch, 6), "seconds": None if total is None else round(total, 6),
            "bound": f"{slowest} bound by {bound[slowest]}",
            "untimed": [p for p in parts if p not in per_batch]}
