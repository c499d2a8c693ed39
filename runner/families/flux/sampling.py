"""Sampling for FLUX.1: ``FluxPipeline`` around the transformer in memory, with FLUX.1-dev's scheduler
or the folder's."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.sampling.pipelines import VaeOnDevice, _folder_scheduler, _quiet_pipelines, _text, decode
from runner.trainer import ModelSet

# FLUX.1-dev's scheduler (scheduler/scheduler_config.json of the published folder), used when
# model.path has no scheduler/ subfolder: the resolution-dependent shift is part of the model.
FLUX_SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                      base_image_seq_len=256, max_image_seq_len=4096)


class FluxSampling:
    """``FluxPipeline`` with FLUX.1-dev's flow-matching scheduler (or the folder's own)."""

    factor = 16  # VAE factor 8 times the 2x2 latent packing
    default_guidance = 3.5
    negative_prompt = False  # guidance-distilled: no classifier-free guidance

    @staticmethod
    def denoiser_batch(guidance: float) -> int:
        return 1  # the guidance scale is an input of the model, not a second pass

    @staticmethod
    def default_negative(guidance: float) -> str | None:
        return None  # no classifier-free guidance

    def encode(self, trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        return _text(trainer, models, prompt, device)

    def scheduler(self, trainer: Any) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return _folder_scheduler(trainer, FlowMatchEulerDiscreteScheduler) or FlowMatchEulerDiscreteScheduler(
            **FLUX_SCHEDULER)

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor], negative: dict | None, *,
                 steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        _, flux = _quiet_pipelines()
        vae = modules["vae"]
        pipe = flux(scheduler=self.scheduler(trainer), vae=vae, text_encoder=None, tokenizer=None,
                    text_encoder_2=None, tokenizer_2=None, transformer=modules["transformer"])
        pipe.set_progress_bar_config(disable=True)
        packed = pipe(prompt_embeds=cond["prompt_embeds"].to(device),
                      pooled_prompt_embeds=cond["pooled_prompt_embeds"].to(device),
                      num_inference_steps=steps, guidance_scale=guidance, height=resolution, width=resolution,
                      generator=generator, output_type="latent", return_dict=False)[0]
        latents = pipe._unpack_latents(packed, resolution, resolution, pipe.vae_scale_factor)
        image = decode(vae, latents, vae_on_device, shift=float(vae.config.shift_factor or 0.0))
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]
