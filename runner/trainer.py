"""The public trainer protocol (managed mode).

A trainer describes *what* is trained; the runner owns *how*: the loop, the optimizer, device
placement, precision, micro-batching, checkpoints and every memory plugin. A user's own trainer
implements the four required methods below and is selected with
``trainer._target_=my_module.MyTrainer`` or through the ``runner.trainers`` entry point group.

Contract, in the order the runner calls it:

1. ``__init__(cfg)`` receives the whole composed run config (``cfg.model``, ``cfg.data``,
   ``cfg.trainer`` ...). It must not allocate models yet.
2. ``build_models(device)`` returns a :class:`ModelSet`. ``device="meta"`` is used by the
   planner: build the same modules without allocating storage.
3. ``dataset()`` returns a map-style dataset of per-sample dicts. The runner decides the
   sample order (seeded, resumable) and slices batches itself, so that micro-batches can be
   split after an out-of-memory error without skipping or repeating a sample.
   ``runner.data.build_dataset(cfg.data)`` gives a trainer every ``data.*`` option (captions,
   buckets, several sets): its datasets also offer ``visit(i, seed)``, ``group_of(i)`` and
   ``set_layout()``, which the runner uses when present (runner/data/__init__.py).
4. ``encode(models, batch)`` (optional) turns raw samples into conditioning with the frozen
   models (VAE, text encoders) under ``no_grad``. Keeping it apart from ``loss`` is what lets the
   caching/parking plugins replace or relocate that work.
5. ``loss(models, batch)`` returns a scalar loss for the batch (mean over samples).
6. ``example_batch(batch_size, device)`` returns an *encoded* batch with the right shapes,
   for the planner; tensors may live on ``meta``.
7. ``example_raw_batch(batch_size, device)`` (optional, with ``encode``) returns a *raw* batch
   as the data loader gives it (``pixel_values``, ``caption``, ``index``, ``sample_seed``) with
   the shapes of ``data.resolution``; tensors may live on ``meta``. The planner (runner/plan/)
   then simulates ``encode`` on the device too: the frozen encoders' weights and their
   activations (the VAE at 1024 px) are part of a real step unless a plugin caches their
   outputs. Keep ``sample_seed`` (and ``index``) on the CPU for ``meta``: they are read with
   ``tolist()``.

Randomness: ``batch["sample_seed"]`` holds one int64 seed per sample. Draw per-sample noise
with :func:`per_sample_randn` so that the result does not depend on how a batch is split.

Cacheable encoding (optional; what ``offload=park`` needs to cache latents and embeddings).
A trainer splits ``encode`` into named parts, each a deterministic function of some raw inputs,
and a cheap final step that adds the per-sample randomness:

* ``encode_parts()`` -> ``{part: EncodePart(modules, inputs)}``: which frozen modules compute
  the part and which raw batch keys (``pixel_values``, ``caption``) it reads;
* ``encode_part(models, part, batch)`` -> ``{name: tensor}``, one row per sample, no randomness
  (for a VAE: the posterior's mean and std, not a sample);
* ``finish_encode(parts, batch)`` -> the encoded batch; uses no frozen module, only
  ``batch["sample_seed"]`` (and non-pixel keys), so cached parts give the same result;
* ``cache_signature(part)`` -> a JSON-able dict of every setting that changes the part's result.

``encode`` must equal ``finish_encode({p: encode_part(models, p, batch) for p in parts}, batch)``.

Reference images (optional; an edit trainer: "target = instruction applied to the references").
A trainer that takes reference images per target declares two class attributes (``__init__`` may
change ``max_references``, as Qwen-Image-Edit's variant does; ``default_references`` is read from the
class before the trainer is built, to check a data folder as the trainer will read it):

* ``max_references``: the most it takes per target (``data.references`` above it is refused);
* ``default_references``: how many an unset ``data.references`` trains on (1 for an edit model that
  needs its reference, as the built-in Kontext and Qwen-Image-Edit; 0 when references are optional).

:func:`reference_count` resolves ``data.references`` against them, the trainer reads its count from
it, and builds its data with ``runner.data.build_dataset(cfg.data, references=count)``: each sample
then carries ``references``, float32 ``[N, 3, H, W]`` in [-1, 1] (``[B, N, 3, H, W]`` in a batch),
found as ``control/<stem>.png`` or ``<stem>_ref1.png`` beside each image and resized, cropped,
bucketed and flipped with its target (runner/data/references.py); the demo set pairs grey copies.
``example_batch`` (and ``example_raw_batch``) carry ``references`` of that shape at the planned size
(``runner.data.planned_size(cfg.data)``), so the planner counts their bytes and what the model does
with them. The runner refuses, in one paragraph naming the key: ``data.references`` above
``max_references`` when the trainer is built, so before a plan too (a trainer that declares nothing
takes none, so a reference would be ignored); a target without its references and a reference
beyond the count when the data folder is checked, before the model build of a training run.

Optional hooks of a trainer with more than one trained module, not all on the device at once
(Wan 2.2 A14B's two experts, runner/families/wan/experts.py):

* ``place_models(ctx)``: called after the plugins' ``place_models`` phase, before the runner moves
  the modules no one placed to the device; a module it adds to ``ctx.facts.placed`` stays where the
  trainer put it (the planner runs it too, so the plan sees that placement);
* ``on_step_start(ctx, step)``: called by the loop before each optimizer step's batch (``step``
  0-based, after the plugins' ``on_step_start``): what changes for the whole step, every micro-batch;
* ``write_lora_exports(pipeline_class, models, folder, info, export_config)``: the LoRA files of
  every trained module (runner/export/checkpoint.py), the names written.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

Batch = dict[str, Any]


@dataclass
class ModelSet:
    """Named modules of one trainer, and which of them are trained.

    ``trained`` names modules that have trainable parameters (full fine-tune or LoRA); every
    other module is frozen and may be quantized, parked on the host or skipped entirely when
    its outputs are cached. ``blocks`` optionally names, per module, the repeated blocks that
    checkpointing and offload plugins should operate on (default: runner.blocks finds them).
    With ``model.train=lora`` the runner attaches LoRA to the trained modules unless the trainer
    did (runner/parts.py).
    """

    modules: dict[str, nn.Module]
    trained: set[str] = field(default_factory=set)
    blocks: dict[str, list[nn.Module]] = field(default_factory=dict)
    # True when the trainer built every module in the run's dtypes itself (the built-in trainers
    # convert on load); otherwise the runner casts frozen modules to model.dtype and trained ones
    # to model.train_dtype (runner/parts.py).
    dtypes_applied: bool = False
    # Modules built with their parameters on meta whose weights a quantization plugin reads layer by
    # layer as it replaces them; the runner reads the rest after ``transform_models``
    # (runner/meta_weights.py). Name -> UnreadWeights; empty unless the run loads a base that way.
    unread: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> nn.Module:
        return self.modules[name]

    def __contains__(self, name: str) -> bool:
        return name in self.modules

    def items(self) -> Iterable[tuple[str, nn.Module]]:
        return self.modules.items()

    def frozen(self) -> dict[str, nn.Module]:
        return {n: m for n, m in self.modules.items() if n not in self.trained}

    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        for name in sorted(self.trained):
            for p in self.modules[name].parameters():
                if p.requires_grad:
                    yield p

    def named_trainable_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for name in sorted(self.trained):
            for pname, p in self.modules[name].named_parameters():
                if p.requires_grad:
                    yield f"{name}.{pname}", p


@runtime_checkable
class Trainer(Protocol):
    """What a managed-mode trainer implements. See the module docstring for the contract."""

    def build_models(self, device: str | torch.device = "cpu") -> ModelSet: ...

    def dataset(self) -> Any: ...

    def loss(self, models: ModelSet, batch: Batch) -> torch.Tensor: ...

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch: ...


def reference_count(trainer: Any, cfg: Any, other: str | None = None) -> int:
    """How many reference images per target ``trainer`` (an instance or its class) trains on under
    ``cfg``: ``data.references``, or the trainer's ``default_references`` when unset; a UserError when
    it is above the trainer's ``max_references`` (0 when it declares none) or the declaration is not
    valid. One rule for every trainer (runner/data/checks.py, as the built-in families use it), so a
    preset that leaves ``data.references`` unset gives an edit trainer its own count and any other
    trainer none. ``other``: what else the message offers when the trainer takes no references."""
    from runner.data.checks import DECLARE, check_reference_declaration, family_references

    cls = trainer if isinstance(trainer, type) else type(trainer)
    name = str(getattr(trainer, "display_name", "") or cls.__name__)
    most, default = check_reference_declaration(getattr(trainer, "max_references", 0),
                                                getattr(trainer, "default_references", 0), name)
    data = cfg.get("data") if hasattr(cfg, "get") else getattr(cfg, "data", None)
    return family_references(data, most, name, default, DECLARE if other is None else other)


def encode(trainer: Any, models: ModelSet, batch: Batch) -> Batch:
    """Call the trainer's optional ``encode`` step; identity when the trainer has none."""
    fn = getattr(trainer, "encode", None)
    return fn(models, batch) if fn is not None else batch


