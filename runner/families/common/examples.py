"""Example batches for the planner and the tests: shapes at the planned size, seeded values off meta.

A mixin of :class:`runner.families.common.base.DiffusersTrainer`; it reads ``cfg.data``, ``masks``, ``references``
and the VAE config through ``component_config`` of the trainer it is mixed into.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from runner.errors import UserError
from runner.families.common.latents import vae_scale_factor
from runner.trainer import Batch


class ExampleBatches:
    """Example inputs at :meth:`planned_size`: raw batches, latents, seeds and masks."""

    cfg: Any
    masks: bool
    references: int

    component_config: Callable[[str], dict[str, Any]]  # the trainer's (base.py)

    def resolution(self) -> int:
        return int(self.cfg.data.resolution)

    def planned_size(self) -> tuple[int, int]:
        """(height, width) of the example batches: ``data.resolution`` square, or the largest size
        a sample can have with aspect-ratio buckets or per-set resolutions (runner/data)."""
        from runner.data import planned_size

        return planned_size(self.cfg.data)[0]

    def check_sizes(self, multiple: int, why: str) -> None:
        """Every output size the data can produce must be a multiple of ``multiple`` pixels."""
        from runner.data import check_options

        o = check_options(self.cfg.data)
        for n, s in enumerate(o.sets):
            if s["resolution"] and s["resolution"] % multiple:
                raise UserError(f"data.sets[{n}].resolution={s['resolution']} is not usable for {type(self).__name__}: "
                                f"it must be a multiple of {multiple} ({why}).")
        if o.buckets and o.bucket_step % multiple:
            raise UserError(f"data.bucket_step={o.bucket_step} is not usable for {type(self).__name__}: bucket sides "
                            f"must be multiples of {multiple} ({why}), e.g. data.bucket_step=64.")

    @staticmethod
    def example_tensor(
        shape: tuple[int, ...], device: str | torch.device, dtype: torch.dtype, seed: int = 0
    ) -> torch.Tensor:
        """Shape-only on meta; seeded standard-normal values elsewhere, so a loss is finite."""
        if torch.device(device).type == "meta":
            return torch.empty(shape, device="meta", dtype=dtype)
        g = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    @staticmethod
    def example_seeds(batch_size: int, device: str | torch.device) -> torch.Tensor:
        """Seeds stay on the CPU for ``meta``: the per-sample draws read them with ``tolist()``."""
        dev = "cpu" if torch.device(device).type == "meta" else device
        return torch.arange(batch_size, dtype=torch.int64, device=dev)

    def example_latents(self, batch_size: int, device: str | torch.device) -> torch.Tensor:
        """Latents as :meth:`finish_encode` gives them at :meth:`planned_size` (float32)."""
        vae_cfg = self.component_config("vae")
        factor = vae_scale_factor(vae_cfg)
        h, w = self.planned_size()
        return self.example_tensor((batch_size, int(vae_cfg["latent_channels"]), h // factor, w // factor), device,
                                   torch.float32, 0)

    def example_raw_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """A raw batch as the data loader gives it at :meth:`planned_size`, for the planner's encode step.

        Captions are padded to the tokenizers' fixed lengths, so their text does not change any shape.
        """
        h, w = self.planned_size()
        batch = {
            "pixel_values": self.example_tensor((batch_size, 3, h, w), device, torch.float32, 3),
            "caption": ["an example caption"] * batch_size,
            "index": self.example_seeds(batch_size, device),
            "sample_seed": self.example_seeds(batch_size, device),
        }
        if self.masks:  # data.masks: the loss mask travels with the pixels (float32, one channel)
            batch["mask"] = self.example_tensor((batch_size, 1, h, w), device, torch.float32, 4).sigmoid()
        if self.references:  # data.references: the target's size, N per sample
            batch["references"] = self.example_tensor((batch_size, self.references, 3, h, w), device, torch.float32, 6)
        return batch

    def with_example_mask(self, batch: Batch) -> Batch:
        """An encoded example batch with the ``loss_mask`` that :meth:`finish_encode` adds under
        ``data.masks`` (float32 ``[B, 1, h, w]`` on the latent grid), for the planner; unchanged without."""
        latents = batch.get("latents")
        if not self.masks or "loss_mask" in batch or not isinstance(latents, torch.Tensor):
            return batch
        b, _, lh, lw = latents.shape
        return {**batch, "loss_mask": self.example_tensor((b, 1, lh, lw), latents.device, torch.float32, 5).sigmoid()}
