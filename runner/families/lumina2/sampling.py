"""Sampling for Lumina 2: diffusers' ``Lumina2Pipeline`` around the transformer being trained.

As every family (runner/sampling/pipelines.py): the prompt's conditioning is the trainer's own
``encode_part`` (embeddings and the tokenizer's mask, which the pipeline takes as they are), the
pipeline runs with no text encoder and ``output_type="latent"``, and the VAE decode is ours.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.sampling.pipelines import VaeOnDevice, _GuidedFlowSampling, decode


class Lumina2Sampling(_GuidedFlowSampling):
    """``Lumina2Pipeline`` with Lumina-Image-2.0's scheduler (static shift 6.0, or the folder's own), and its
    classifier-free guidance (separate conditional and unconditional calls) above 1: the pipeline's 4.0."""

    factor = 16  # VAE factor 8 times the transformer's 2x2 patches
    default_guidance = 4.0
    negative_prompt = True

    @staticmethod
    def denoiser_batch(guidance: float) -> int:
        return 1  # the pipeline calls the transformer once for each half

    # default_negative, encode and scheduler: _GuidedFlowSampling's (an empty negative prompt above
    # guidance 1, the trainer's text encoding, the folder's flow-matching scheduler or the trainer's)

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor],
                 negative: dict | None, *, steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        vae = modules["vae"]
        pipe = trainer.pipeline_class()(scheduler=self.scheduler(trainer), vae=vae, text_encoder=None, tokenizer=None,
                                        transformer=modules["transformer"])
        pipe.set_progress_bar_config(disable=True)
        kw: dict[str, Any] = {}
        if negative is not None:
            kw = {"negative_prompt_embeds": negative["prompt_embeds"].to(device),
                  "negative_prompt_attention_mask": negative["prompt_attention_mask"].to(device)}
        latents = pipe(prompt_embeds=cond["prompt_embeds"].to(device),
                       prompt_attention_mask=cond["prompt_attention_mask"].to(device), guidance_scale=guidance,
                       num_inference_steps=steps, height=resolution, width=resolution, generator=generator,
                       output_type="latent", return_dict=False, **kw)[0]
        image = decode(vae, latents, vae_on_device, shift=float(vae.config.shift_factor or 0.0))
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]
