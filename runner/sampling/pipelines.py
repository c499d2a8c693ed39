"""What the built-in families' sampling shares: each family's ``runner/families/<family>/sampling.py`` runs
diffusers' own pipeline around the modules being trained, and its trainer names it in ``sampling_family()``.

Each family's sampling does two things:

* ``encode(trainer, models, prompt)``: the prompt's conditioning, computed by the trainer's own
  ``encode_part(models, "text", ...)`` (:func:`_text`), i.e. exactly what training feeds the denoiser;
* ``generate(trainer, modules, cond, ...)``: the family's diffusers pipeline built from the denoiser
  in memory (LoRA adapters active) and the VAE, fed the precomputed embeddings, with no text encoder
  at all. A family with classifier-free guidance whose pipeline would encode the empty negative prompt
  itself (SD1.5, SD3.5, Qwen-Image, Wan) gets its embeddings precomputed too (``default_negative``).

The pipeline runs with ``output_type="latent"`` and the VAE decode is ours (:func:`decode`,
:func:`decode_video`): the pipelines move the latents to the device the VAE's *weights* are on, which
for a VAE kept on the host (parked, or kept for sampling after ``offload=park`` dropped it) would decode
on the CPU; we decode on the run's device, with the VAE brought there only for the decode
(``vae_on_device``), and tiled when ``tiling=vae`` tiled it (the same module object).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable

import torch

from runner.diffusers_classes import pipeline_class
from runner.trainer import ModelSet

VaeOnDevice = Callable[[], AbstractContextManager[None]]


def _quiet_pipelines() -> tuple[type, type]:
    return pipeline_class("StableDiffusionXLPipeline"), pipeline_class("FluxPipeline")


def _folder_scheduler(trainer: Any, cls: type) -> Any | None:
    """The scheduler of a diffusers ``model.path`` folder, when it has one (the model's own settings)."""
    if trainer._folder_has("scheduler"):
        return cls.from_pretrained(trainer.source[1], subfolder="scheduler", local_files_only=True)
    return None


def _text(trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
    """One prompt's text conditioning from the trainer's own ``encode_part``, moved to the host."""
    batch = {"caption": [prompt], "sample_seed": torch.zeros(1, dtype=torch.int64, device=device)}
    out = trainer.encode_part(models, "text", batch)
    return {k: v.detach().to("cpu") for k, v in out.items()}


def decode(vae: Any, latents: torch.Tensor, vae_on_device: VaeOnDevice, shift: float = 0.0) -> torch.Tensor:
    """Unscaled latents -> images in [-1, 1] on the latents' device, as the pipelines decode
    (``latents_mean``/``latents_std`` when the VAE config has them, else ``/ scaling_factor``)."""
    c = vae.config
    if getattr(c, "latents_mean", None) is not None and getattr(c, "latents_std", None) is not None:
        n = latents.shape[1]
        mean = torch.tensor(c.latents_mean).view(1, n, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(c.latents_std).view(1, n, 1, 1).to(latents.device, latents.dtype)
        latents = latents * std / c.scaling_factor + mean
    else:
        latents = latents / c.scaling_factor + shift
    with vae_on_device():
        dtype = next(vae.parameters()).dtype
        return vae.decode(latents.to(dtype), return_dict=False)[0]


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


class _GuidedFlowSampling:
    """What SD3.5's and Chroma's samplers share: classifier-free guidance (an unconditional half of
    the transformer's batch above guidance 1, with an empty negative prompt by default), the
    trainer's own text encoding, and a flow-matching scheduler from the folder or the trainer."""

    @staticmethod
    def denoiser_batch(guidance: float) -> int:
        return 2 if guidance > 1 else 1  # the pipeline calls the transformer for each half

    @staticmethod
    def default_negative(guidance: float) -> str | None:
        return "" if guidance > 1 else None  # see SD15Sampling.default_negative

    def encode(self, trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        return _text(trainer, models, prompt, device)

    def scheduler(self, trainer: Any) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return _folder_scheduler(trainer, FlowMatchEulerDiscreteScheduler) or trainer.inference_scheduler()


def _pooled_embeds_latents(pipe: Any, cond: dict[str, torch.Tensor], negative: dict | None, device: torch.device, *,
                           steps: int, guidance: float, resolution: int, generator: torch.Generator) -> torch.Tensor:
    """Latents from a pipeline conditioned on prompt embeddings plus pooled ones (SDXL, SD3), with the
    negative prompt's pair when given; no progress bar."""
    pipe.set_progress_bar_config(disable=True)
    kw: dict[str, Any] = {}
    if negative is not None:
        kw = {"negative_prompt_embeds": negative["prompt_embeds"].to(device),
              "negative_pooled_prompt_embeds": negative["pooled_prompt_embeds"].to(device)}
    return pipe(prompt_embeds=cond["prompt_embeds"].to(device), pooled_prompt_embeds=cond["pooled_prompt_embeds"].to(device),
                num_inference_steps=steps, guidance_scale=guidance, height=resolution, width=resolution,
                generator=generator, output_type="latent", return_dict=False, **kw)[0]


def family_sampling(trainer: Any) -> Any:
    """The built-in sampling for ``trainer``: what its ``sampling_family()`` returns (every
    built-in family's trainer has one; runner/families/common/base.py), else None."""
    fn = getattr(trainer, "sampling_family", None)
    return fn() if callable(fn) else None
