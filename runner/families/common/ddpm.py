"""The DDPM loss family: a denoiser trained to predict the noise (epsilon) or the velocity (v).

What SDXL and SD1.5/SD2.1 share, from diffusers' ``train_text_to_image*.py`` scripts: a
``DDPMScheduler`` with the family's beta schedule; per sample a noise draw and an integer
timestep ``t ~ U{0, ..., T-1}`` from the sample's seed; ``x_t = add_noise(x0, noise, t)``; the
target is the noise (epsilon) or ``get_velocity(x0, noise, t)`` (v_prediction); the loss is the
MSE in float32, averaged over the latent loss mask where ``data.masks`` gives one. ``loss.noise_offset``, ``loss.min_snr_gamma`` and ``loss.type`` change it as
runner/loss/objectives.py describes; at their defaults this is the plain loss, bit for bit.

A family sets ``noise_schedule`` (the betas) and implements ``predict`` (the denoiser call).
"""
from __future__ import annotations

from typing import Any

import torch

from runner.errors import UserError, valid_list
from runner.families.common.base import DiffusersTrainer
from runner.families.common.latents import TIMESTEP_SALT
from runner.loss.objectives import DDPM, ddpm_noise, diffusion_loss, min_snr_weights, prior_weights
from runner.trainer import Batch, ModelSet, per_sample_rand

PREDICTION_TYPES = ("epsilon", "v_prediction")
NUM_TRAIN_TIMESTEPS = 1000
# Stable Diffusion 1.x, 2.x and XL all train on this schedule (their scheduler_config.json).
SD_NOISE_SCHEDULE: dict[str, Any] = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}


class DDPMTrainer(DiffusersTrainer):
    """Epsilon- or v-prediction loss on a DDPM noise schedule; see the module docstring."""

    objective = DDPM
    noise_schedule: dict[str, Any] = SD_NOISE_SCHEDULE
    num_train_timesteps = NUM_TRAIN_TIMESTEPS

    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        chosen = cfg.trainer.get("prediction_type")
        self.prediction_type = str(chosen) if chosen is not None else self.default_prediction_type()
        if self.prediction_type not in PREDICTION_TYPES:
            raise UserError(
                f"Unknown trainer.prediction_type '{self.prediction_type}'. "
                f"Valid values: {valid_list(self.prediction_type, PREDICTION_TYPES)}."
            )
        self._schedulers: dict[str, Any] = {}

    def default_prediction_type(self) -> str:
        """The prediction type when ``trainer.prediction_type`` is unset (the model's own)."""
        return "epsilon"

    def scheduler(self, device: torch.device) -> Any:
        """One DDPMScheduler per device: ``add_noise`` moves its tables to the samples' device
        and keeps them there, so a shared instance would flip between CPU, CUDA and meta."""
        key = str(device)
        if key not in self._schedulers:
            from diffusers import DDPMScheduler

            self._schedulers[key] = DDPMScheduler(
                num_train_timesteps=self.num_train_timesteps, prediction_type=self.prediction_type,
                **self.noise_schedule,
            )
        return self._schedulers[key]

    def timesteps(self, seeds: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """An integer timestep per sample, uniform over the schedule, from the sample's seed."""
        n = self.num_train_timesteps
        return (per_sample_rand(seeds, TIMESTEP_SALT, "cpu") * n).long().clamp_(0, n - 1).to(device)

    def loss(self, models: ModelSet, batch: Batch) -> torch.Tensor:
        """The epsilon (or v) prediction loss in float32, with the ``loss.*`` options."""
        latents = batch["latents"].float()
        seeds = batch["sample_seed"]
        device = latents.device
        sched = self.scheduler(device)
        options = self.loss_options
        noise = ddpm_noise(seeds, tuple(latents.shape[1:]), device, options)
        timesteps = self.timesteps(seeds, device)
        noisy = sched.add_noise(latents, noise, timesteps)
        target = noise if self.prediction_type == "epsilon" else sched.get_velocity(latents, noise, timesteps)
        pred = self.predict(models, noisy, timesteps, batch)
        weights = prior_weights(batch, options, device)  # data.sets role: prior, x loss.prior_weight
        if options.min_snr_gamma > 0:
            snr = min_snr_weights(sched.alphas_cumprod, timesteps, options.min_snr_gamma, self.prediction_type)
            weights = snr if weights is None else weights * snr
        return diffusion_loss(pred, target, options, weights, batch.get("loss_mask"))
