"""Sampling for the built-in families: diffusers' own pipelines around the modules being trained.

Each family (SDXL, Flux, Flux.1 Kontext, Chroma, SD1.5/SD2.1, SD3.5; a trainer names its own in ``sampling_family()``)
does two things:

* ``encode(trainer, models, prompt)``: the prompt's conditioning, computed by the trainer's own
  ``encode_part(models, "text", ...)``, i.e. exactly what training feeds the denoiser;
* ``generate(trainer, modules, cond, ...)``: the family's diffusers pipeline
  (``StableDiffusionXLPipeline``, ``FluxPipeline``, ``ChromaPipeline``, ``StableDiffusionPipeline``,
  ``StableDiffusion3Pipeline``) built from the denoiser in memory (LoRA adapters active) and the
  VAE, fed the precomputed embeddings, with no text encoder at all. A family with classifier-free
  guidance whose pipeline would encode the empty negative prompt itself (SD1.5, SD3.5) gets its
  embeddings precomputed too (``default_negative``).

The pipeline runs with ``output_type="latent"`` and the VAE decode is ours (:func:`decode`):
the pipelines move the latents to the device the VAE's *weights* are on, which for a VAE kept
on the host (parked, or kept for sampling after ``offload=park`` dropped it) would decode on the
CPU; we decode on the run's device, with the VAE brought there only for the decode
(``vae_on_device``), and tiled when ``tiling=vae`` tiled it (the same module object).
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch
from torch import nn

from runner.trainer import ModelSet
from runner.trainers.loading import pipeline_class

VaeOnDevice = Callable[[], AbstractContextManager[None]]

# FLUX.1-dev's scheduler (scheduler/scheduler_config.json of the published folder), used when
# model.path has no scheduler/ subfolder: the resolution-dependent shift is part of the model.
FLUX_SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                      base_image_seq_len=256, max_image_seq_len=4096)


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


class SDXLSampling:
    """``StableDiffusionXLPipeline`` with an Euler scheduler on the trainer's noise schedule."""

    factor = 8  # sample.resolution must be a multiple of the VAE factor
    default_guidance = 5.0
    negative_prompt = True

    @staticmethod
    def denoiser_batch(guidance: float) -> int:
        """Samples per U-Net call: the pipeline runs the unconditional and conditional halves
        together when guidance > 1 (classifier-free guidance)."""
        return 2 if guidance > 1 else 1

    @staticmethod
    def default_negative(guidance: float) -> str | None:
        """No negative prompt unless one is set: SDXL's pipeline uses zeros for an empty one
        (``force_zeros_for_empty_prompt``)."""
        return None

    def encode(self, trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        return _text(trainer, models, prompt, device)

    def scheduler(self, trainer: Any) -> Any:
        from diffusers import EulerDiscreteScheduler

        # The training schedule (betas, prediction type) with SDXL's inference spacing.
        return _folder_scheduler(trainer, EulerDiscreteScheduler) or EulerDiscreteScheduler.from_config(
            trainer.scheduler(torch.device("cpu")).config, timestep_spacing="leading", steps_offset=1)

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor], negative: dict | None, *,
                 steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        sdxl, _ = _quiet_pipelines()
        vae = modules["vae"]
        pipe = sdxl(vae=vae, text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None,
                    unet=modules["unet"], scheduler=self.scheduler(trainer), add_watermarker=False)
        latents = _pooled_embeds_latents(pipe, cond, negative, device, steps=steps, guidance=guidance,
                                         resolution=resolution, generator=generator)
        image = decode(vae, latents, vae_on_device)
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]


class FluxSampling:
    """``FluxPipeline`` with FLUX.1-dev's flow-matching scheduler (or the folder's own)."""

    factor = 16  # VAE factor 8 times the 2x2 latent packing
    default_guidance = 3.5
    negative_prompt = False  # guidance-distilled: no classifier-free guidance

    @staticmethod
    def denoiser_batch(guidance: float) -> int:
        return 1  # the guidance scale is an input of the model, not a second pass

    @staticmethod
    def default_negative(guidance: float) -> str | None:
        return None  # no classifier-free guidance

    def encode(self, trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        return _text(trainer, models, prompt, device)

    def scheduler(self, trainer: Any) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return _folder_scheduler(trainer, FlowMatchEulerDiscreteScheduler) or FlowMatchEulerDiscreteScheduler(
            **FLUX_SCHEDULER)

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor], negative: dict | None, *,
                 steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        _, flux = _quiet_pipelines()
        vae = modules["vae"]
        pipe = flux(scheduler=self.scheduler(trainer), vae=vae, text_encoder=None, tokenizer=None,
                    text_encoder_2=None, tokenizer_2=None, transformer=modules["transformer"])
        pipe.set_progress_bar_config(disable=True)
        packed = pipe(prompt_embeds=cond["prompt_embeds"].to(device),
                      pooled_prompt_embeds=cond["pooled_prompt_embeds"].to(device),
                      num_inference_steps=steps, guidance_scale=guidance, height=resolution, width=resolution,
                      generator=generator, output_type="latent", return_dict=False)[0]
        latents = pipe._unpack_latents(packed, resolution, resolution, pipe.vae_scale_factor)
        image = decode(vae, latents, vae_on_device, shift=float(vae.config.shift_factor or 0.0))
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]


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


