"""Architecture config dicts of the Krea 2 family (``trainer=krea2``), in two sizes.

Plain data (accessors return deep copies). ``"full"``: no published ``config.json`` could be read offline, so
the transformer is the default of diffusers 0.42.1's ``Krea2Transformer2DModel`` (its docstring's Krea 2: 28
single-stream blocks of width 6144, grouped-query attention, a text-fusion stage over 12 tapped layers of
width 2560), the VAE is Qwen-Image's (``AutoencoderKLQwenImage``, as ``Krea2Pipeline`` documents), and the
text encoder is Qwen3-VL-4B-Instruct's published ``config.json`` as recalled (``Qwen3VLModel``, no LM head,
as the pipeline loads it), whose layers 2, 5, ..., 35 the pipeline taps. ``"tiny"`` keeps every structural
feature the trainer relies on (2x2 packing of 16 channels, the text-fusion stage over several tapped layers,
grouped-query attention, Qwen3-VL with interleaved M-RoPE) at widths of a few dozen channels.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.families.common.model_configs import _check_size
from runner.families.qwen_image.architecture import WAN21_VAE
from runner.families.qwen_image21.architecture import _QWEN3_VL_8B, _QWEN3_VL_TINY

_TRANSFORMER = {  # Krea2Transformer2DModel's defaults (diffusers 0.42.1)
    "in_channels": 64,  # 16 latent channels x 2x2 packing
    "num_layers": 28,
    "attention_head_dim": 128,
    "num_attention_heads": 48,
    "num_key_value_heads": 12,
    "intermediate_size": 16384,
    "timestep_embed_dim": 256,
    "text_hidden_dim": 2560,  # Qwen3-VL-4B hidden size
    "num_text_layers": 12,
    "text_num_attention_heads": 20,
    "text_num_key_value_heads": 20,
    "text_intermediate_size": 6912,
    "num_layerwise_text_blocks": 2,
    "num_refiner_text_blocks": 2,
    "axes_dims_rope": [32, 48, 48],
    "rope_theta": 1000.0,
}
_TRANSFORMER_TINY = {
    **_TRANSFORMER,
    "num_layers": 3,  # three blocks: offload=stream keeps two in its window and streams the third
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 64,
    "timestep_embed_dim": 32,
    "text_hidden_dim": 32,
    "num_text_layers": 2,
    "text_num_attention_heads": 2,
    "text_num_key_value_heads": 2,
    "text_intermediate_size": 64,
    "num_layerwise_text_blocks": 1,
    "num_refiner_text_blocks": 1,
    "axes_dims_rope": [4, 6, 6],
}
_VAE_TINY = {**WAN21_VAE, "base_dim": 8, "num_res_blocks": 1}

_QWEN3_VL_4B = {  # Qwen/Qwen3-VL-4B-Instruct config.json (4.4 B parameters)
    **_QWEN3_VL_8B,
    "text_config": {**_QWEN3_VL_8B["text_config"], "hidden_size": 2560, "intermediate_size": 9728,
                    "num_hidden_layers": 36},
    "vision_config": {**_QWEN3_VL_8B["vision_config"], "depth": 24, "hidden_size": 1024, "intermediate_size": 4096,
                      "out_hidden_size": 2560, "deepstack_visual_indexes": [5, 11, 17]},
    "tie_word_embeddings": True,
}
_QWEN3_VL_TINY3 = {**_QWEN3_VL_TINY, "text_config": {**_QWEN3_VL_TINY["text_config"], "num_hidden_layers": 3}}

_KREA2 = {
    "full": {"transformer": _TRANSFORMER, "vae": WAN21_VAE, "text_encoder": _QWEN3_VL_4B},
    "tiny": {"transformer": _TRANSFORMER_TINY, "vae": _VAE_TINY, "text_encoder": _QWEN3_VL_TINY3},
}
# The text encoder's hidden_states entries (0: the embeddings) stacked per token: Krea2Pipeline's default taps
# (every third layer of the 36) at full size, the tiny encoder's last two of three. One per num_text_layers.
SELECT_LAYERS = {"full": (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35), "tiny": (2, 3)}
KREA2_MAX_SEQUENCE_LENGTH = {"full": 512, "tiny": 96}


def krea2_configs(size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the Krea 2 modules (transformer, vae, text_encoder) of one size."""
    _check_size(size)
    return copy.deepcopy(_KREA2[size])
