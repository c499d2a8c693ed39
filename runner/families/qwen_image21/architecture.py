"""Architecture config dicts of the Qwen-Image 2.1 family (``trainer=qwen_image21``), in two sizes.

Plain data (accessors return deep copies), as :mod:`runner.families.common.model_configs`. ``"full"``:
no published ``config.json`` could be read offline, so the transformer and VAE are the defaults of
diffusers 0.42.1's ``QwenImage21Transformer2DModel`` and ``AutoencoderKLQwenImage21`` (the classes'
docstrings describe them as the 2.1 checkpoint's: 32 single-stream blocks of width 4096, 7.0 B; a
16x, 64-channel RGBA VAE with its latent statistics), and the text encoder is Qwen3-VL-8B-Instruct's
published ``config.json`` (``Qwen3VLForConditionalGeneration``, hidden size 4096 = the transformer's
``context_in_dim``), as recalled, vision tower included as the pipeline loads it. ``"tiny"`` keeps every
structural feature the trainer relies on (64 unpatched latent channels at 16x, the block-causal joint
sequence with M-RoPE positions, the RGBA causal-3D VAE, a Qwen3-VL with interleaved M-RoPE and a
vision tower) at widths of a few dozen channels.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.families.common.model_configs import _check_size
from runner.families.qwen_image.architecture import TINY_QWEN_SPECIALS, TINY_QWEN_VISION_SPECIALS, TINY_QWEN_VOCAB

_TRANSFORMER = {  # QwenImage21Transformer2DModel's defaults (diffusers 0.42.1): 7.0 B parameters
    "patch_size": 1,  # latents go in unpatched: one token per 16x16 px
    "in_channels": 64,
    "out_channels": 64,
    "num_layers": 32,
    "attention_head_dim": 128,
    "num_attention_heads": 32,
    "context_in_dim": 4096,  # Qwen3-VL-8B hidden size
    "mlp_ratio": 3,
    "axes_dims_rope": [16, 56, 56],
    "causal_condition": True,
}
_TRANSFORMER_TINY = {
    **_TRANSFORMER,
    "num_layers": 3,  # three blocks: offload=stream keeps two in its window and streams the third
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "context_in_dim": 32,
    "axes_dims_rope": [4, 6, 6],
}
# AutoencoderKLQwenImage21's defaults (diffusers 0.42.1), latents_mean/latents_std included (the class's).
_VAE = {
    "base_dim": 96,
    "decoder_base_dim": 144,
    "z_dim": 64,
    "dim_mult": [1, 2, 4, 8, 8],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True, True],
    "in_channels": 4,  # RGBA: an opaque image's alpha channel is +1 after the pipeline's [-1, 1] scaling
    "out_channels": 4,
    "scale_factor_temporal": 8,
    "scale_factor_spatial": 16,
}
_VAE_TINY = {**_VAE, "base_dim": 8, "decoder_base_dim": 12, "num_res_blocks": 1}

_QWEN3_VL_8B = {  # Qwen/Qwen3-VL-8B-Instruct config.json (8.8 B parameters)
    "text_config": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                            "mrope_interleaved": True},
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 4304,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 4096,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
    },
    # The offline tokenizer's vision specials (see runner/families/qwen_image/architecture.py for why not
    # the published 151655 / 151656 / 151652 / 151653; a folder's config.json keeps its own).
    "image_token_id": TINY_QWEN_VISION_SPECIALS["<|image_pad|>"],
    "video_token_id": TINY_QWEN_VISION_SPECIALS["<|video_pad|>"],
    "vision_start_token_id": TINY_QWEN_VISION_SPECIALS["<|vision_start|>"],
    "vision_end_token_id": TINY_QWEN_VISION_SPECIALS["<|vision_end|>"],
    "tie_word_embeddings": False,
}
_QWEN3_VL_TINY = {
    **_QWEN3_VL_8B,
    "text_config": {
        **_QWEN3_VL_8B["text_config"],
        "vocab_size": TINY_QWEN_VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True},  # sums to head_dim / 2 = 4
        "bos_token_id": TINY_QWEN_SPECIALS["<|endoftext|>"],
        "eos_token_id": TINY_QWEN_SPECIALS["<|im_end|>"],
    },
    "vision_config": {
        **_QWEN3_VL_8B["vision_config"],
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 32,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    },
}

_QWEN_IMAGE21 = {
    "full": {"transformer": _TRANSFORMER, "vae": _VAE, "text_encoder": _QWEN3_VL_8B},
    "tiny": {"transformer": _TRANSFORMER_TINY, "vae": _VAE_TINY, "text_encoder": _QWEN3_VL_TINY},
}
# Caption tokens kept after the system line (trainer.max_sequence_length's default); the tiny byte-level
# tokenizer spells captions byte by byte.
QWEN21_MAX_SEQUENCE_LENGTH = {"full": 512, "tiny": 96}


def qwen_image21_configs(size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the Qwen-Image 2.1 modules (transformer, vae, text_encoder) of one size."""
    _check_size(size)
    return copy.deepcopy(_QWEN_IMAGE21[size])