@dataclass(frozen=True)
class EncodePart:
    """One cacheable piece of a trainer's encode step (see the module docstring)."""

    modules: tuple[str, ...]  # frozen modules that compute it, e.g. ("vae",)
    inputs: tuple[str, ...]  # raw batch keys it reads, e.g. ("pixel_values",)


def batch_device(batch: Mapping[str, Any]) -> torch.device:
    """The compute device of a batch: that of its pixels, else of its per-sample seeds."""
    t = batch.get("pixel_values")
    if not isinstance(t, torch.Tensor):
        t = batch["sample_seed"]
    return t.device


def salted(seeds: torch.Tensor, salt: int) -> torch.Tensor:
    """Derived per-sample seeds, so two draws from one sample's seed are independent.

    Without it the VAE posterior sample and the diffusion noise of a sample would be the *same*
    numbers (same seed, same shape).
    """
    return torch.tensor([(int(s) * 7_919_007 + salt) % (1 << 62) for s in host_list(seeds)], dtype=torch.int64)


def per_sample_randn(
    seeds: torch.Tensor, shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype
) -> torch.Tensor:
    """Noise of shape ``(len(seeds), *shape)`` where row i depends only on ``seeds[i]``.

    Generated on the CPU (one generator per sample, cheap at these sizes) and moved, so the
    numbers are identical on every device and for every micro-batch split.
    """
    rows = []
    for s in _seed_values(seeds):
        g = None if s is None else torch.Generator().manual_seed(int(s))
        rows.append(torch.randn(shape, generator=g, dtype=torch.float32))
    return torch.stack(rows).to(device=device, dtype=dtype)


