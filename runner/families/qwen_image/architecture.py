"""Architecture config dicts of the Qwen-Image family (``trainer=qwen_image``), in two sizes.

A sibling of :mod:`runner.families.common.model_configs` (same rules: plain data, accessors return deep
copies). ``"full"`` is the published Qwen/Qwen-Image architecture, the values of its
``transformer/``, ``vae/`` and ``text_encoder/`` ``config.json`` files: a 20.4 B MMDiT
(``QwenImageTransformer2DModel``, 60 double-stream blocks of width 3072), the Wan-style 16-channel
VAE (``AutoencoderKLQwenImage``) and Qwen2.5-VL-7B-Instruct as the text encoder
(``Qwen2_5_VLForConditionalGeneration``, vision tower included, as the pipeline loads it).
``"tiny"`` keeps every structural feature the trainer relies on (2x2 latent packing of 16
channels, joint attention with a text stream, the causal-3D VAE with its latent statistics, a
Qwen2.5-VL with M-RoPE and a vision tower) at widths of a few dozen channels.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.families.common.model_configs import _check_size

# The tiny byte-level Qwen2 tokenizer (runner.families.common.tokenizers.qwen2_tokenizer): 256 byte
# symbols, then <|endoftext|> = 256, <|im_start|> = 257, <|im_end|> = 258.
TINY_QWEN_VOCAB = 264  # 259 ids, rounded up to a multiple of 8
TINY_QWEN_SPECIALS = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
# The vision specials Qwen-Image-Edit's prompt uses (runner.families.common.tokenizers.qwen2_vl_tokenizer), at the
# ids the tiny Qwen2.5-VL config below gives them.
TINY_QWEN_VISION_SPECIALS = {"<|image_pad|>": 259, "<|video_pad|>": 260, "<|vision_start|>": 261, "<|vision_end|>": 262}

# The Wan 2.1 VAE's latent statistics, which the Qwen-Image VAE shares (its config.json).
WAN21_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN21_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]

_TRANSFORMER = {  # Qwen/Qwen-Image transformer/config.json (20.4 B parameters)
    "patch_size": 2,
    "in_channels": 64,  # 16 latent channels x 2x2 packing
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,  # Qwen2.5-VL-7B hidden size
    "guidance_embeds": False,
    "axes_dims_rope": [16, 56, 56],  # sums to attention_head_dim
}
_TRANSFORMER_TINY = {
    **_TRANSFORMER,
    "num_layers": 3,  # three blocks: offload=stream keeps two in its window and streams the third
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "axes_dims_rope": [4, 6, 6],
}
# Qwen/Qwen-Image vae/config.json (AutoencoderKLQwenImage, 127 M parameters): the Wan 2.1 VAE's
# architecture and latent statistics, which runner/families/wan/architecture.py builds its own on.
WAN21_VAE = {
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "latents_mean": WAN21_LATENTS_MEAN,
    "latents_std": WAN21_LATENTS_STD,
}
_VAE = WAN21_VAE
_VAE_TINY = {**_VAE, "base_dim": 8, "num_res_blocks": 1}

_QWEN25_VL_7B = {  # Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B-Instruct, 8.3 B parameters)
    "text_config": {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 28,
        "attention_dropout": 0.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "rope_theta": 1000000.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_channels": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
    },
    # The published ids are 151655 / 151656 / 151652 / 151653 (a folder's config.json keeps them, with its
    # own tokenizer). A random build tokenizes with the offline tokenizer (runner/families/common/tokenizers.py),
    # whose vision specials are these: with the published ids the prompt would hold no image token the
    # model can find (the planner, which knows the ids' values, stopped at Qwen2.5-VL's count check).
    "image_token_id": TINY_QWEN_VISION_SPECIALS["<|image_pad|>"],
    "video_token_id": TINY_QWEN_VISION_SPECIALS["<|video_pad|>"],
    "vision_start_token_id": TINY_QWEN_VISION_SPECIALS["<|vision_start|>"],
    "vision_end_token_id": TINY_QWEN_VISION_SPECIALS["<|vision_end|>"],
    "tie_word_embeddings": False,
}
_QWEN25_VL_TINY = {
    **_QWEN25_VL_7B,
    "text_config": {
        **_QWEN25_VL_7B["text_config"],
        "vocab_size": TINY_QWEN_VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_window_layers": 2,
        "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},  # sums to head_dim / 2 = 4
        "bos_token_id": TINY_QWEN_SPECIALS["<|endoftext|>"],
        "eos_token_id": TINY_QWEN_SPECIALS["<|im_end|>"],
    },
    "vision_config": {
        **_QWEN25_VL_7B["vision_config"],
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 32,
        "fullatt_block_indexes": [0],
    },
    # The special image ids exist in the tiny vocabulary; Qwen-Image feeds no image, Qwen-Image-Edit does
    # (the vision tower above: 14 px patches, 2x2 merged).
    "image_token_id": TINY_QWEN_VISION_SPECIALS["<|image_pad|>"],
    "video_token_id": TINY_QWEN_VISION_SPECIALS["<|video_pad|>"],
    "vision_start_token_id": TINY_QWEN_VISION_SPECIALS["<|vision_start|>"],
    "vision_end_token_id": TINY_QWEN_VISION_SPECIALS["<|vision_end|>"],
}

_QWEN_IMAGE = {
    "full": {"transformer": _TRANSFORMER, "vae": _VAE, "text_encoder": _QWEN25_VL_7B},
    "tiny": {"transformer": _TRANSFORMER_TINY, "vae": _VAE_TINY, "text_encoder": _QWEN25_VL_TINY},
}
# Text tokens kept after the prompt template (trainer.max_sequence_length's default): the
# pipeline's own default length; the tiny byte-level tokenizer spells captions byte by byte.
QWEN_MAX_SEQUENCE_LENGTH = {"full": 512, "tiny": 96}


def qwen_image_configs(size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the Qwen-Image modules (transformer, vae, text_encoder) of one size."""
    _check_size(size)
    return copy.deepcopy(_QWEN_IMAGE[size])
