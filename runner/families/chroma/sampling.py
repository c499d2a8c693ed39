"""Sampling for Chroma: ``ChromaPipeline`` with classifier-free guidance (Chroma is not guidance-distilled)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.families.common.loading import pipeline_class
from runner.sampling.pipelines import VaeOnDevice, _GuidedFlowSampling, decode


class ChromaSampling(_GuidedFlowSampling):
    """``ChromaPipeline`` with FLUX.1's flow-matching scheduler (or the folder's own), and
    classifier-free guidance (Chroma is not guidance-distilled): the pipeline's default 5.0."""

    factor = 16  # VAE factor 8 times the 2x2 latent packing
    default_guidance = 5.0
    negative_prompt = True

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor], negative: dict | None, *,
                 steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        vae = modules["vae"]
        pipe = pipeline_class("ChromaPipeline")(scheduler=self.scheduler(trainer), vae=vae, text_encoder=None,
                                                tokenizer=None, transformer=modules["transformer"])
        pipe.set_progress_bar_config(disable=True)
        dtype = next(modules["transformer"].parameters()).dtype

        def embeds(c: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            return c["prompt_embeds"].to(device), c["prompt_attention_mask"].to(device, dtype)

        kw: dict[str, Any] = {}
        if negative is not None:
            kw["negative_prompt_embeds"], kw["negative_prompt_attention_mask"] = embeds(negative)
        prompt_embeds, mask = embeds(cond)
        packed = pipe(prompt_embeds=prompt_embeds, prompt_attention_mask=mask, num_inference_steps=steps,
                      guidance_scale=guidance, height=resolution, width=resolution, generator=generator,
                      output_type="latent", return_dict=False, **kw)[0]
        latents = pipe._unpack_latents(packed, resolution, resolution, pipe.vae_scale_factor)
        image = decode(vae, latents, vae_on_device, shift=float(vae.config.shift_factor or 0.0))
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]
