"""Sampling for Qwen-Image and Wan: ``QwenImagePipeline`` and ``WanPipeline`` around the modules in memory.

The same contract as runner/sampling/families.py (SDXL, Flux): prompts are encoded once by the
trainer's own ``encode_part``, the pipeline runs the denoiser being trained (LoRA active) with
``output_type="latent"``, and the decode is ours, on the run's device (``vae_on_device``), tiled
when ``tiling=vae`` tiled the VAE. Both families use classifier-free guidance with two denoiser
calls of batch 1 per step (Qwen-Image's "true CFG", Wan's guidance), so the unconditional prompt
is precomputed as well: Qwen-Image's examples use ``" "``, Wan's pipeline encodes ``""``.

A Wan sample is a clip of ``data.frames`` frames at ``data.width`` x ``data.height``, written as
``NN-prompt.png`` (its first frame), ``NN-prompt.gif`` (Pillow, always) and ``NN-prompt.mp4`` (when
PyAV is installed, the ``video`` extra) at the clip's frame rate.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.trainer import ModelSet


def _text(trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
    batch = {"caption": [prompt], "sample_seed": torch.zeros(1, dtype=torch.int64, device=device)}
    out = trainer.encode_part(models, "text", batch)
    return {k: v.detach().to("cpu") for k, v in out.items()}


def denormalize(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Normalised 5-D latents -> the VAE's own space: ``z * latents_std + latents_mean``."""
    c = vae.config
    shape = (1, len(c.latents_mean), 1, 1, 1)
    mean = torch.tensor(c.latents_mean, dtype=torch.float32).view(shape).to(latents.device, latents.dtype)
    std = torch.tensor(c.latents_std, dtype=torch.float32).view(shape).to(latents.device, latents.dtype)
    return latents * std + mean


def decode_video(vae: Any, latents: torch.Tensor, vae_on_device: Any) -> torch.Tensor:
    """(B, C, F', h, w) normalised latents -> (B, 3, F, H, W) in [-1, 1] on the latents' device."""
    latents = denormalize(vae, latents.float())
    with vae_on_device():
        dtype = next(vae.parameters()).dtype
        return vae.decode(latents.to(dtype), return_dict=False)[0]


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


class VideoSample:
    """A sampled clip; ``save(path)`` writes the first frame to ``path`` (.png), the clip as a GIF
    beside it and, with PyAV installed, as an MP4."""

    def __init__(self, frames: list[Any], fps: float) -> None:
        self.frames = frames
        self.fps = float(fps)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        self.frames[0].save(path)
        duration = max(1, round(1000 / self.fps))
        self.frames[0].save(path.with_suffix(".gif"), save_all=True, append_images=self.frames[1:], duration=duration,
                            loop=0)
        from runner.data.clips import have_video_decoder

        if have_video_decoder():
            write_mp4(self.frames, self.fps, path.with_suffix(".mp4"))


def write_mp4(frames: list[Any], fps: float, path: Path) -> None:
    """H.264 MP4 (yuv420p, even sizes) of PIL frames, with PyAV."""
    import fractions

    import av

    w, h = frames[0].size
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fractions.Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = w - w % 2, h - h % 2, "yuv420p"
        for image in frames:
            frame = av.VideoFrame.from_image(image.crop((0, 0, stream.width, stream.height)))
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


class WanSampling:
    """``WanPipeline`` with the variant's UniPC flow scheduler (or the folder's own); clips at the
    training clip size."""

    default_guidance = 5.0  # the pipeline's guidance_scale
    negative_prompt = True

    def __init__(self, factor: int = 16) -> None:
        self.factor = factor

    @staticmethod
    def denoiser_batch(guidance: float) -> int:
        return 1

    @staticmethod
    def default_negative(guidance: float) -> str | None:
        """The pipeline encodes the empty prompt as the unconditional one when guidance is on."""
        return "" if guidance > 1 else None

    def encode(self, trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        return _text(trainer, models, prompt, device)

    def scheduler(self, trainer: Any) -> Any:
        from diffusers import UniPCMultistepScheduler

        if trainer._folder_has("scheduler"):
            return UniPCMultistepScheduler.from_pretrained(trainer.source[1], subfolder="scheduler",
                                                           local_files_only=True)
        return trainer.inference_scheduler()

    @staticmethod
    def decode_shape(trainer: Any, resolution: int) -> tuple[int, ...]:
        return (1, *trainer.latent_shape())

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor],
                 negative: dict | None, *, steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: Any) -> Any:
        vae = modules["vae"]
        pipe = trainer.pipeline_class()(tokenizer=None, text_encoder=None, vae=vae, scheduler=self.scheduler(trainer),
                                        transformer=modules["transformer"], **trainer.pipeline_kwargs())
        pipe.set_progress_bar_config(disable=True)
        clips = trainer.clips
        kw = {"negative_prompt_embeds": negative["prompt_embeds"].to(device)} if negative is not None else {}
        latents = pipe(prompt_embeds=cond["prompt_embeds"].to(device), height=clips.height, width=clips.width,
                       num_frames=clips.frames, guidance_scale=guidance, num_inference_steps=steps, generator=generator,
                       output_type="latent", return_dict=False, **kw)[0]
        video = decode_video(vae, latents, vae_on_device)
        frames = pipe.video_processor.postprocess_video(video.float(), output_type="pil")[0]
        return VideoSample(frames, clips.fps or 16.0)
