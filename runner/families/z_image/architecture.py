"""Architecture config dicts of the Z-Image family (``trainer=z_image``), in two sizes.

A sibling of :mod:`runner.families.common.model_configs` (same rules: plain data, accessors return deep
copies). ``"full"`` is the published Tongyi-MAI/Z-Image-Turbo architecture: a 6.2 B single-stream
DiT (``ZImageTransformer2DModel``: 30 main blocks of width 3840, two noise-refiner and two
context-refiner blocks), FLUX.1's 16-channel VAE (``AutoencoderKL``, scaling 0.3611, shift 0.1159)
and Qwen3-4B as the text encoder (``Qwen3ForCausalLM``, tied embeddings, so no separate LM head).
``"tiny"`` keeps every structural feature the trainer relies on (2x2 patchify inside the
transformer, the refiners, 3-axis RoPE, the caption padded to 32 tokens, a Qwen3 with at least two
layers since the pipeline reads the second-to-last hidden state) at widths of a few dozen channels.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.families.common.model_configs import _VAE_FLUX, _VAE_FLUX_TINY, _check_size
from runner.families.qwen_image.architecture import TINY_QWEN_SPECIALS, TINY_QWEN_VOCAB

# Tongyi-MAI/Z-Image-Turbo transformer/config.json (diffusers 0.36): these values, with
# axes_lens [1536, 512, 512] (diffusers' own default is [1024, 512, 512]); the same dict appears
# verbatim in several public ports of the model (e.g. its MLX and Swift ports' TRANSFORMER_CONFIG).
_TRANSFORMER = {
    "all_patch_size": [2],
    "all_f_patch_size": [1],
    "in_channels": 16,
    "dim": 3840,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "n_heads": 30,
    "n_kv_heads": 30,
    "norm_eps": 1e-5,
    "qk_norm": True,
    "cap_feat_dim": 2560,  # Qwen3-4B hidden size
    "rope_theta": 256.0,
    "t_scale": 1000.0,
    "axes_dims": [32, 48, 48],  # sums to the head dim, 3840 / 30 = 128
    "axes_lens": [1536, 512, 512],
}
_TRANSFORMER_TINY = {
    **_TRANSFORMER,
    "dim": 32,
    "n_layers": 3,  # three blocks: offload=stream keeps two in its window and streams the third
    "n_refiner_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "cap_feat_dim": 32,  # the tiny Qwen3's hidden size
    "axes_dims": [4, 6, 6],  # sums to 32 / 2 = 16
    "axes_lens": [1024, 64, 64],  # caption positions up to 512 + 32 padding, then the image's; 64 tokens a side
}

_QWEN3_4B = {  # Tongyi-MAI/Z-Image-Turbo text_encoder/config.json (Qwen/Qwen3-4B, 4.0 B parameters)
    "vocab_size": 151936,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
_QWEN3_TINY = {
    **_QWEN3_4B,
    "vocab_size": TINY_QWEN_VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,  # >= 2: the pipeline reads hidden_states[-2]
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 512,
    "bos_token_id": TINY_QWEN_SPECIALS["<|endoftext|>"],
    "eos_token_id": TINY_QWEN_SPECIALS["<|im_end|>"],
}

_Z_IMAGE = {  # FLUX.1's VAE, as the published vae/config.json is
    "full": {"transformer": _TRANSFORMER, "vae": _VAE_FLUX, "text_encoder": _QWEN3_4B},
    "tiny": {"transformer": _TRANSFORMER_TINY, "vae": _VAE_FLUX_TINY, "text_encoder": _QWEN3_TINY},
}
# Caption tokens (chat template included) per prompt: ZImagePipeline's default max_sequence_length, at
# both sizes (the transformer sees only a caption's own tokens, so the padding costs the tiny model nothing
# but its text encoder's pass; one length keeps a folder's and a built model's encodings alike).
Z_IMAGE_MAX_SEQUENCE_LENGTH = 512


def z_image_configs(size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the Z-Image modules (transformer, vae, text_encoder) of one size."""
    _check_size(size)
    return copy.deepcopy(_Z_IMAGE[size])
