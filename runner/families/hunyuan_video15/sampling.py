"""Sampling for HunyuanVideo 1.5: ``HunyuanVideo15Pipeline`` around the transformer in memory, conditioned on the
trainer's own text encoding (both encoders' states and masks), with the pipeline's classifier-free guider (6.0; an
empty negative prompt, a separate transformer call of batch 1) and our decode on the run's device. A sample is a
clip at the training clip size, written as Wan's are (first frame .png, .gif, .mp4 with PyAV)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.families.hunyuan_video15.architecture import GUIDANCE
from runner.families.wan.sampling import VideoSample
from runner.sampling.pipelines import _text, decode
from runner.trainer import ModelSet

KEYS = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")


class HunyuanVideo15Sampling:
    """``HunyuanVideo15Pipeline`` with the trainer's Euler flow scheduler (shift 5.0); clips at the training size."""

    default_guidance = GUIDANCE  # the published guider's guidance_scale
    negative_prompt = True
    factor = 16  # pixels per latent (the VAE's 16x; 1x1 patches): sample.resolution is refused anyway (the trainer)

    @staticmethod
    def denoiser_batch(guidance: float) -> int:
        return 1  # the guider calls the transformer once per condition

    @staticmethod
    def default_negative(guidance: float) -> str | None:
        return "" if guidance > 1 else None  # the pipeline encodes an empty negative prompt when guiding

    def encode(self, trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        return _text(trainer, models, prompt, device)

    def scheduler(self, trainer: Any) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        if trainer._folder_has("scheduler"):
            return FlowMatchEulerDiscreteScheduler.from_pretrained(trainer.source[1], subfolder="scheduler",
                                                                   local_files_only=True)
        return trainer.inference_scheduler()

    @staticmethod
    def decode_shape(trainer: Any, resolution: int) -> tuple[int, ...]:
        return (1, *trainer.latent_shape())

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor],
                 negative: dict | None, *, steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: Any) -> Any:
        from diffusers.guiders import ClassifierFreeGuidance

        vae = modules["vae"]
        pipe = trainer.pipeline_class()(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                        vae=vae, transformer=modules["transformer"], scheduler=self.scheduler(trainer),
                                        guider=ClassifierFreeGuidance(guidance_scale=guidance,
                                                                      enabled=negative is not None))
        pipe.set_progress_bar_config(disable=True)
        kw = {k: cond[k].to(device) for k in KEYS}
        if negative is not None:
            kw.update({f"negative_{k}": negative[k].to(device) for k in KEYS})
        clips = trainer.clips
        latents = pipe(height=clips.height, width=clips.width, num_frames=clips.frames, num_inference_steps=steps,
                       generator=generator, output_type="latent", return_dict=False, **kw)[0]
        video = decode(vae, latents.float(), vae_on_device)
        frames = pipe.video_processor.postprocess_video(video.float(), output_type="pil")[0]
        return VideoSample(frames, clips.fps or 24.0)
