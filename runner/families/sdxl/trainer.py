"""SDXL: train the U-Net (fully or with LoRA) with the DDPM noise-prediction loss.

The recipe is diffusers' ``train_text_to_image_sdxl.py`` reduced to the trainer protocol:
VAE latents times ``scaling_factor``; prompt embeddings from the penultimate hidden states of
both CLIP text encoders, concatenated; the pooled, projected output of the second encoder and
the six ``time_ids`` (original size, crop top-left, target size) as the added conditioning.
The loss is the DDPM family's (runner/families/common/ddpm.py).

Every random draw (VAE posterior sample, noise, timestep) comes from the sample's own seed, so
the loss of a batch is the mean of the losses of any split of it.
"""
from __future__ import annotations

from typing import Any

import torch

from runner.families.common.ddpm import NUM_TRAIN_TIMESTEPS, SD_NOISE_SCHEDULE, DDPMTrainer
from runner.families.common.latents import vae_scale_factor
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.common.model_configs import CLIP_MAX_LENGTH
from runner.families.common.tokenizers import clip_tokenizer, tokenize
from runner.families.sdxl.architecture import sdxl_configs
from runner.families.sdxl.config import SDXLTrainerConfig
from runner.trainer import Batch, ModelSet, batch_device


class SDXLTrainer(DDPMTrainer):
    """SDXL U-Net, DDPM loss (epsilon or v-prediction)."""

    Config = SDXLTrainerConfig
    denoiser = "unet"
    display_name = "SDXL"
    family = "sdxl"
    reference_repo = "stabilityai/stable-diffusion-xl-base-1.0"
    kohya_base_model_version = "sdxl_base_v1-0"

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection

        return {
            "unet": UNet2DConditionModel,
            "vae": AutoencoderKL,
            "text_encoder": CLIPTextModel,
            "text_encoder_2": CLIPTextModelWithProjection,
        }

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return sdxl_configs(self.size)

    def default_tokenizer(self, name: str) -> Any:
        return clip_tokenizer(CLIP_MAX_LENGTH)

    def pipeline_class(self) -> type:
        return pipeline_class("StableDiffusionXLPipeline")

    def inference_scheduler(self) -> Any:
        """stabilityai/stable-diffusion-xl-base-1.0's scheduler/scheduler_config.json, with this
        run's prediction type."""
        from diffusers import EulerDiscreteScheduler

        return EulerDiscreteScheduler(
            num_train_timesteps=NUM_TRAIN_TIMESTEPS, steps_offset=1, timestep_spacing="leading",
            prediction_type=self.prediction_type, **SD_NOISE_SCHEDULE,
        )

    def sampling_family(self) -> Any:
        from runner.families.sdxl.sampling import SDXLSampling

        return SDXLSampling()

    # -- protocol -------------------------------------------------------------------------
    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior (mean, std) or the two text encoders' outputs, on the batch's device."""
        if part == "latents":
            return self.encode_latents(models, batch)
        device = batch_device(batch)
        te1, te2 = models["text_encoder"], models["text_encoder_2"]
        captions = list(batch["caption"])
        tok1, tok2 = self.tokenizer("tokenizer"), self.tokenizer("tokenizer_2")
        ids1 = tokenize(tok1, captions, self.text_max_length(tok1, te1.config), device)
        ids2 = tokenize(tok2, captions, self.text_max_length(tok2, te2.config), device)
        out1 = te1(ids1, output_hidden_states=True)
        out2 = te2(ids2, output_hidden_states=True)
        h1 = out1.hidden_states[-2]
        prompt_embeds = torch.cat([h1, out2.hidden_states[-2].to(h1.dtype)], dim=-1)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": out2.text_embeds}

    def extra_conditioning(self, latents: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """The six SDXL ``time_ids``: original size, crop top-left, target size (from the latents)."""
        device = latents.device
        factor = vae_scale_factor(self.component_config("vae"))
        b, _, lh, lw = latents.shape
        h, w = lh * factor, lw * factor
        original = batch.get("original_size")
        crop = batch.get("crop_top_left")
        if not isinstance(original, torch.Tensor):
            original = torch.tensor([[h, w]] * b)
        if not isinstance(crop, torch.Tensor):
            crop = torch.zeros(b, 2)
        target = torch.tensor([[h, w]] * b)
        time_ids = torch.cat([original.float().to(device), crop.float().to(device), target.float().to(device)], dim=1)
        return {"time_ids": time_ids}

    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        unet = models["unet"]
        dt = compute_dtype(unet)
        return unet(
            noisy.to(dt),
            timesteps,
            encoder_hidden_states=batch["prompt_embeds"].to(dt),
            added_cond_kwargs={
                "text_embeds": batch["pooled_prompt_embeds"].to(dt),
                "time_ids": batch["time_ids"].to(dt),
            },
            return_dict=False,
        )[0]

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives at :meth:`planned_size`."""
        te1, te2 = self.component_config("text_encoder"), self.component_config("text_encoder_2")
        length = min(CLIP_MAX_LENGTH, int(te1["max_position_embeddings"]))
        cross_dim = int(te1["hidden_size"]) + int(te2["hidden_size"])
        b, dt = batch_size, self.storage_dtype
        h, w = (float(x) for x in self.planned_size())
        time_ids = torch.tensor([[h, w, 0.0, 0.0, h, w]] * b)
        return {
            "latents": self.example_latents(b, device),
            "prompt_embeds": self.example_tensor((b, length, cross_dim), device, dt, 1),
            "pooled_prompt_embeds": self.example_tensor((b, int(te2["projection_dim"])), device, dt, 2),
            "time_ids": time_ids.to(device),
            "sample_seed": self.example_seeds(b, device),
        }
