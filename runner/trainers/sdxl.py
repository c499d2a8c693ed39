"""SDXL: train the U-Net (fully or with LoRA) with the DDPM noise-prediction loss.

The recipe is diffusers' ``train_text_to_image_sdxl.py`` reduced to the trainer protocol:
VAE latents times ``scaling_factor``; prompt embeddings from the penultimate hidden states of
both CLIP text encoders, concatenated; the pooled, projected output of the second encoder and
the six ``time_ids`` (original size, crop top-left, target size) as the added conditioning.

Every random draw (VAE posterior sample, noise, timestep) comes from the sample's own seed, so
the loss of a batch is the mean of the losses of any split of it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from runner.errors import UserError, valid_list
from runner.trainer import Batch, ModelSet, batch_device, per_sample_rand, per_sample_randn
from runner.trainers import model_configs
from runner.trainers.configs import SDXLTrainerConfig
from runner.trainers.base import DiffusersTrainer, LatentMoments, sample_latents, vae_scale_factor
from runner.trainers.loading import compute_dtype
from runner.trainers.tokenizers import clip_tokenizer, tokenize

PREDICTION_TYPES = ("epsilon", "v_prediction")
NUM_TRAIN_TIMESTEPS = 1000
# Salts for the per-sample draws (see base.salted / per_sample_rand).
VAE_SALT = 1
TIMESTEP_SALT = 2


class SDXLTrainer(DiffusersTrainer):
    """SDXL U-Net, DDPM loss (epsilon or v-prediction)."""

    Config = SDXLTrainerConfig
    denoiser = "unet"
    family = "sdxl"
    reference_repo = "stabilityai/stable-diffusion-xl-base-1.0"

    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        self.prediction_type = str(cfg.trainer.get("prediction_type", "epsilon"))
        if self.prediction_type not in PREDICTION_TYPES:
            raise UserError(
                f"Unknown trainer.prediction_type '{self.prediction_type}'. "
                f"Valid values: {valid_list(self.prediction_type, PREDICTION_TYPES)}."
            )
        res = self.resolution()
        if res <= 0 or res % 8:
            raise UserError(
                f"data.resolution={res} is not usable for SDXL: it must be a positive multiple of 8 (the VAE factor)."
            )
        self.check_sizes(8, "the VAE factor")
        self._schedulers: dict[str, Any] = {}

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
        return model_configs.sdxl_configs(self.size)

    def default_tokenizer(self, name: str) -> Any:
        return clip_tokenizer(model_configs.CLIP_MAX_LENGTH)

    def pipeline_class(self) -> type:
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline

    def inference_scheduler(self) -> Any:
        """stabilityai/stable-diffusion-xl-base-1.0's scheduler/scheduler_config.json, with this
        run's prediction type."""
        from diffusers import EulerDiscreteScheduler

        return EulerDiscreteScheduler(
            num_train_timesteps=NUM_TRAIN_TIMESTEPS, beta_start=0.00085, beta_end=0.012,
            beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading",
            prediction_type=self.prediction_type,
        )

    def scheduler(self, device: torch.device) -> Any:
        """One DDPMScheduler per device: ``add_noise`` moves its tables to the samples' device
        and keeps them there, so a shared instance would flip between CPU, CUDA and meta."""
        key = str(device)
        if key not in self._schedulers:
            from diffusers import DDPMScheduler

            self._schedulers[key] = DDPMScheduler(
                num_train_timesteps=NUM_TRAIN_TIMESTEPS,
                beta_schedule="scaled_linear",
                beta_start=0.00085,
                beta_end=0.012,
                prediction_type=self.prediction_type,
            )
        return self._schedulers[key]

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
        ids1 = tokenize(tok1, captions, self._max_length(tok1, te1.config), device)
        ids2 = tokenize(tok2, captions, self._max_length(tok2, te2.config), device)
        out1 = te1(ids1, output_hidden_states=True)
        out2 = te2(ids2, output_hidden_states=True)
        h1 = out1.hidden_states[-2]
        prompt_embeds = torch.cat([h1, out2.hidden_states[-2].to(h1.dtype)], dim=-1)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": out2.text_embeds}

    def finish_encode(self, parts: dict[str, dict[str, torch.Tensor]], batch: Batch) -> Batch:
        """Sample the latents with each sample's seed and add the six SDXL ``time_ids``.

        Image size comes from the latents (times the VAE factor), not the pixels, so a batch
        whose parts were all read from a cache needs no pixels.
        """
        seeds = batch["sample_seed"]
        lat = parts["latents"]
        moments = LatentMoments(lat["latent_mean"], lat["latent_std"])
        latents = sample_latents(moments, seeds, VAE_SALT) * self.vae_setting("scaling_factor")
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
        return {
            "latents": latents,
            "prompt_embeds": parts["text"]["prompt_embeds"],
            "pooled_prompt_embeds": parts["text"]["pooled_prompt_embeds"],
            "time_ids": time_ids,
            "sample_seed": seeds,
        }

    @staticmethod
    def _max_length(tokenizer: Any, encoder_config: Any) -> int:
        return int(min(tokenizer.model_max_length, encoder_config.max_position_embeddings))

    def loss(self, models: ModelSet, batch: Batch) -> torch.Tensor:
        """Mean squared error of the U-Net's epsilon (or v) prediction, in float32."""
        latents = batch["latents"].float()
        seeds = batch["sample_seed"]
        device = latents.device
        sched = self.scheduler(device)
        n = sched.config.num_train_timesteps
        noise = per_sample_randn(seeds, tuple(latents.shape[1:]), device, torch.float32)
        timesteps = (per_sample_rand(seeds, TIMESTEP_SALT, "cpu") * n).long().clamp_(0, n - 1).to(device)
        noisy = sched.add_noise(latents, noise, timesteps)
        target = noise if self.prediction_type == "epsilon" else sched.get_velocity(latents, noise, timesteps)

        unet = models["unet"]
        dt = compute_dtype(unet)
        pred = unet(
            noisy.to(dt),
            timesteps,
            encoder_hidden_states=batch["prompt_embeds"].to(dt),
            added_cond_kwargs={
                "text_embeds": batch["pooled_prompt_embeds"].to(dt),
                "time_ids": batch["time_ids"].to(dt),
            },
            return_dict=False,
        )[0]
        return F.mse_loss(pred.float(), target.float(), reduction="mean")

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives at :meth:`planned_size`."""
        unet_cfg = self.component_config("unet")
        vae_cfg = self.component_config("vae")
        te1, te2 = self.component_config("text_encoder"), self.component_config("text_encoder_2")
        h, w = self.planned_size()
        factor = vae_scale_factor(vae_cfg)
        length = min(model_configs.CLIP_MAX_LENGTH, int(te1["max_position_embeddings"]))
        cross_dim = int(te1["hidden_size"]) + int(te2["hidden_size"])
        b, dt = batch_size, self.storage_dtype
        time_ids = torch.tensor([[float(h), float(w), 0.0, 0.0, float(h), float(w)]] * b)
        return {
            "latents": self.example_tensor((b, int(unet_cfg["in_channels"]), h // factor, w // factor), device,
                                           torch.float32, 0),
            "prompt_embeds": self.example_tensor((b, length, cross_dim), device, dt, 1),
            "pooled_prompt_embeds": self.example_tensor((b, int(te2["projection_dim"])), device, dt, 2),
            "time_ids": time_ids.to(device),
            "sample_seed": self.example_seeds(b, device),
        }

