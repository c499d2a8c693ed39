"""Sampling for SD3.5: ``StableDiffusion3Pipeline`` with classifier-free guidance and SD3.5's flow-matching scheduler."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.families.common.loading import pipeline_class
from runner.sampling.pipelines import VaeOnDevice, _GuidedFlowSampling, _pooled_embeds_latents, decode


class SD3Sampling(_GuidedFlowSampling):
    """``StableDiffusion3Pipeline`` with SD3.5's flow-matching scheduler (shift 3.0, or the folder's own)."""

    factor = 16  # VAE factor 8 times the transformer's 2x2 patches
    negative_prompt = True

    def __init__(self, default_guidance: float = 3.5) -> None:
        self.default_guidance = default_guidance  # the model card's: Large 3.5, Medium 4.5

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor], negative: dict | None, *,
                 steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        vae = modules["vae"]
        pipe = pipeline_class("StableDiffusion3Pipeline")(
            transformer=modules["transformer"], scheduler=self.scheduler(trainer), vae=vae, text_encoder=None,
            tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None)
        latents = _pooled_embeds_latents(pipe, cond, negative, device, steps=steps, guidance=guidance,
                                         resolution=resolution, generator=generator)
        image = decode(vae, latents, vae_on_device, shift=float(vae.config.shift_factor or 0.0))
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]
