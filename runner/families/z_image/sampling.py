"""Sampling for Z-Image: diffusers' ``ZImagePipeline`` around the transformer being trained.

As every family (runner/sampling/pipelines.py): the prompt's conditioning is the trainer's own
``encode_part`` (cut to the caption's tokens, the pipeline's unpadded per-prompt form), the
pipeline runs with no text encoder and ``output_type="latent"``, and the VAE decode is ours.

Guidance: Z-Image-Turbo is distilled to sample without classifier-free guidance (its model card:
``guidance_scale=0.0``, 9 steps), so the default is 0; above 0 the pipeline runs its CFG
(``pos + g * (pos - neg)``, an unconditional half of the transformer's batch) with an empty
negative prompt unless ``sample.negative_prompt`` gives one.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.sampling.pipelines import VaeOnDevice, _GuidedFlowSampling, _text, decode
from runner.trainer import ModelSet


class ZImageSampling(_GuidedFlowSampling):
    """``ZImagePipeline`` with Z-Image-Turbo's scheduler (static shift 3.0, or the folder's own)."""

    factor = 16  # VAE factor 8 times the transformer's 2x2 patches
    default_guidance = 0.0  # Z-Image-Turbo's model card
    negative_prompt = True

    @staticmethod
    def denoiser_batch(guidance: float) -> int:
        return 2 if guidance > 0 else 1  # the pipeline's CFG runs when guidance_scale > 0

    @staticmethod
    def default_negative(guidance: float) -> str | None:
        return "" if guidance > 0 else None  # the pipeline's own default negative prompt

    def encode(self, trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        out = _text(trainer, models, prompt, device)
        n = int(out["prompt_embeds_mask"][0].sum())
        return {"prompt_embeds": out["prompt_embeds"][0, :n]}

    # scheduler: _GuidedFlowSampling's (the folder's flow-matching scheduler, else the trainer's)

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor],
                 negative: dict | None, *, steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        vae = modules["vae"]
        pipe = trainer.pipeline_class()(scheduler=self.scheduler(trainer), vae=vae, text_encoder=None, tokenizer=None,
                                        transformer=modules["transformer"])
        pipe.set_progress_bar_config(disable=True)
        kw: dict[str, Any] = {}
        if negative is not None:
            kw["negative_prompt_embeds"] = [negative["prompt_embeds"].to(device)]
        latents = pipe(prompt_embeds=[cond["prompt_embeds"].to(device)], guidance_scale=guidance,
                       num_inference_steps=steps, height=resolution, width=resolution, generator=generator,
                       output_type="latent", return_dict=False, **kw)[0]
        image = decode(vae, latents, vae_on_device, shift=float(vae.config.shift_factor or 0.0))
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]

