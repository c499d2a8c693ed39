"""``data.random_flip``: a horizontal flip decided afresh on every visit of a sample.

Each time the runner puts a sample into a batch, that visit has its own seed (``sample_seed``,
derived from the sample's global position in the run: runner/loop.py ``SampleOrder``), and the
coin is a hash of that seed. So an image is seen mirrored in about half of its visits, not in a
fixed orientation for the whole run, and still:

* the run is reproducible from ``train.seed``, and a resumed run flips exactly as the run it
  continues would have (the position, hence the seed, is the same);
* a step cut into micro-batches (gradient accumulation, the OOM retry) flips the same samples:
  the whole step's raw batch is flipped before it is split.

The flip is applied by the runner to the collated batch (``pixel_values`` and, with ``data.masks``,
the loss ``mask``, mirrored along their last axis: width, for images and video frames alike), which also carries ``flip`` (one bool per
sample) for whoever needs to know: the encoder cache (``offload=park``) stores both orientations
of each image, as kohya's ``flip_aug`` does, and reads the one each visit asks for, so cached and
uncached runs give bit-identical losses (tests/plugins/park/test_park.py).

Disabled (the default) it is :data:`NO_FLIP`, whose ``apply`` returns the batch untouched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runner.data.images import _mix

_SALT_VISIT_FLIP = 5
# What a flipped visit mirrors: the pixels, their loss mask (data.masks) and their reference images
# (data.references, [B, N, 3, H, W]: the same flip as the target, so the edit stays aligned).
FLIPPED = ("pixel_values", "mask", "references")  # the per-index salts of runner/data/images.py are 1..4


def flips_on_visit(sample_seed: int) -> bool:
    """Whether the visit with ``sample_seed`` is mirrored: a fair coin, a pure function of the seed
    (splitmix64, independent of the noise and timestep drawn from the same seed)."""
    return bool(_mix(int(sample_seed), _SALT_VISIT_FLIP) & 1)


def flip_rows(pixels: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """``pixels`` with the rows where ``flip`` is true mirrored along the last axis (a new tensor
    when any row flips; exact, a permutation of values)."""
    if not bool(flip.any()):
        return pixels
    out = pixels.clone()
    out[flip] = torch.flip(pixels[flip], dims=[-1])
    return out


def flip_batch(batch: dict[str, Any], flip: torch.Tensor) -> dict[str, Any]:
    """``batch`` with the rows where ``flip`` is true mirrored in each of :data:`FLIPPED` it holds (in place)."""
    for key in FLIPPED:
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            batch[key] = flip_rows(value, flip)
    return batch


@dataclass(frozen=True)
class VisitFlip:
    """The run's ``data.random_flip`` (see the module docstring)."""

    enabled: bool = False

    def mask(self, sample_seeds: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self.enabled and flips_on_visit(s) for s in sample_seeds.tolist()], dtype=torch.bool)

    def apply(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Add ``flip`` to a raw batch (it must hold ``sample_seed``) and mirror its flipped rows' pixels,
        and their loss masks (``data.masks``) with them, so a mask keeps covering its pixels."""
        if not self.enabled:
            return batch
        flip = self.mask(batch["sample_seed"])
        batch["flip"] = flip
        return flip_batch(batch, flip)

    def describe(self) -> str:
        return "; random horizontal flip on every visit (from each sample's seed)" if self.enabled else ""


NO_FLIP = VisitFlip(False)


def visit_flip(data_cfg: Any) -> VisitFlip:
    """The flip ``cfg.data`` asks for."""
    enabled = bool(data_cfg.get("random_flip", False)) if data_cfg is not None and hasattr(data_cfg, "get") else False
    return VisitFlip(True) if enabled else NO_FLIP
