"""The transformer call FLUX.1-shaped DiTs share (FLUX.1, FLUX.1 Kontext, Chroma).

Latents are packed 2x2 into tokens with ``FluxPipeline``'s own helpers, the text tokens get zero
position ids, the image tokens the pipeline's per-token ids, and ``t`` in (0, 1) goes in as the
compute dtype (the model multiplies by 1000 itself). A family supplies its image tokens, their ids and
its own inputs (:meth:`PackedDiTTrainer.dit_inputs`); the output is cut back to the target's tokens.
"""
from __future__ import annotations

from typing import Any

import torch

from runner.families.common.flow import FlowMatchTrainer
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.trainer import Batch, ModelSet


def _pack_latents(latents: torch.Tensor) -> torch.Tensor:
    b, c, h, w = latents.shape
    return pipeline_class("FluxPipeline")._pack_latents(latents, b, c, h, w)


def _image_ids(h: int, w: int, device: torch.device) -> torch.Tensor:
    """2-D (tokens, 3) ids, as recent diffusers expects; float32 so large grids stay exact."""
    return pipeline_class("FluxPipeline")._prepare_latent_image_ids(1, h // 2, w // 2, device, torch.float32)


class PackedDiTTrainer(FlowMatchTrainer):
    """A flow-matching trainer whose denoiser is a FLUX.1-shaped transformer (``predict`` shared)."""

    def dit_inputs(self, transformer: Any, noisy: torch.Tensor, batch: Batch,
                   dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """(image tokens in ``dt``, their ids, the family's other transformer inputs)."""
        raise NotImplementedError(f"{type(self).__name__} must implement dit_inputs")

    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        transformer = models["transformer"]
        dt = compute_dtype(transformer)
        prompt_embeds = batch["prompt_embeds"]
        b, _, h, w = noisy.shape
        tokens = (h // 2) * (w // 2)  # the target's packed tokens: any joined after them are conditioning
        hidden, ids, extra = self.dit_inputs(transformer, noisy, batch, dt)
        out = transformer(
            hidden_states=hidden,
            timestep=timesteps.to(dt),
            encoder_hidden_states=prompt_embeds.to(dt),
            txt_ids=torch.zeros(prompt_embeds.shape[1], 3, device=noisy.device, dtype=torch.float32),
            img_ids=ids,
            return_dict=False,
            **extra,
        )[0]
        return out if out.shape[1] == tokens else out[:, :tokens]
