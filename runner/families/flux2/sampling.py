"""Sampling for Flux.2 (``trainer=flux2``): ``Flux2Pipeline`` / ``Flux2KleinPipeline`` around the transformer
being trained, fed the prompt embeddings the trainer's own ``encode_part`` computed (no text encoder).

With reference images (a run with ``data.references=N``) each prompt's references go to the pipeline as
PIL images, as a user hands them over, and the pipeline encodes them itself (``prepare_image_latents``);
which references go with which prompt: runner/sampling/references.py (``sample.references``). Trade-off:
the pipeline takes only PIL images for its references, so the VAE is on the device for the whole call when
there are references (not only for the decode), and the references are rounded to 8-bit pixels once.

Decoding is ours, on the run's device (runner/sampling/pipelines.py says why): the pipeline's packed tokens
are scattered back with their ids, de-normalised with the VAE's batch-norm statistics and unpatchified,
exactly as ``Flux2Pipeline.__call__`` does before ``vae.decode``.

Guidance: FLUX.2 dev takes it as an input of the model (guidance-distilled, ``guidance_scale`` 4.0 the
pipeline's default; one pass, no negative prompt). klein is not guidance-distilled: above 1 the pipeline
runs classifier-free guidance with a negative prompt, whose embeddings are precomputed here ("" unless
``sample.negative_prompt``), one more transformer pass per step, each of batch 1.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from PIL import Image
from torch import nn

from runner.sampling.pipelines import VaeOnDevice, _folder_scheduler, _text
from runner.trainer import ModelSet


def _to_pil(pixels: torch.Tensor) -> Image.Image:
    """``[3, H, W]`` pixels in [-1, 1] -> an RGB image (the data set's inverse)."""
    arr = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(arr)


def decode_packed(pipe: Any, vae: Any, packed: torch.Tensor, size: int, vae_on_device: VaeOnDevice) -> torch.Tensor:
    """``Flux2Pipeline.__call__``'s decode of its packed latents, on the latents' device.

    ``Flux2KleinPipeline`` returns ``output_type="latent"`` already unpacked, de-normalised and unpatchified
    (``[B, C, H/8, W/8]``): only the VAE call is left for those."""
    latents = packed
    if packed.dim() == 3:  # Flux2Pipeline: [B, tokens, 4C]
        grid = torch.empty(packed.shape[0], 1, size // 16, size // 16)
        latents = pipe._unpack_latents_with_ids(packed, pipe._prepare_latent_ids(grid).to(packed.device))
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                             latents.dtype)
        latents = pipe._unpatchify_latents(latents * std + mean)
    with vae_on_device():
        dtype = next(vae.parameters()).dtype
        return vae.decode(latents.to(dtype), return_dict=False)[0]


class Flux2Sampling:
    """``Flux2Pipeline`` (dev) or ``Flux2KleinPipeline`` (klein), with the run's reference images when it has them."""

    factor = 16  # VAE factor 8 times the 2x2 patchify
    default_guidance = 4.0  # both pipelines' call default

    def __init__(self, klein: bool, references: int) -> None:
        self.klein = klein
        self.negative_prompt = klein  # classifier-free guidance (klein) takes a negative prompt; dev has none
        self.takes_references = references > 0

    @staticmethod
    def denoiser_batch(guidance: float) -> int:
        return 1  # dev: guidance is an input; klein: the unconditional pass is a second call of batch 1

    def default_negative(self, guidance: float) -> str | None:
        return "" if self.klein and guidance > 1 else None

    def encode(self, trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        return _text(trainer, models, prompt, device)

    def encode_reference(self, trainer: Any, models: ModelSet, pixels: torch.Tensor,
                         device: torch.device) -> dict[str, torch.Tensor]:
        """``[1, N, 3, H, W]`` pixels kept on the host: the pipeline encodes its PIL references itself."""
        return {"reference_pixels": pixels.detach().to("cpu")}

    def scheduler(self, trainer: Any) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return _folder_scheduler(trainer, FlowMatchEulerDiscreteScheduler) or trainer.inference_scheduler()

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor], negative: dict | None, *,
                 steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        vae = modules["vae"]
        pipe = trainer.pipeline_class()(scheduler=self.scheduler(trainer), vae=vae, text_encoder=None, tokenizer=None,
                                        transformer=modules["transformer"])
        pipe.set_progress_bar_config(disable=True)
        kwargs: dict[str, Any] = {"prompt_embeds": cond["prompt_embeds"].to(device)}
        if self.klein and negative is not None:
            kwargs["negative_prompt_embeds"] = negative["prompt_embeds"].to(device)
        refs = cond.get("reference_pixels")
        if refs is not None:
            kwargs["image"] = [_to_pil(r) for r in refs[0]]
        with vae_on_device() if refs is not None else contextlib.nullcontext():
            packed = pipe(num_inference_steps=steps, guidance_scale=guidance, height=resolution, width=resolution,
                          generator=generator, output_type="latent", return_dict=False, **kwargs)[0]
        image = decode_packed(pipe, vae, packed, resolution, vae_on_device)
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]