class SD15Sampling(SDXLSampling):
    """``StableDiffusionPipeline`` (SD1.5, SD2.1) with an Euler scheduler on the trainer's noise schedule."""

    default_guidance = 7.5  # the pipeline's default

    @staticmethod
    def default_negative(guidance: float) -> str | None:
        """The empty prompt, as the pipeline's unconditional half, when guidance is on (its
        ``encode_prompt`` would need the tokenizer and text encoder otherwise)."""
        return "" if guidance > 1 else None

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor], negative: dict | None, *,
                 steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        vae = modules["vae"]
        pipe = pipeline_class("StableDiffusionPipeline")(
            vae=vae, text_encoder=None, tokenizer=None, unet=modules["unet"], scheduler=self.scheduler(trainer),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        kw: dict[str, Any] = {}
        if negative is not None:
            kw = {"negative_prompt_embeds": negative["prompt_embeds"].to(device)}
        latents = pipe(prompt_embeds=cond["prompt_embeds"].to(device), num_inference_steps=steps,
                       guidance_scale=guidance, height=resolution, width=resolution, generator=generator,
                       output_type="latent", return_dict=False, **kw)[0]
        image = decode(vae, latents, vae_on_device)
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]


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


class SD3Sampling(_GuidedFlowSampling):
    """``StableDiffusion3Pipeline`` with SD3.5's flow-matching scheduler (shift 3.0, or the folder's own)."""

    factor = 16  # VAE factor 8 times the transformer's 2x2 patches
    negative_prompt = True

    def __init__(self, default_guidance: float = 3.5) -> None:
        self.default_guidance = default_guidance  # the model card's: Large 3.5, Medium 4.5

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor], negative: dict | None, *,
                 steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        vae = modules["vae"]
        pipe = pipeline_class("StableDiffusion3Pipeline")(
            transformer=modules["transformer"], scheduler=self.scheduler(trainer), vae=vae, text_encoder=None,
            tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None)
        latents = _pooled_embeds_latents(pipe, cond, negative, device, steps=steps, guidance=guidance,
                                         resolution=resolution, generator=generator)
        image = decode(vae, latents, vae_on_device, shift=float(vae.config.shift_factor or 0.0))
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]


class ChromaSampling(_GuidedFlowSampling):
    """``ChromaPipeline`` with FLUX.1's flow-matching scheduler (or the folder's own), and
    classifier-free guidance (Chroma is not guidance-distilled): the pipeline's default 5.0."""

    factor = 16  # VAE factor 8 times the 2x2 latent packing
    default_guidance = 5.0
    negative_prompt = True

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor], negative: dict | None, *,
                 steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: VaeOnDevice) -> Any:
        vae = modules["vae"]
        pipe = pipeline_class("ChromaPipeline")(scheduler=self.scheduler(trainer), vae=vae, text_encoder=None,
                                                tokenizer=None, transformer=modules["transformer"])
        pipe.set_progress_bar_config(disable=True)
        dtype = next(modules["transformer"].parameters()).dtype

        def embeds(c: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            return c["prompt_embeds"].to(device), c["prompt_attention_mask"].to(device, dtype)

        kw: dict[str, Any] = {}
        if negative is not None:
            kw["negative_prompt_embeds"], kw["negative_prompt_attention_mask"] = embeds(negative)
        prompt_embeds, mask = embeds(cond)
        packed = pipe(prompt_embeds=prompt_embeds, prompt_attention_mask=mask, num_inference_steps=steps,
                      guidance_scale=guidance, height=resolution, width=resolution, generator=generator,
                      output_type="latent", return_dict=False, **kw)[0]
        latents = pipe._unpack_latents(packed, resolution, resolution, pipe.vae_scale_factor)
        image = decode(vae, latents, vae_on_device, shift=float(vae.config.shift_factor or 0.0))
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]


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
    built-in family's trainer has one; runner/trainers/base.py), else None."""
    fn = getattr(trainer, "sampling_family", None)
    return fn() if callable(fn) else None
