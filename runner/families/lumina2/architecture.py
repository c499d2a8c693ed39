"""Architecture config dicts of the Lumina 2 family (``trainer=lumina2``), in two sizes.

A sibling of :mod:`runner.families.common.model_configs` (same rules: plain data, accessors return deep
copies). ``"full"`` is the published Alpha-VLLM/Lumina-Image-2.0 architecture: a 2.6 B unified
NextDiT (``Lumina2Transformer2DModel``: 26 joint blocks of width 2304, two context-refiner and two
noise-refiner blocks), FLUX.1's 16-channel VAE and Gemma-2 2B as the text encoder
(``Gemma2Model``). ``"tiny"`` keeps every structural feature the trainer relies on (2x2 patchify
inside the transformer, the refiners, 3-axis RoPE over caption and image positions, a Gemma-2 with
at least two layers since the pipeline reads the second-to-last hidden state) at widths of a few
dozen channels.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.families.common.model_configs import _VAE_FLUX, _VAE_FLUX_TINY, _check_size
from runner.families.qwen_image.architecture import TINY_QWEN_SPECIALS, TINY_QWEN_VOCAB

# Alpha-VLLM/Lumina-Image-2.0 transformer/config.json (diffusers 0.33): diffusers' defaults but for
# cap_feat_dim (Gemma-2 2B's width); the same dict appears verbatim in public ports' test fixtures.
_TRANSFORMER = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": None,
    "hidden_size": 2304,
    "num_layers": 26,
    "num_refiner_layers": 2,
    "num_attention_heads": 24,
    "num_kv_heads": 8,
    "multiple_of": 256,
    "ffn_dim_multiplier": None,
    "norm_eps": 1e-5,
    "scaling_factor": 1.0,
    "axes_dim_rope": [32, 32, 32],  # sums to the head dim, 2304 / 24 = 96
    "axes_lens": [300, 512, 512],
    "cap_feat_dim": 2304,
}
_TRANSFORMER_TINY = {
    **_TRANSFORMER,
    "hidden_size": 32,
    "num_layers": 3,  # three blocks: offload=stream keeps two in its window and streams the third
    "num_refiner_layers": 1,
    "num_attention_heads": 2,
    "num_kv_heads": 1,
    "multiple_of": 16,
    "axes_dim_rope": [4, 6, 6],  # sums to 32 / 2 = 16
    "cap_feat_dim": 32,  # the tiny Gemma-2's hidden size
}

_GEMMA2_2B = {  # Alpha-VLLM/Lumina-Image-2.0 text_encoder/config.json (google/gemma-2-2b, 2.6 B parameters)
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}
_GEMMA2_TINY = {
    **_GEMMA2_2B,
    "vocab_size": TINY_QWEN_VOCAB,  # the tiny byte-level tokenizer's ids
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,  # >= 2: the pipeline reads hidden_states[-2]
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "query_pre_attn_scalar": 8,
    "max_position_embeddings": 512,
    "pad_token_id": TINY_QWEN_SPECIALS["<|endoftext|>"],
    "eos_token_id": TINY_QWEN_SPECIALS["<|im_end|>"],
    "bos_token_id": TINY_QWEN_SPECIALS["<|im_start|>"],
}

_LUMINA2 = {  # FLUX.1's VAE, as the published vae/config.json is
    "full": {"transformer": _TRANSFORMER, "vae": _VAE_FLUX, "text_encoder": _GEMMA2_2B},
    "tiny": {"transformer": _TRANSFORMER_TINY, "vae": _VAE_FLUX_TINY, "text_encoder": _GEMMA2_TINY},
}
# Lumina2Pipeline's default max_sequence_length (system prompt and caption together).
LUMINA2_MAX_SEQUENCE_LENGTH = 256
# Lumina2Pipeline.system_prompt: what every caption is prefixed with (then " <Prompt Start> ").
LUMINA2_SYSTEM_PROMPT = ("You are an assistant designed to generate superior images with the superior degree of "
                         "image-text alignment based on textual prompts or user prompts.")


def lumina2_configs(size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the Lumina 2 modules (transformer, vae, text_encoder) of one size."""
    _check_size(size)
    return copy.deepcopy(_LUMINA2[size])
