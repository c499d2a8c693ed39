"""Sampling for HiDream-I1: diffusers' ``HiDreamImagePipeline`` around the transformer being trained.

As every family (runner/sampling/pipelines.py): the prompt's conditioning is the trainer's own
``encode_part`` (pooled CLIP pair, T5, the Llama layer stack, which the pipeline takes layer first), the
pipeline runs with no text encoder and ``output_type="latent"``, and the VAE decode is ours.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.sampling.pipelines import VaeOnDevice, _GuidedFlowSampling, decode


def _pipeline_embeds(cond: dict[str, torch.Tensor], device: torch.device, prefix: str = "") -> dict[str, torch.Tensor]:
    """The trainer's encoding as the pipeline's keyword arguments (``prefix``: ``negative_``)."""
    return {f"{prefix}pooled_prompt_embeds": cond["pooled_prompt_embeds"].to(device),
            f"{prefix}prompt_embeds_t5": cond["prompt_embeds_t5"].to(device),
            f"{prefix}prompt_embeds_llama3": cond["prompt_embeds_llama3"].transpose(0, 1).to(device)}


class HiDreamSampling(_GuidedFlowSampling):
    """``HiDreamImagePipeline`` with the trainer's flow scheduler (shift 3.0, or the folder's own) and its
    classifier-free guidance (both halves in one transformer call) above 1: the pipeline's 5.0."""

    factor = 16  # VAE factor 8 times the transformer's 2x2 patches
    default_guidance = 5.0
    negative_prompt = True

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor],
                 negative: dict | None, *, steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        vae = modules["vae"]
        none = {f"{kind}{suffix}": None for kind in ("text_encoder", "tokenizer") for suffix in ("", "_2", "_3", "_4")}
        pipe = trainer.pipeline_class()(scheduler=self.scheduler(trainer), vae=vae, transformer=modules["transformer"],
                                        **none)
        pipe.set_progress_bar_config(disable=True)
        pipe.default_sample_size = resolution // pipe.vae_scale_factor  # it rescales every size to this area (1024 px)
        kw = _pipeline_embeds(negative, device, "negative_") if negative is not None else {}
        latents = pipe(**_pipeline_embeds(cond, device), **kw, guidance_scale=guidance, num_inference_steps=steps,
                       height=resolution, width=resolution, generator=generator, output_type="latent",
                       return_dict=False)[0]
        image = decode(vae, latents, vae_on_device, shift=float(vae.config.shift_factor or 0.0))
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]
