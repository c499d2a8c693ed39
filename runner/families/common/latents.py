"""The latent helpers every built-in family uses: per-sample VAE draws and the VAE's geometry.

Apart from the trainer skeleton (runner/families/common/base.py) because the loss-family bases
(ddpm.py, flow.py) and the families read them without needing the rest of the skeleton: the
salts that keep a sample's draws apart, the posterior's moments as encode_part returns and a
cache stores them, and the VAE's downsampling factor.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from runner.trainer import per_sample_randn, salted

# Salts of the per-sample draws (see salted / per_sample_rand), shared by every family so that a
# sample's VAE draw and timestep never coincide with its noise. runner/loss/objectives.py uses 3.
VAE_SALT = 1
TIMESTEP_SALT = 2


def sample_latents(dist: Any, seeds: torch.Tensor, salt: int) -> torch.Tensor:
    """``mean + std * eps`` of a VAE posterior in float32, with eps drawn per sample.

    ``latent_dist.sample(generator)`` takes one generator for the whole batch, so the result
    would depend on how the batch is split; the mean/std form reproduces it per sample.
    """
    mean, std = dist.mean.float(), dist.std.float()
    eps = per_sample_randn(salted(seeds, salt), tuple(mean.shape[1:]), mean.device, torch.float32)
    return mean + std * eps


class LatentMoments(NamedTuple):
    """A VAE posterior reduced to what sampling needs: what ``encode_part`` returns and a cache stores.

    Has the ``mean``/``std`` attributes of diffusers' ``DiagonalGaussianDistribution``, so
    :func:`sample_latents` takes either.
    """

    mean: torch.Tensor
    std: torch.Tensor


def vae_scale_factor(vae_config: dict[str, Any]) -> int:
    """Downsampling factor of an AutoencoderKL: one halving per block but the last (8 for 4 blocks)."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)
