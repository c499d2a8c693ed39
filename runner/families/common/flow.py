"""The flow-matching loss family (rectified flow): a denoiser trained to predict the velocity.

What Flux and SD3.5 share, from diffusers' ``train_dreambooth_{flux,sd3}.py``: per sample a noise
draw and a t in (0, 1) from the sample's seed (``loss.timestep_sampling``, then
``loss.timestep_shift``; runner/loss/objectives.py has the formulas), ``x_t = (1 - t) x0 + t noise``, and
the target is the velocity ``noise - x0``; the loss is the MSE in float32 (``loss.type``) over the
denoiser's output layout (:meth:`~runner.families.common.base.DiffusersTrainer.pack` of the target).

A family implements ``predict`` (the denoiser call, which is handed t in (0, 1): Flux's
transformer scales it itself, SD3's takes ``1000 t``), and sets its defaults for the sampling and
the shift.
"""
from __future__ import annotations

import torch

from runner.families.common.base import DiffusersTrainer
from runner.families.common.latents import TIMESTEP_SALT
from runner.loss.objectives import FLOW, diffusion_loss, prior_weights, shifted_flow_timesteps
from runner.trainer import Batch, ModelSet, per_sample_rand, per_sample_randn


class FlowMatchTrainer(DiffusersTrainer):
    """Rectified-flow matching loss; see the module docstring."""

    objective = FLOW
    resolution_multiple = 16  # VAE factor 8 times the 2x2 patches of Flux's packing and SD3's patchify
    default_timestep_sampling = "logit_normal"  # loss.timestep_sampling unset
    default_timestep_shift = "none"  # loss.timestep_shift unset
    latent_patch = 2  # latent pixels per token side: the image's sequence length for the resolution shift

    def image_seq_len(self, latents: torch.Tensor) -> int:
        """Latent tokens of one image (``(H / p) * (W / p)``), what Flux's shift is a function of."""
        p = self.latent_patch
        return (int(latents.shape[-2]) // p) * (int(latents.shape[-1]) // p)

    def timesteps(self, seeds: torch.Tensor, seq_len: int = 4096) -> torch.Tensor:
        """t in (0, 1) per sample, computed on the CPU from the sample's uniform draw."""
        u = per_sample_rand(seeds, TIMESTEP_SALT, "cpu")
        return shifted_flow_timesteps(u, self.loss_options, seq_len, self.default_timestep_sampling,
                                      self.default_timestep_shift)

    def loss(self, models: ModelSet, batch: Batch) -> torch.Tensor:
        """Flow-matching loss between predicted and true velocity (noise - x0), in float32."""
        x0 = batch["latents"].float()
        seeds = batch["sample_seed"]
        device = x0.device
        b = x0.shape[0]
        noise = per_sample_randn(seeds, tuple(x0.shape[1:]), device, torch.float32)
        t = self.timesteps(seeds, self.image_seq_len(x0)).to(device)
        tt = t.view(b, *([1] * (x0.dim() - 1)))
        x_t = (1.0 - tt) * x0 + tt * noise
        target = self.pack(noise - x0)
        pred = self.predict(models, x_t, t, batch)
        mask = batch.get("loss_mask")  # data.masks: [B, 1, h, w] on the latent grid, packed as the target is
        if mask is not None:
            mask = self.pack(mask.to(device).expand_as(x0).contiguous())
        weights = prior_weights(batch, self.loss_options, device)  # data.sets role: prior, x loss.prior_weight
        return diffusion_loss(pred, target, self.loss_options, weights, mask)
