"""Architecture config dicts of SD1.5 (stable-diffusion-v1-5) and SD2.1 (stabilityai/stable-diffusion-2-1) in two
sizes: the U-Nets and VAE scalings here, the CLIP text towers from runner/families/common/model_configs.py.

Plain data, as the shared module's (``full``: the published config.json values; ``tiny``: the same structure at a
few dozen channels); :func:`sd15_configs` returns deep copies.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.families.common.model_configs import (
    _CLIP_H,
    _CLIP_H_TINY,
    _CLIP_L,
    _CLIP_TINY,
    _VAE_SDXL,
    _VAE_TINY,
    _check_size,
)

_VAE_SD15 = {**_VAE_SDXL, "scaling_factor": 0.18215, "sample_size": 512}  # SD1.5; SD2.1's is the same at 768
_VAE_SD15_TINY = {**_VAE_TINY, "scaling_factor": 0.18215}
_SD15_UNET = {  # stable-diffusion-v1-5 unet/config.json (~860 M params)
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "block_out_channels": [320, 640, 1280, 1280],
    "layers_per_block": 2,
    "attention_head_dim": 8,
    "cross_attention_dim": 768,
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "act_fn": "silu",
}
_UNET_SD15_TINY = {
    **_SD15_UNET,
    "sample_size": 8,
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "block_out_channels": [32, 64],
    "attention_head_dim": 4,
    "cross_attention_dim": 32,  # the tiny CLIP's hidden size
}
_SD21_UNET = {  # stabilityai/stable-diffusion-2-1 unet/config.json (768 px, v-prediction; ~866 M params)
    **_SD15_UNET,
    "sample_size": 96,
    "attention_head_dim": [5, 10, 20, 20],
    "cross_attention_dim": 1024,  # OpenCLIP ViT-H
    "use_linear_projection": True,
    "upcast_attention": True,
}
_UNET_SD21_TINY = {**_UNET_SD15_TINY, "attention_head_dim": [2, 4], "use_linear_projection": True,
                   "upcast_attention": True}
_SD15 = {
    "sd15": {
        "full": {"unet": _SD15_UNET, "vae": _VAE_SD15, "text_encoder": _CLIP_L},
        "tiny": {"unet": _UNET_SD15_TINY, "vae": _VAE_SD15_TINY, "text_encoder": _CLIP_TINY},
    },
    "sd21": {
        "full": {"unet": _SD21_UNET, "vae": {**_VAE_SD15, "sample_size": 768}, "text_encoder": _CLIP_H},
        "tiny": {"unet": _UNET_SD21_TINY, "vae": _VAE_SD15_TINY, "text_encoder": _CLIP_H_TINY},
    },
}


def sd15_configs(variant: str, size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the SD1.5 or SD2.1 modules (unet, vae, text_encoder); ``variant``: sd15 | sd21."""
    _check_size(size)
    return copy.deepcopy(_SD15[variant][size])
