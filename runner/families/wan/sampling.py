"""Sampling for Wan: ``WanPipeline`` around the transformer in memory, with the pipeline's guidance (two denoiser
calls of batch 1 per step, the empty negative prompt precomputed) and our decode on the run's device.

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

from runner.sampling.pipelines import _text, decode_video
from runner.trainer import ModelSet


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
