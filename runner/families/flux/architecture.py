"""Architecture config dicts of FLUX.1 (black-forest-labs/FLUX.1-dev) in two sizes: the transformer here, CLIP-L,
T5-XXL and the 16-channel VAE from runner/families/common/model_configs.py (shared with other families).

Plain data, as the shared module's (``full``: the published config.json values; ``tiny``: the same structure at a
few dozen channels); :func:`flux_configs` returns deep copies.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.families.common.model_configs import (
    _CLIP_L,
    _CLIP_TINY,
    _T5_TINY,
    _T5_XXL,
    _VAE_FLUX,
    _VAE_FLUX_TINY,
    _check_size,
)

_FLUX_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 64,  # 16 latent channels * 2x2 packing
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,  # T5-XXL d_model
    "pooled_projection_dim": 768,  # CLIP-L hidden size (pooler output)
    "guidance_embeds": True,  # FLUX.1-dev is guidance-distilled
    "axes_dims_rope": [16, 56, 56],  # sums to attention_head_dim
}
_FLUX_TRANSFORMER_TINY = {
    **_FLUX_TRANSFORMER,
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "axes_dims_rope": [4, 6, 6],
}
_FLUX = {
    "full": {"transformer": _FLUX_TRANSFORMER, "vae": _VAE_FLUX, "text_encoder": _CLIP_L, "text_encoder_2": _T5_XXL},
    "tiny": {
        "transformer": _FLUX_TRANSFORMER_TINY,
        "vae": _VAE_FLUX_TINY,
        "text_encoder": _CLIP_TINY,
        "text_encoder_2": _T5_TINY,
    },
}
# T5 prompt length: FLUX.1-dev's pipeline default is 512; the tiny byte-level tokenizer needs
# one token per byte, 64 keeps short captions whole.
FLUX_T5_MAX_LENGTH = {"full": 512, "tiny": 64}


def flux_configs(size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the Flux modules (transformer, vae, text_encoder, text_encoder_2) of one size."""
    _check_size(size)
    return copy.deepcopy(_FLUX[size])
