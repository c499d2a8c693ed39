"""Sampling for FLUX.1 Kontext: ``FluxKontextPipeline`` with the reference image, on FLUX.1's sampling."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.families.common.loading import pipeline_class
from runner.families.flux.sampling import FluxSampling
from runner.sampling.pipelines import VaeOnDevice, decode
from runner.trainer import ModelSet


class FluxKontextSampling(FluxSampling):
    """``FluxKontextPipeline``: Flux's sampling with each prompt's reference image joining the sequence.

    The reference is encoded once at the start by the trainer's own ``encode_references`` (the
    posterior mean, normalised as in training) and handed to the pipeline as latents, which it packs
    and gives the ids with first coordinate 1, exactly as it does for an image it encodes itself.
    Which reference goes with which prompt: runner/sampling/references.py (``sample.references``).
    """

    takes_references = True
    # The guidance FluxKontextPipeline's own example samples Kontext with (its EXAMPLE_DOC_STRING); the
    # call's default, 3.5, is FLUX.1 dev's. sample.guidance sets another.
    default_guidance = 2.5

    @torch.no_grad()
    def encode_reference(self, trainer: Any, models: ModelSet, pixels: torch.Tensor,
                         device: torch.device) -> dict[str, torch.Tensor]:
        """``[1, N, 3, H, W]`` reference pixels -> ``reference_latents`` ``[1, N, C, h, w]`` on the host."""
        mean = trainer.encode_references(models, pixels.to(device))
        return {"reference_latents": trainer.normalize_latents(mean.float()).to("cpu")}

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor], negative: dict | None, *,
                 steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        vae = modules["vae"]
        pipe = pipeline_class("FluxKontextPipeline")(
            scheduler=self.scheduler(trainer), vae=vae, text_encoder=None, tokenizer=None, text_encoder_2=None,
            tokenizer_2=None, transformer=modules["transformer"])
        pipe.set_progress_bar_config(disable=True)
        dtype = next(modules["transformer"].parameters()).dtype
        packed = pipe(image=cond["reference_latents"][:, 0].to(device, dtype),  # latents: the pipeline packs them
                      prompt_embeds=cond["prompt_embeds"].to(device),
                      pooled_prompt_embeds=cond["pooled_prompt_embeds"].to(device),
                      num_inference_steps=steps, guidance_scale=guidance, height=resolution, width=resolution,
                      max_area=resolution * resolution,  # else the pipeline scales the size to 1024^2
                      generator=generator, output_type="latent", return_dict=False)[0]
        latents = pipe._unpack_latents(packed, resolution, resolution, pipe.vae_scale_factor)
        image = decode(vae, latents, vae_on_device, shift=float(vae.config.shift_factor or 0.0))
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]
