"""What the simulated step feeds the trainer: example batches and the parts of its encode step.

The trainer's ``example_raw_batch`` / ``example_batch`` give shape-only tensors on real ``meta``;
here they become fake tensors on the simulated host and move to the simulated device as a data
loader's batch would. When a plugin serves some encode parts from a cache (and removed the
modules computing them), those parts arrive on the device as tensors of the shapes a meta run
of the encoders gave before the plugins ran.
"""
from __future__ import annotations

from typing import Any

import torch

from runner.compat import unset_fake_temporarily
from runner.plan.second_core import Beside
from runner.plan.target import DEVICE
from runner.plan.known_values import known_values

BOOKKEEPING_KEYS = ("sample_seed", "index")  # per-sample ints the protocol reads with tolist()


def fake_batch(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Fake copies on ``device`` of a batch's tensors; per-sample ints stay real CPU tensors."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and k not in BOOKKEEPING_KEYS:
            out[k] = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=device)
        else:
            out[k] = v
    return out


def move_batch(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch's tensors moved to ``device`` (``.to``, as the loop does); per-sample ints stay.

    A boolean tensor is a mask of valid tokens (every example batch's is all true): it arrives as a
    real all-true mask moved to ``device``, so that inside :func:`known_values` it has its value."""
    return {k: ((all_valid(v.shape).to(device) if v.dtype == torch.bool else v.to(device))
                if isinstance(v, torch.Tensor) and k not in BOOKKEEPING_KEYS else v)
            for k, v in batch.items()}


def all_valid(shape: Any) -> torch.Tensor:
    """A real all-true boolean CPU tensor: a mask whose values the planner assumes (every token valid,
    the longest sequence a run can see), made outside the simulation so that its move keeps them."""
    with unset_fake_temporarily():
        return torch.ones(tuple(shape), dtype=torch.bool)


def example_batch(trainer: Any, raw: bool, batch_size: int) -> dict[str, Any]:
    """The trainer's raw (to encode) or encoded example batch, as real shape-only ``meta`` tensors."""
    with unset_fake_temporarily():  # shape-only tensors on real meta; seeds as real CPU ints
        if raw:
            return trainer.example_raw_batch(batch_size, DEVICE)
        batch = trainer.example_batch(batch_size, DEVICE)
        with_mask = getattr(trainer, "with_example_mask", None)  # data.masks: the loss mask lives on the device
        return with_mask(batch) if callable(with_mask) else batch


def encode_part_shapes(trainer: Any, models: Any, micro: int) -> dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """Shapes and dtypes of each cacheable encode part, from a run of the encoders on real ``meta``.

    A plugin may serve some parts from a cache and drop the modules that compute them; the
    simulated step then needs those parts' tensors without the modules. Shape-only meta kernels
    make this a fraction of a second even for T5-XXL. Empty for trainers without the split.
    """
    needed = ("encode_parts", "encode_part", "finish_encode", "example_raw_batch")
    if not all(callable(getattr(trainer, m, None)) for m in needed):
        return {}
    raw = trainer.example_raw_batch(micro, DEVICE)
    shapes: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
    with torch.no_grad(), known_values():  # token ids and masks keep their values (runner/plan/known_values.py)
        for part in trainer.encode_parts():
            out = trainer.encode_part(models, part, raw)
            shapes[part] = {k: (tuple(v.shape), v.dtype) for k, v in out.items() if isinstance(v, torch.Tensor)}
    return shapes


FORK_ABOVE_ELEMENTS = 100_000_000  # encoders this large take ~0.3 s or more on meta: worth a second core


def start_encode_part_shapes(trainer: Any, models: Any, micro: int, redo: Any) -> Beside:
    """:func:`encode_part_shapes`, computed beside the plan's setup where the encoders are large.

    The meta run of the encoders only reads the models as built, and setup only needs its result
    at the first forward, so on a second core it costs the plan nothing (runner/plan/second_core.py).
    ``redo``: the same result computed in place from freshly built models, for when the child
    fails (the parent's models have changed by then); it raises what the in-place call raises.
    """
    specs = trainer.encode_parts() if callable(getattr(trainer, "encode_parts", None)) else {}
    names = {m for spec in specs.values() for m in spec.modules if m in models}
    elements = sum(p.numel() for m in names for p in models[m].parameters())
    # Not after CUDA is initialised (a training run's preflight on a GPU): a forked child cannot use
    # it, and an encoder that asks about the device would fail there and be redone here.
    fork = elements >= FORK_ABOVE_ELEMENTS and not torch.cuda.is_initialized()
    return Beside(lambda: encode_part_shapes(trainer, models, micro), _shapes_to_json, _shapes_from_json,
                  redo=redo, fork=fork)


def _shapes_to_json(shapes: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]) -> Any:
    return {part: {k: [list(shape), str(dtype).removeprefix("torch.")] for k, (shape, dtype) in per.items()}
            for part, per in shapes.items()}


def _shapes_from_json(data: Any) -> dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    return {part: {k: (tuple(shape), getattr(torch, dtype)) for k, (shape, dtype) in per.items()}
            for part, per in data.items()}


def cached_parts(trainer: Any, ctx: Any) -> set[str]:
    """Encode parts the run reads from a cache rather than computes on the device.

    ``ctx.facts.cached_parts`` as the plugins recorded them; a plugin that dropped modules
    without saying which parts it caches is read the only safe way: every part that needs a
    dropped module cannot be computed, so it arrives from a cache.
    """
    if not callable(getattr(trainer, "encode_parts", None)):
        return set()
    missing = {part for part, spec in trainer.encode_parts().items() if any(m not in ctx.models for m in spec.modules)}
    return set(ctx.facts.cached_parts) | missing


def encode_batch(trainer: Any, models: Any, batch: dict[str, Any], cached: set[str],
                 shapes: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]) -> dict[str, Any]:
    """``trainer.encode``, with cached parts arriving on the device as a cache read gives them.

    Token ids and masks keep their values through the encoders (runner/plan/known_values.py), so an
    encoder that reads one (transformers' masking) runs as it does for real."""
    with known_values():
        return _encode(trainer, models, batch, cached, shapes)


def _encode(trainer: Any, models: Any, batch: dict[str, Any], cached: set[str],
            shapes: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]) -> dict[str, Any]:
    if not cached:
        return trainer.encode(models, batch)
    parts = {}
    for part in trainer.encode_parts():
        if part in cached:
            parts[part] = {k: (all_valid(shape).to(DEVICE) if dtype == torch.bool
                               else torch.empty(shape, dtype=dtype, device=DEVICE))
                           for k, (shape, dtype) in shapes[part].items()}
        else:
            parts[part] = trainer.encode_part(models, part, batch)
    return trainer.finish_encode(parts, batch)
