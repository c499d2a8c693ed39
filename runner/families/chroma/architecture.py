"""Architecture config dicts of Chroma (lodestones/Chroma1-HD) in two sizes: the transformer here, T5-XXL and
FLUX.1's VAE from runner/families/common/model_configs.py.

Plain data, as the shared module's (``full``: the published config.json values; ``tiny``: the same structure at a
few dozen channels); :func:`chroma_configs` returns deep copies.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.families.common.model_configs import (
    _T5_TINY,
    _T5_XXL,
    _VAE_FLUX,
    _VAE_FLUX_TINY,
    _check_size,
)

# lodestones/Chroma1-HD transformer/config.json (8.9 B params): FLUX.1-schnell's blocks with the
# per-block modulation linears pruned into one shared "distilled guidance" approximator, no CLIP
# pooled projection and no guidance embedding. The values are diffusers' ChromaTransformer2DModel
# defaults, which were taken from that folder.
_CHROMA_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 64,  # 16 latent channels * 2x2 packing, as Flux
    "out_channels": None,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,  # T5-XXL d_model
    "axes_dims_rope": [16, 56, 56],
    "approximator_num_channels": 64,
    "approximator_hidden_dim": 5120,
    "approximator_layers": 5,
}
_CHROMA_TRANSFORMER_TINY = {
    **_CHROMA_TRANSFORMER,
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,  # the tiny T5's d_model
    "axes_dims_rope": [4, 6, 6],
    "approximator_num_channels": 16,
    "approximator_hidden_dim": 32,
    "approximator_layers": 2,
}
_CHROMA = {  # Flux's VAE and T5-XXL; no CLIP
    "full": {"transformer": _CHROMA_TRANSFORMER, "vae": _VAE_FLUX, "text_encoder": _T5_XXL},
    "tiny": {"transformer": _CHROMA_TRANSFORMER_TINY, "vae": _VAE_FLUX_TINY, "text_encoder": _T5_TINY},
}


def chroma_configs(size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the Chroma modules (transformer, vae, text_encoder: T5-XXL) of one size."""
    _check_size(size)
    return copy.deepcopy(_CHROMA[size])
