"""Sampling for Wan image-to-video: ``WanImageToVideoPipeline`` around the modules in memory, from a start image.

The contract of runner/families/wan/sampling.py's ``WanSampling`` (prompts encoded once by the trainer's
``encode_part``, the pipeline's denoising loop with the trained transformer, our decode on the run's
device), plus the start image, which the sampler treats as an edit family's reference
(``takes_references``): each prompt takes one,

* ``sample.references=[a.png, ...]``: one image file per prompt, in order, resized to cover the
  clip's ``data.width`` x ``data.height`` (aspect kept) and centre-cropped, as training clips are;
* unset: prompt ``i`` starts from training sample ``i``'s first frame (modulo the data set's size),
  so a sample continues a frame the model trained on.

The start image is encoded once, at the start, by the trainer's own code (:meth:`encode_reference`):
the condition latents (VAE, brought to the device per call) and, for Wan 2.1, the CLIP tokens. The
pipeline is then handed those instead of encoding the image itself (:func:`start_image_pipeline`):
its own encode would run the VAE and the image encoder wherever their weights are (on the host when
a plugin parked them) for every sample; the denoising loop, guidance and scheduler are the
pipeline's. tests/runner/families/wan/test_wan_i2v.py checks that the trainer's condition and CLIP
tokens equal the pipeline's own for the same image.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.families.common.loading import pipeline_class
from runner.families.wan.sampling import VideoSample, WanSampling
from runner.sampling.pipelines import decode_video
from runner.trainer import ModelSet


def start_image_pipeline(start: dict[str, torch.Tensor]) -> type:
    """A ``WanImageToVideoPipeline`` whose start-image encodings are ``start`` (``condition``
    ``[1, 4 + C, F', h, w]`` and, for Wan 2.1, ``image_embeds``), precomputed as training computes them;
    the noise is drawn as the pipeline draws it (``randn_tensor`` with the call's generator)."""
    from diffusers.utils.torch_utils import randn_tensor

    base = pipeline_class("WanImageToVideoPipeline")

    class StartImagePipeline(base):  # type: ignore[misc, valid-type]
        def encode_image(self, image: Any, device: torch.device | None = None) -> torch.Tensor:
            return start["image_embeds"].to(device)

        def prepare_latents(self, image: Any, batch_size: int, num_channels_latents: int = 16, height: int = 480,
                            width: int = 832, num_frames: int = 81, dtype: torch.dtype | None = None,
                            device: torch.device | None = None, generator: Any = None,
                            latents: torch.Tensor | None = None, last_image: Any = None) -> tuple[torch.Tensor, ...]:
            frames = (num_frames - 1) // self.vae_scale_factor_temporal + 1
            shape = (batch_size, num_channels_latents, frames, height // self.vae_scale_factor_spatial,
                     width // self.vae_scale_factor_spatial)
            if latents is None:
                latents = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
            condition = start["condition"].to(device=device, dtype=dtype).expand(batch_size, -1, -1, -1, -1)
            return latents.to(device=device, dtype=dtype), condition

    return StartImagePipeline


class WanI2VSampling(WanSampling):
    """``WanImageToVideoPipeline`` from each prompt's start image; clips at the training clip size."""

    takes_references = True
    references_per_prompt = 1  # sample.references: one start image per prompt

    def reference_encoders(self, trainer: Any) -> tuple[str, ...]:
        """Modules :meth:`encode_reference` runs besides the VAE (brought to the device per call)."""
        return ("image_encoder",) if trainer.image_encoder else ()

    def reference_pixels(self, trainer: Any, files: list[str], count: int, resolution: int) -> list[torch.Tensor]:
        """``[1, 1, 3, H, W]`` start-image pixels for each of ``count`` prompts at the clip size."""
        from runner.data.images import _load_rgb
        from runner.data.video import fit_frames, frames_to_tensor

        clips = trainer.clips
        if files:
            images = [_load_rgb(f, f, "sample.references") for f in files]
            return [frames_to_tensor(fit_frames([im], clips.width, clips.height, True, 0), False)[:, 0][None, None]
                    for im in images]
        dataset = trainer.dataset()
        n = len(dataset)
        return [dataset[i % n]["pixel_values"][:, 0][None, None] for i in range(count)]

    @torch.no_grad()
    def encode_reference(self, trainer: Any, models: ModelSet, pixels: torch.Tensor,
                         device: torch.device) -> dict[str, torch.Tensor]:
        """The start image's ``condition`` (and ``image_embeds``), computed by the trainer, on the host."""
        first = pixels[:, 0].to(device)
        mean = trainer.encode_condition(models, first, trainer.clips.frames)
        out = {"condition": trainer.condition(mean.float()).to("cpu"), "start_pixels": pixels[:, 0].float().cpu()}
        if trainer.image_encoder:
            out["image_embeds"] = trainer.encode_image(models, first).to("cpu")
        return out

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor],
                 negative: dict | None, *, steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: Any) -> Any:
        from runner.families.common.pixels import to_pil

        vae = modules["vae"]
        pipe = start_image_pipeline(cond)(tokenizer=None, text_encoder=None, vae=vae, scheduler=self.scheduler(trainer),
                                          transformer=modules["transformer"], **trainer.pipeline_kwargs())
        pipe.set_progress_bar_config(disable=True)
        clips = trainer.clips
        kw = {"negative_prompt_embeds": negative["prompt_embeds"].to(device)} if negative is not None else {}
        latents = pipe(image=to_pil(cond["start_pixels"][0]), prompt_embeds=cond["prompt_embeds"].to(device),
                       height=clips.height, width=clips.width, num_frames=clips.frames, guidance_scale=guidance,
                       num_inference_steps=steps, generator=generator, output_type="latent", return_dict=False,
                       **kw)[0]
        video = decode_video(vae, latents, vae_on_device)
        frames = pipe.video_processor.postprocess_video(video.float(), output_type="pil")[0]
        return VideoSample(frames, clips.fps or 16.0)
