"""Architecture config dicts of SDXL (stabilityai/stable-diffusion-xl-base-1.0) in two sizes: the U-Net here, the
two CLIP text towers and the VAE from runner/families/common/model_configs.py (shared with other families).

Plain data, as the shared module's (``full``: the published config.json values; ``tiny``: the same structure at a
few dozen channels); :func:`sdxl_configs` returns deep copies.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.families.common.model_configs import (
    _CLIP_BIGG,
    _CLIP_L,
    _CLIP_TINY,
    _CLIP_TINY_2,
    _VAE_SDXL,
    _VAE_TINY,
    _check_size,
)

_UNET_SDXL = {
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "block_out_channels": [320, 640, 1280],
    "layers_per_block": 2,
    "transformer_layers_per_block": [1, 2, 10],
    "attention_head_dim": [5, 10, 20],
    "cross_attention_dim": 2048,  # 768 (CLIP-L) + 1280 (bigG)
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,  # 6 time ids * 256 + 1280 pooled
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "act_fn": "silu",
}
_UNET_SDXL_TINY = {
    **_UNET_SDXL,
    "sample_size": 8,
    "block_out_channels": [32, 64],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
    "layers_per_block": 2,
    "transformer_layers_per_block": [1, 2],
    "attention_head_dim": [2, 4],
    "cross_attention_dim": 64,  # 32 + 32: the two tiny text encoders
    "addition_time_embed_dim": 8,
    "projection_class_embeddings_input_dim": 6 * 8 + 32,  # time ids + pooled (projection_dim)
    "norm_num_groups": 32,
}
_SDXL = {
    "full": {"unet": _UNET_SDXL, "vae": _VAE_SDXL, "text_encoder": _CLIP_L, "text_encoder_2": _CLIP_BIGG},
    "tiny": {"unet": _UNET_SDXL_TINY, "vae": _VAE_TINY, "text_encoder": _CLIP_TINY, "text_encoder_2": _CLIP_TINY_2},
}


def sdxl_configs(size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the SDXL modules (unet, vae, text_encoder, text_encoder_2) of one size."""
    _check_size(size)
    return copy.deepcopy(_SDXL[size])
