"""The encoders' pre-pass a plugin runs in setup, planned: park filling its encoder cache on a first run.

Why: park encodes the whole data set before step 1 (plugins/park/cache.py:fill_cache), one batch of
``offload.park.encode_batch_size`` per call, each part's encoders on the device for their call. The
plan used to start after it, so a first run could need more than its plan (``train.device=cuda_sim``
showed it: a tiny Lumina 2's text encoder, with eager attention, peaked at 2.4x the planned step).
Trade-off: the plan assumes a first run (nothing cached yet), the run that needs the most.
"""
from __future__ import annotations

from typing import Any

import torch

from runner.compat import FAKE_VALUE_ERRORS, unset_fake_temporarily
from runner.plan.batch import example_batch, fake_batch, move_batch
from runner.plan.target import DEVICE, HOST
from runner.plan.values import known_values


def simulate_cache_fill(sim: Any, parts: list[str], batch_size: int) -> None:
    """A plugin's encoding pre-pass in setup (park fills its encoder cache on a first run:
    plugins/park/cache.py:fill_cache): one batch of ``batch_size`` per part, each part's encoders as
    the plugin left them (parked: on the device for their call only), under autocast and no_grad.
    Its peak is the setup phase's ("setup, in cache fill"): before this, a cache-filling first run
    could need more than the planned step (a text encoder's eager attention, or its weights)."""
    trainer, ctx, tracker = sim.trainer, sim.ctx, sim.tracker
    if not callable(getattr(trainer, "example_raw_batch", None)):
        return
    specs = trainer.encode_parts()
    host_batch = fake_batch(example_batch(trainer, True, batch_size), HOST)
    skipped = []
    with known_values(), tracker.phase("cache fill", category="activations"):
        for part in parts:
            keep = set(specs[part].inputs) | {"sample_seed"}
            batch = move_batch({k: v for k, v in host_batch.items() if k in keep}, DEVICE)
            batch["sample_seed"] = device_seeds(batch_size)  # as fill_cache: a text-only part computes on the device
            try:
                with ctx.accelerator.autocast(), torch.no_grad():
                    out = trainer.encode_part(ctx.models, part, batch)
                del out
            except FAKE_VALUE_ERRORS as e:  # an encoder that reads values (Qwen2.5-VL's image grid)
                skipped.append(f"{part} ({type(e).__name__})")
            del batch
    del host_batch
    if skipped:
        sim.notes["cache fill"] = ("first-run encoder pre-pass not planned for " + ", ".join(skipped)
                                    + ": its encoder reads values a shape-only plan does not have")


def device_seeds(n: int) -> torch.Tensor:
    """``n`` zero seeds on the simulated device, as park's fill_cache gives each encode call: a part
    without pixels (the captions) takes its compute device from them (runner/trainer.py:batch_device).
    A real CPU tensor moved inside :func:`known_values`, so the value stays readable."""
    with unset_fake_temporarily():
        seeds = torch.zeros(n, dtype=torch.int64)
    return seeds.to(DEVICE)
