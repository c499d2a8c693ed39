"""Sampling for Qwen-Image 2.1: ``QwenImage21Pipeline`` around the transformer in memory, conditioned on the
trainer's own text encoding (the prompt's valid tokens, unpadded, as the pipeline encodes one prompt), without
guidance by default (the pipeline's ``true_cfg_scale`` 1.0: the model is meant to be sampled so), and our decode
of the RGBA VAE on the run's device, alpha dropped."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.families.qwen_image.sampling import QwenImageSampling
from runner.sampling.pipelines import decode_video


class QwenImage21Sampling(QwenImageSampling):
    """``QwenImage21Pipeline``: Qwen-Image's sampling settings (text, scheduler) with 2.1's RGBA VAE and guidance."""

    factor = 32  # VAE factor 16 times the 2x2 token groups
    default_guidance = 1.0  # the pipeline's true_cfg_scale

    @staticmethod
    def decode_shape(trainer: Any, resolution: int) -> tuple[int, ...]:
        """The latents one sample decodes (the planner's sampling pass): one frame."""
        side = resolution // 16
        return (1, int(trainer.component_config("vae").get("z_dim", 64)), 1, side, side)

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor],
                 negative: dict | None, *, steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: Any) -> Any:
        vae = modules["vae"]
        pipe = trainer.pipeline_class()(scheduler=self.scheduler(trainer), vae=vae, text_encoder=None,
                                        processor=trainer.vl_processor(), transformer=modules["transformer"])
        pipe.set_progress_bar_config(disable=True)
        kw: dict[str, Any] = {}
        if negative is not None:
            kw = {"negative_prompt_embeds": negative["prompt_embeds"].to(device)}
        packed = pipe(prompt_embeds=cond["prompt_embeds"].to(device), true_cfg_scale=guidance,
                      num_inference_steps=steps, height=resolution, width=resolution, generator=generator,
                      output_type="latent", return_dict=False, **kw)[0]
        latents = pipe._unpack_latents(packed, resolution, resolution, pipe.vae_scale_factor)
        image = decode_video(vae, latents, vae_on_device)[:, :3, 0]  # RGB of the RGBA frame
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]
