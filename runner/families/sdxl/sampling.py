"""Sampling for SDXL: ``StableDiffusionXLPipeline`` around the U-Net in memory, fed the trainer's own text embeddings."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.sampling.pipelines import (
    VaeOnDevice,
    _folder_scheduler,
    _pooled_embeds_latents,
    _quiet_pipelines,
    _text,
    decode,
)
from runner.trainer import ModelSet


class SDXLSampling:
    """``StableDiffusionXLPipeline`` with an Euler scheduler on the trainer's noise schedule."""

    factor = 8  # sample.resolution must be a multiple of the VAE factor
    default_guidance = 5.0
    negative_prompt = True

    @staticmethod
    def denoiser_batch(guidance: float) -> int:
        """Samples per U-Net call: the pipeline runs the unconditional and conditional halves
        together when guidance > 1 (classifier-free guidance)."""
        return 2 if guidance > 1 else 1

    @staticmethod
    def default_negative(guidance: float) -> str | None:
        """No negative prompt unless one is set: SDXL's pipeline uses zeros for an empty one
        (``force_zeros_for_empty_prompt``)."""
        return None

    def encode(self, trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        return _text(trainer, models, prompt, device)

    def scheduler(self, trainer: Any) -> Any:
        from diffusers import EulerDiscreteScheduler

        # The training schedule (betas, prediction type) with SDXL's inference spacing.
        return _folder_scheduler(trainer, EulerDiscreteScheduler) or EulerDiscreteScheduler.from_config(
            trainer.scheduler(torch.device("cpu")).config, timestep_spacing="leading", steps_offset=1)

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor], negative: dict | None, *,
                 steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        sdxl, _ = _quiet_pipelines()
        vae = modules["vae"]
        pipe = sdxl(vae=vae, text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None,
                    unet=modules["unet"], scheduler=self.scheduler(trainer), add_watermarker=False)
        latents = _pooled_embeds_latents(pipe, cond, negative, device, steps=steps, guidance=guidance,
                                         resolution=resolution, generator=generator)
        image = decode(vae, latents, vae_on_device)
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]
