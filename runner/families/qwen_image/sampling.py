"""Sampling for Qwen-Image: ``QwenImagePipeline`` around the transformer in memory, with true classifier-free
guidance (two denoiser calls of batch 1 per step; the unconditional prompt ``" "`` of Qwen-Image's examples,
precomputed) and our decode on the run's device (runner/sampling/pipelines.py)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.sampling.pipelines import _text, decode_video
from runner.trainer import ModelSet


class QwenImageSampling:
    """``QwenImagePipeline`` with Qwen-Image's flow-matching scheduler (or the folder's own)."""

    factor = 16  # VAE factor 8 times the 2x2 latent packing
    default_guidance = 4.0  # the pipeline's true_cfg_scale
    negative_prompt = True

    @staticmethod
    def denoiser_batch(guidance: float) -> int:
        return 1  # conditional and unconditional passes are separate calls

    @staticmethod
    def default_negative(guidance: float) -> str | None:
        """True CFG needs a negative prompt; Qwen-Image's examples pass a single space."""
        return " " if guidance > 1 else None

    def encode(self, trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        """The prompt's valid tokens only (the pipeline's own, unpadded form for one prompt)."""
        out = _text(trainer, models, prompt, device)
        n = int(out["prompt_embeds_mask"][0].sum())
        return {"prompt_embeds": out["prompt_embeds"][:, :n]}

    def scheduler(self, trainer: Any) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        if trainer._folder_has("scheduler"):
            return FlowMatchEulerDiscreteScheduler.from_pretrained(trainer.source[1], subfolder="scheduler",
                                                                   local_files_only=True)
        return trainer.inference_scheduler()

    @staticmethod
    def decode_shape(trainer: Any, resolution: int) -> tuple[int, ...]:
        """The latents one sample decodes (the planner's sampling pass): one frame."""
        side = resolution // (QwenImageSampling.factor // 2)
        return (1, int(trainer.component_config("vae").get("z_dim", 16)), 1, side, side)

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor],
                 negative: dict | None, *, steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: Any) -> Any:
        vae = modules["vae"]
        pipe = trainer.pipeline_class()(scheduler=self.scheduler(trainer), vae=vae, text_encoder=None, tokenizer=None,
                                        transformer=modules["transformer"])
        pipe.set_progress_bar_config(disable=True)
        emb = cond["prompt_embeds"].to(device)
        kw: dict[str, Any] = {}
        if negative is not None:
            neg = negative["prompt_embeds"].to(device)
            kw = {"negative_prompt_embeds": neg, "negative_prompt_embeds_mask": torch.ones(neg.shape[:2], device=device,
                                                                                           dtype=torch.long)}
        packed = pipe(prompt_embeds=emb, prompt_embeds_mask=torch.ones(emb.shape[:2], device=device, dtype=torch.long),
                      true_cfg_scale=guidance, num_inference_steps=steps, height=resolution, width=resolution,
                      generator=generator, output_type="latent", return_dict=False, **kw)[0]
        latents = pipe._unpack_latents(packed, resolution, resolution, pipe.vae_scale_factor)
        image = decode_video(vae, latents, vae_on_device)[:, :, 0]
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]
