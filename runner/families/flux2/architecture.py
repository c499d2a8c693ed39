"""Architecture config dicts of the Flux.2 family (``trainer=flux2``), in two sizes.

A sibling of :mod:`runner.families.common.model_configs` (same rules: plain data, accessors return deep
copies). ``"full"`` is FLUX.2 dev (black-forest-labs/FLUX.2-dev): a 32 B ``Flux2Transformer2DModel``
(8 double-stream and 48 single-stream blocks of width 6144), the 32-channel ``AutoencoderKLFlux2``
and Mistral-Small-3.1-24B (``Mistral3ForConditionalGeneration``, Pixtral vision tower included, as
``Flux2Pipeline`` loads it) as the text encoder.

Source of the numbers: the docs corpus searched for this work held no FLUX.2 ``config.json`` (it
answered with FLUX.1 files only), so the transformer's and the VAE's values are diffusers 0.42's
``Flux2Transformer2DModel`` / ``AutoencoderKLFlux2`` constructor defaults, which diffusers wrote for
the FLUX.2 dev checkpoint (https://huggingface.co/black-forest-labs/FLUX.2-dev/blob/main/transformer/config.json,
.../vae/config.json); the text encoder's are mistralai/Mistral-Small-3.1-24B-Instruct-2503's
``config.json`` (https://huggingface.co/mistralai/Mistral-Small-3.1-24B-Instruct-2503/blob/main/config.json).
``tests/runner/families/flux2/test_flux2.py`` checks the transformer's parameter count on ``meta``.

``"tiny"`` keeps every structural feature the trainer relies on (2x2 patchified 4*C-channel
tokens, the VAE's batch-norm statistics, the 4-axis rope, guidance embedding, a Mistral 3 with 30+
layers so that the pipeline's hidden layers 10, 20 and 30 exist, a Pixtral tower) at widths of a
few dozen channels.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.families.common.model_configs import _check_size

# Flux2Pipeline._get_mistral_3_small_prompt_embeds: the hidden states stacked along the feature axis
# (hidden_states[0] is the embedding output), so the transformer's joint_attention_dim is 3 x hidden.
MISTRAL_HIDDEN_LAYERS = (10, 20, 30)
MAX_SEQUENCE_LENGTH = 512  # Flux2Pipeline's max_sequence_length default (text tokens, template included)

# The tiny byte-level Mistral tokenizer (runner.families.common.tokenizers.mistral_tokenizer): 256 byte
# symbols, then its specials.
TINY_MISTRAL_SPECIALS = {"<pad>": 256, "<s>": 257, "</s>": 258, "[INST]": 259, "[/INST]": 260,
                         "[SYSTEM_PROMPT]": 261, "[/SYSTEM_PROMPT]": 262, "[IMG]": 263}
TINY_MISTRAL_VOCAB = 272  # 264 ids, rounded up to a multiple of 8

_TRANSFORMER = {  # FLUX.2 dev transformer/config.json (diffusers' Flux2Transformer2DModel defaults)
    "patch_size": 1,
    "in_channels": 128,  # 32 latent channels x the 2x2 patchify
    "out_channels": None,
    "num_layers": 8,
    "num_single_layers": 48,
    "attention_head_dim": 128,
    "num_attention_heads": 48,
    "joint_attention_dim": 15360,  # 3 x Mistral-Small-3.1's 5120
    "timestep_guidance_channels": 256,
    "mlp_ratio": 3.0,
    "axes_dims_rope": [32, 32, 32, 32],  # (T, H, W, L) ids; sums to attention_head_dim
    "rope_theta": 2000,
    "eps": 1e-6,
    "guidance_embeds": True,  # FLUX.2 dev is guidance-distilled
}
_TRANSFORMER_TINY = {
    **_TRANSFORMER,
    "in_channels": 32,  # the tiny VAE's 8 channels x 4
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 96,  # 3 x the tiny Mistral's 32
    "timestep_guidance_channels": 32,
    "axes_dims_rope": [4, 4, 4, 4],
}
_VAE = {  # FLUX.2 dev vae/config.json (diffusers' AutoencoderKLFlux2 defaults)
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 32,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "mid_block_add_attention": True,
    "batch_norm_eps": 1e-4,
    "batch_norm_momentum": 0.1,
    "patch_size": [2, 2],
}
_VAE_TINY = {**_VAE, "block_out_channels": [8, 16, 16, 16], "layers_per_block": 1, "latent_channels": 8,
             "norm_num_groups": 8, "sample_size": 64}  # four blocks: the same factor 8

_MISTRAL_SMALL_31 = {  # mistralai/Mistral-Small-3.1-24B-Instruct-2503 config.json (FLUX.2 dev text_encoder/)
    "text_config": {
        "model_type": "mistral",
        "vocab_size": 131072,
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000000.0,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "model_type": "pixtral",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "head_dim": 64,
        "image_size": 1540,
        "patch_size": 14,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
    },
    "image_token_index": 10,
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "vision_feature_layer": -1,
    "tie_word_embeddings": False,  # its own lm_head (131072 x 5120), loaded though the pipeline never calls it
}
_MISTRAL_TINY = {
    **_MISTRAL_SMALL_31,
    "text_config": {
        **_MISTRAL_SMALL_31["text_config"],
        "vocab_size": TINY_MISTRAL_VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 30,  # hidden_states[30] must exist (MISTRAL_HIDDEN_LAYERS)
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 1024,
        "pad_token_id": TINY_MISTRAL_SPECIALS["<pad>"],
        "bos_token_id": TINY_MISTRAL_SPECIALS["<s>"],
        "eos_token_id": TINY_MISTRAL_SPECIALS["</s>"],
    },
    "vision_config": {**_MISTRAL_SMALL_31["vision_config"], "hidden_size": 16, "intermediate_size": 32,
                      "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8, "image_size": 56},
    "image_token_index": TINY_MISTRAL_SPECIALS["[IMG]"],  # must exist in the tiny vocabulary; no image is fed
}

# FLUX.2 klein (black-forest-labs/FLUX.2-klein-4B, FLUX.2-klein-9B): the same blocks, narrower and fewer, no
# guidance embedding, Qwen3 as the text encoder (hidden states 9, 18, 27 stacked: 3 x its width). These values
# are written from the published transformer/ and text_encoder/ config.json files as recalled, NOT checked
# against a copy here (the docs corpus held none): the parameter counts on meta (~3.9 B and ~9.1 B) are what
# tests/runner/families/flux2/test_flux2.py checks, and a real folder's config.json always wins (model.path).
QWEN3_HIDDEN_LAYERS = (9, 18, 27)  # Flux2KleinPipeline._get_qwen3_prompt_embeds
_KLEIN_4B = {**_TRANSFORMER, "num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24,
             "joint_attention_dim": 7680, "guidance_embeds": False}  # 3 x Qwen3-4B's 2560
_KLEIN_9B = {**_TRANSFORMER, "num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32,
             "joint_attention_dim": 12288, "guidance_embeds": False}  # 3 x Qwen3-8B's 4096
_KLEIN_TINY = {**_TRANSFORMER_TINY, "guidance_embeds": False}
_QWEN3_4B = {  # Qwen/Qwen3-4B config.json (FLUX.2 klein 4B text_encoder/)
    "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "attention_bias": False, "use_sliding_window": False,
}
_QWEN3_8B = {**_QWEN3_4B, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}  # Qwen/Qwen3-8B
_QWEN3_TINY = {**_QWEN3_4B, "vocab_size": 264, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 27,  # hidden_states[27] must exist (QWEN3_HIDDEN_LAYERS)
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 1024,
               "bos_token_id": 256, "eos_token_id": 258}  # the tiny byte-level Qwen tokenizer's specials

_FLUX2 = {
    "klein": {
        "full": {"transformer": _KLEIN_4B, "vae": _VAE, "text_encoder": _QWEN3_4B},
        "tiny": {"transformer": _KLEIN_TINY, "vae": _VAE_TINY, "text_encoder": _QWEN3_TINY},
    },
    "klein-9b": {
        "full": {"transformer": _KLEIN_9B, "vae": _VAE, "text_encoder": _QWEN3_8B},
        "tiny": {"transformer": _KLEIN_TINY, "vae": _VAE_TINY, "text_encoder": _QWEN3_TINY},
    },
    "dev": {
        "full": {"transformer": _TRANSFORMER, "vae": _VAE, "text_encoder": _MISTRAL_SMALL_31},
        "tiny": {"transformer": _TRANSFORMER_TINY, "vae": _VAE_TINY, "text_encoder": _MISTRAL_TINY},
    },
}
VARIANTS = tuple(_FLUX2)
KLEIN = ("klein", "klein-9b")


def flux2_configs(variant: str, size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the Flux.2 modules (transformer, vae, text_encoder) of one variant and size."""
    _check_size(size)
    return copy.deepcopy(_FLUX2[variant][size])
