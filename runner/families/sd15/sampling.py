"""Sampling for SD1.5 / SD2.1: ``StableDiffusionPipeline`` with the empty negative prompt precomputed."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.families.common.loading import pipeline_class
from runner.families.sdxl.sampling import SDXLSampling
from runner.sampling.pipelines import VaeOnDevice, decode


class SD15Sampling(SDXLSampling):
    """``StableDiffusionPipeline`` (SD1.5, SD2.1) with an Euler scheduler on the trainer's noise schedule."""

    default_guidance = 7.5  # the pipeline's default

    @staticmethod
    def default_negative(guidance: float) -> str | None:
        """The empty prompt, as the pipeline's unconditional half, when guidance is on (its
        ``encode_prompt`` would need the tokenizer and text encoder otherwise)."""
        return "" if guidance > 1 else None

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor], negative: dict | None, *,
                 steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        vae = modules["vae"]
        pipe = pipeline_class("StableDiffusionPipeline")(
            vae=vae, text_encoder=None, tokenizer=None, unet=modules["unet"], scheduler=self.scheduler(trainer),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        kw: dict[str, Any] = {}
        if negative is not None:
            kw = {"negative_prompt_embeds": negative["prompt_embeds"].to(device)}
        latents = pipe(prompt_embeds=cond["prompt_embeds"].to(device), num_inference_steps=steps,
                       guidance_scale=guidance, height=resolution, width=resolution, generator=generator,
                       output_type="latent", return_dict=False, **kw)[0]
        image = decode(vae, latents, vae_on_device)
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]
