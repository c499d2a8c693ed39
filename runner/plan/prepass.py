"""The encoders' pre-pass a plugin runs in setup, planned: park filling its encoder cache on a first run.

Why: park encodes the whole data set before step 1 (plugins/park/cache.py:fill_cache), one batch of
``offload.park.encode_batch_size`` per call, each part's encoders on the device for their call. The
plan used to start after it, so a first run could need more than its plan (``train.device=cuda_sim``
showed it: a tiny Lumina 2's text encoder, with eager attention, peaked at 2.4x the planned step).
The preflight plans the pre-pass this run will do: park counts its cache's entries first
(``ctx.simulated_reads_cache``) and asks for the parts with entries missing only, none for a full cache.
``mode=plan`` reads no data, so it assumes a cold cache (the run that needs the most) and says so.
"""
from __future__ import annotations

from typing import Any

import torch

from runner.compat import FAKE_VALUE_ERRORS, unset_fake_temporarily
from runner.plan.batch import example_batch, fake_batch, move_batch
from runner.plan.target import DEVICE, HOST
from runner.plan.known_values import known_values

FILL_PHASE = "cache fill"  # the planner phase of the pre-pass (its peak: "setup, in cache fill")


def simulate_cache_fill(sim: Any, parts: list[str], batch_size: int, on_host: bool = False) -> None:
    """A plugin's encoding pre-pass in setup (park fills its encoder cache on a first run:
    plugins/park/cache.py:fill_cache): one batch of ``batch_size`` per part, each part's encoders as
    the plugin left them (parked: on the device for their call only; ``on_host``: on the host, with the
    batch, as ``offload.park.fill=host``), under autocast and no_grad.
    Its peak is the setup phase's ("setup, in cache fill"): before this, a cache-filling first run
    could need more than the planned step (a text encoder's eager attention, or its weights). Each
    part's ops are counted apart (``sim.counter``'s "cache fill" phase), for the fill's time
    (runner/plan/fill_time.py)."""
    trainer, ctx, tracker = sim.trainer, sim.ctx, sim.tracker
    if not callable(getattr(trainer, "example_raw_batch", None)):
        return
    specs = trainer.encode_parts()
    where = HOST if on_host else DEVICE
    host_batch = fake_batch(example_batch(trainer, True, batch_size), HOST)
    skipped, costs = [], {}
    with known_values(), tracker.phase("cache fill", category="activations"):
        for part in parts:
            keep = set(specs[part].inputs) | {"sample_seed"}
            batch = move_batch({k: v for k, v in host_batch.items() if k in keep}, where)
            batch["sample_seed"] = device_seeds(batch_size, where)  # as fill_cache: a text-only part computes there
            before = sim.counter.snapshot(FILL_PHASE) if sim.counter is not None else None
            try:
                with ctx.accelerator.autocast(), torch.no_grad():
                    out = trainer.encode_part(ctx.models, part, batch)
                del out
                if before is not None:
                    costs[part] = sim.counter.snapshot(FILL_PHASE).minus(before)
            except FAKE_VALUE_ERRORS as e:  # an encoder that reads values (Qwen2.5-VL's image grid)
                skipped.append(f"{part} ({type(e).__name__})")
            del batch
    del host_batch
    peak = 0 if on_host else int(tracker.phase_peaks.get(FILL_PHASE, {}).get(DEVICE.type, 0))
    sim.cache_fill = {"parts": [] if on_host else list(parts), "host_parts": list(parts) if on_host else [],
                      "peak_bytes": peak, "batch_size": batch_size, "costs": costs}
    if skipped:
        sim.notes["cache fill"] = ("first-run encoder pre-pass not planned for " + ", ".join(skipped)
                                    + ": its encoder reads values a shape-only plan does not have")


def device_seeds(n: int, where: torch.device = DEVICE) -> torch.Tensor:
    """``n`` zero seeds on the simulated device (or host), as park's fill_cache gives each encode call: a part
    without pixels (the captions) takes its compute device from them (runner/trainer.py:batch_device).
    A real CPU tensor moved inside :func:`known_values`, so the value stays readable."""
    with unset_fake_temporarily():
        seeds = torch.zeros(n, dtype=torch.int64)
    return seeds.to(where)


def cache_fill_report(sim: Any, training_peak: int) -> dict[str, Any] | None:
    """What the plan says of an encoder cache's pre-pass (None when no plugin caches an encode step):
    whether the cache was read, its entries per part, the parts the pre-pass encodes, its device peak
    beside training's, and which is the run's peak."""
    ctx = sim.ctx
    counted = {p: list(n) for p, n in ctx.facts.cache_entries.items()}
    if not ctx.facts.cached_parts and not sim.cache_fill:
        return None
    fill = sim.cache_fill or {"parts": [], "peak_bytes": 0}
    on_host = bool(ctx.notes.get("cache fill on the host"))  # offload.park.fill=host: no device bytes
    host_parts = fill.get("host_parts") or (  # a trainer the planner cannot encode for: the parts to fill
        [p for p, (n, m) in counted.items() if n < m] if counted else sorted(ctx.facts.cached_parts))
    return {"read": bool(counted), "entries": counted, "parts": fill["parts"], "peak_bytes": fill["peak_bytes"],
            "host_parts": host_parts if on_host else [],
            "training_peak_bytes": training_peak,
            "run_peak": "pre-pass" if fill["parts"] and fill["peak_bytes"] >= training_peak else "training"}
