"""Sampling for Krea 2: ``Krea2Pipeline`` around the transformer in memory, conditioned on the trainer's own
fixed-length text encoding (embeddings and mask, as the pipeline takes them), with its guidance (4.5, a separate
unconditional call on the empty prompt) and our decode on the run's device."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.families.qwen_image.sampling import QwenImageSampling
from runner.sampling.pipelines import _text, decode_video
from runner.trainer import ModelSet


class Krea2Sampling(QwenImageSampling):
    """``Krea2Pipeline``: Qwen-Image's sampling settings (scheduler, latent shape) with Krea 2's text and guidance."""

    default_guidance = 4.5  # the pipeline's guidance_scale

    @staticmethod
    def default_negative(guidance: float) -> str | None:
        return "" if guidance > 0 else None  # the pipeline guides above 0, with an empty negative prompt

    def encode(self, trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        return _text(trainer, models, prompt, device)

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor],
                 negative: dict | None, *, steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: Any) -> Any:
        vae = modules["vae"]
        pipe = trainer.pipeline_class()(scheduler=self.scheduler(trainer), vae=vae, text_encoder=None, tokenizer=None,
                                        transformer=modules["transformer"], **trainer.pipeline_kwargs())
        pipe.set_progress_bar_config(disable=True)
        kw: dict[str, Any] = {}
        if negative is not None:
            kw = {"negative_prompt_embeds": negative["prompt_embeds"].to(device),
                  "negative_prompt_embeds_mask": negative["prompt_embeds_mask"].to(device)}
        packed = pipe(prompt_embeds=cond["prompt_embeds"].to(device), prompt_embeds_mask=cond["prompt_embeds_mask"].to(device),
                      guidance_scale=guidance if negative is not None else 0.0, num_inference_steps=steps,
                      height=resolution, width=resolution, generator=generator, output_type="latent",
                      return_dict=False, max_sequence_length=trainer.max_sequence_length, **kw)[0]
        latents = pipe._unpack_latents(packed, resolution, resolution)
        image = decode_video(vae, latents, vae_on_device)[:, :, 0]
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]