def _seed_values(seeds: torch.Tensor) -> list[int | None]:
    """The seeds as numbers; under the planner's fake tensors (a seed computed inside the planned step)
    a None per row: the draws then have the real path's shapes and bytes, without values."""
    from runner.compat import is_fake

    return [None] * len(seeds) if is_fake(seeds) else host_list(seeds)


def per_sample_rand(seeds: torch.Tensor, salt: int, device: torch.device | str) -> torch.Tensor:
    """One uniform [0, 1) number per sample, independent of the noise drawn from the same seed."""
    out = []
    for s in _seed_values(seeds):
        g = None if s is None else torch.Generator().manual_seed(int(s) * 1_000_003 + salt)
        out.append(torch.rand((), generator=g))
    return torch.stack(out).to(device)


def move_batch(batch: Mapping[str, Any], device: torch.device | str) -> Batch:
    """Move every tensor of a batch to ``device``; other values are kept as they are. A moved tensor
    keeps its host original (:func:`host_list` reads it), so reading per-sample seeds or indices on
    the host is not a device-to-host copy that waits for the card."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            moved = v.to(device)
            if moved is not v:
                moved._runner_host = v  # type: ignore[attr-defined]
            v = moved
        out[k] = v
    return out


def host_list(t: torch.Tensor) -> list[Any]:
    """``t.tolist()``, from the host original :func:`move_batch` kept when there is one (no host sync)."""
    return getattr(t, "_runner_host", t).tolist()


def slice_batch(batch: Mapping[str, Any], start: int, stop: int) -> Batch:
    """Rows ``start:stop`` of a batch (tensors and lists alike)."""
    return {k: v[start:stop] if isinstance(v, (torch.Tensor, list, tuple)) else v for k, v in batch.items()}


def batch_len(batch: Mapping[str, Any]) -> int:
    return len(batch["sample_seed"])
