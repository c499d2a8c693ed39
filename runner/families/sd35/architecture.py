"""Architecture config dicts of SD3.5 Medium and Large (stabilityai/stable-diffusion-3.5-{medium,large}) in two
sizes: the transformers and VAE scalings here, the CLIP and T5 encoders from runner/families/common/model_configs.py.

Plain data, as the shared module's (``full``: the published config.json values; ``tiny``: the same structure at a
few dozen channels); :func:`sd35_configs` returns deep copies.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.families.common.model_configs import (
    _CLIP_BIGG,
    _CLIP_L,
    _CLIP_TINY,
    _CLIP_TINY_2,
    _T5_TINY,
    _T5_XXL,
    _VAE_FLUX,
    _VAE_FLUX_TINY,
    _check_size,
)

_VAE_SD3 = {**_VAE_FLUX, "scaling_factor": 1.5305, "shift_factor": 0.0609}  # 16 channels, like Flux's
_VAE_SD3_TINY = {**_VAE_FLUX_TINY, "scaling_factor": 1.5305, "shift_factor": 0.0609}
_SD3_MEDIUM = {  # stable-diffusion-3-medium transformer/config.json (~2.0 B params)
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 192,
}
_SD35_LARGE = {  # stable-diffusion-3.5-large transformer/config.json (~8.1 B params)
    **_SD3_MEDIUM,
    "num_layers": 38,
    "num_attention_heads": 38,
    "caption_projection_dim": 2432,
    "qk_norm": "rms_norm",
}
_SD35_MEDIUM = {  # stable-diffusion-3.5-medium transformer/config.json (MMDiT-X, ~2.2 B params)
    **_SD3_MEDIUM,
    "pos_embed_max_size": 384,
    "dual_attention_layers": list(range(13)),  # blocks 0-12 add a second, image-only attention
    "qk_norm": "rms_norm",
}
_SD35_LARGE_TINY = {
    **_SD35_LARGE,
    "sample_size": 8,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 4,
    "caption_projection_dim": 32,  # = heads * head dim, as in the real models
    "joint_attention_dim": 96,  # the tiny T5's width; the two tiny CLIPs (32 + 32) are zero-padded to it
    "pooled_projection_dim": 64,  # the two tiny CLIPs' projections, concatenated
    "pos_embed_max_size": 16,
}
_SD35_MEDIUM_TINY = {**_SD35_LARGE_TINY, "dual_attention_layers": [0]}
_T5_SD3_TINY = {**_T5_TINY, "d_model": 96}
_SD35_ENCODERS = {
    "full": {"vae": _VAE_SD3, "text_encoder": _CLIP_L, "text_encoder_2": _CLIP_BIGG, "text_encoder_3": _T5_XXL},
    "tiny": {"vae": _VAE_SD3_TINY, "text_encoder": _CLIP_TINY, "text_encoder_2": _CLIP_TINY_2,
             "text_encoder_3": _T5_SD3_TINY},
}
_SD35_TRANSFORMER = {
    "medium": {"full": _SD35_MEDIUM, "tiny": _SD35_MEDIUM_TINY},
    "large": {"full": _SD35_LARGE, "tiny": _SD35_LARGE_TINY},
}
# T5 prompt length: the SD3 pipelines' default max_sequence_length is 256.
SD3_T5_MAX_LENGTH = {"full": 256, "tiny": 64}


def sd35_configs(variant: str, size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the SD3.5 modules (transformer, vae, three text encoders); ``variant``: medium | large."""
    _check_size(size)
    return copy.deepcopy({"transformer": _SD35_TRANSFORMER[variant][size], **_SD35_ENCODERS[size]})
