"""Architecture config dicts of the HiDream-I1 family (``trainer=hidream``), in two sizes.

``"full"`` is HiDream-ai/HiDream-I1-Full: a 17 B sparse DiT (``HiDreamImageTransformer2DModel``: 16
double-stream and 32 single-stream blocks of width 2560, a mixture of 4 routed experts, 2 active, plus a
shared one in every feed-forward), FLUX.1's 16-channel VAE and four text encoders: two Long-CLIP towers
(``CLIPTextModelWithProjection``, L and bigG, their pooled projections concatenated), T5-XXL's encoder
and Llama-3.1-8B-Instruct (``LlamaForCausalLM``, every layer's hidden state read). Sources per table
below. ``"tiny"`` keeps every structural feature the trainer relies on (2x2 patchify inside the
transformer, both block kinds, the experts and their gate, one caption projection per block reading its
own Llama layer, the pooled CLIP pair) at widths of a few dozen channels.
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
from runner.families.qwen_image.architecture import TINY_QWEN_SPECIALS, TINY_QWEN_VOCAB

# HiDreamImagePipeline's default max_sequence_length: the CLIP, T5 and Llama prompts are each padded to it.
HIDREAM_MAX_SEQUENCE_LENGTH = 128

# HiDream-I1-Full transformer/config.json, as the public diffusers conversion script for HiDream-I1 spells it
# out (same values as the published folder's config: 16 + 32 blocks, 20 heads of 128, 4 experts, 2 active).
_TRANSFORMER = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 16,
    "num_single_layers": 32,
    "attention_head_dim": 128,
    "num_attention_heads": 20,
    "caption_channels": [4096, 4096],  # [T5-XXL d_model, Llama-3.1-8B hidden]
    "text_emb_dim": 2048,  # the pooled CLIP-L (768) and CLIP-bigG (1280) projections
    "num_routed_experts": 4,
    "num_activated_experts": 2,
    "axes_dims_rope": [64, 32, 32],
    "max_resolution": [128, 128],
    "llama_layers": list(range(32)) + [31] * 16,  # one Llama layer per block (48)
}
_TRANSFORMER_TINY = {
    **_TRANSFORMER,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "caption_channels": [32, 32],  # the tiny T5's d_model, the tiny Llama's hidden size
    "text_emb_dim": 64,  # the two tiny CLIPs' projections (32 + 32)
    "axes_dims_rope": [8, 4, 4],  # sums to the head dim
    "max_resolution": [32, 32],  # 256 tokens: a non-square latent is padded to it (the model's own layout)
    "llama_layers": [0, 1, 1, 1],
}

# HiDream-I1's text encoders are Long-CLIP towers: CLIP-L / bigG with 248 positions (recalled from the
# published text_encoder*/config.json, not re-checked here); the pipeline pads their prompts to 128.
_LONG_CLIP_L = {**_CLIP_L, "max_position_embeddings": 248}
_LONG_CLIP_G = {**_CLIP_BIGG, "max_position_embeddings": 248}
_CLIP_TINY_LONG = {**_CLIP_TINY, "max_position_embeddings": HIDREAM_MAX_SEQUENCE_LENGTH}
_CLIP_TINY_LONG_2 = {**_CLIP_TINY_2, "max_position_embeddings": HIDREAM_MAX_SEQUENCE_LENGTH}

_LLAMA31_8B = {  # meta-llama/Llama-3.1-8B-Instruct config.json (the model card's published architecture)
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
_LLAMA_TINY = {
    **_LLAMA31_8B,
    "vocab_size": TINY_QWEN_VOCAB,  # the tiny byte-level tokenizer's ids
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16384,  # above rope_scaling's original 8192 (only the rotary table's bound)
    "bos_token_id": TINY_QWEN_SPECIALS["<|im_start|>"],
    "eos_token_id": TINY_QWEN_SPECIALS["<|endoftext|>"],
}

_HIDREAM = {
    "full": {"transformer": _TRANSFORMER, "vae": _VAE_FLUX, "text_encoder": _LONG_CLIP_L,
             "text_encoder_2": _LONG_CLIP_G, "text_encoder_3": _T5_XXL, "text_encoder_4": _LLAMA31_8B},
    "tiny": {"transformer": _TRANSFORMER_TINY, "vae": _VAE_FLUX_TINY, "text_encoder": _CLIP_TINY_LONG,
             "text_encoder_2": _CLIP_TINY_LONG_2, "text_encoder_3": _T5_TINY, "text_encoder_4": _LLAMA_TINY},
}


def hidream_configs(size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the HiDream-I1 modules (transformer, vae, four text encoders) of one size."""
    _check_size(size)
    return copy.deepcopy(_HIDREAM[size])
