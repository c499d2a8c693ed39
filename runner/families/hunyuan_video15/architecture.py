"""Architecture config dicts of HunyuanVideo 1.5 (``trainer=hunyuan_video15``), per size.

A sibling of :mod:`runner.families.common.model_configs` (plain data, accessors return deep copies).
``full`` is hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v (the diffusers folder of tencent/HunyuanVideo-1.5):

* transformer: 54 dual-stream blocks of width 2048 (16 heads of 128), 8.3 B parameters, 1x1 patches over
  65 input channels (32 noisy latent + 32 condition latent + 1 mask channel; text-to-video passes zeros),
  a token refiner over Qwen2.5-VL's states, a projection of ByT5's glyph states and of SigLIP image
  embeddings (729 tokens of width 1152; text-to-video passes zeros, which the model masks out);
  ``HunyuanVideo15Transformer3DModel``'s defaults are this model's, ``task_type`` t2v;
* vae: ``AutoencoderKLHunyuanVideo15``, 32 latent channels, 16x spatial and 4x temporal compression,
  ``scaling_factor`` 1.03682 (its defaults);
* text_encoder: Qwen2.5-VL-7B-Instruct's language model (``Qwen2_5_VLTextModel``, 7.6 B), the pipeline reads
  the third-last hidden state;
* text_encoder_2: the glyph ByT5 of Glyph-SDXL-v2 (google/byt5-small's encoder shape: 12 layers of width 1472).
  Its published vocabulary adds color and font tokens to ByT5's 384 bytes; a model folder's config.json has
  the exact count (a few rows of a 1472-wide embedding: no figure here moves with it).

``tiny`` keeps each module's structure (the 65-channel input, the refiner, both text paths, the 16x/4x VAE)
at a few dozen channels.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.families.common.model_configs import TINY_T5_VOCAB, _check_size
from runner.families.qwen_image.architecture import _QWEN25_VL_TINY, _QWEN25_VL_7B

_TRANSFORMER = {  # HunyuanVideo-1.5-480p_t2v transformer/config.json
    "in_channels": 65,
    "out_channels": 32,
    "num_attention_heads": 16,
    "attention_head_dim": 128,
    "num_layers": 54,
    "num_refiner_layers": 2,
    "mlp_ratio": 4.0,
    "patch_size": 1,
    "patch_size_t": 1,
    "qk_norm": "rms_norm",
    "text_embed_dim": 3584,
    "text_embed_2_dim": 1472,
    "image_embed_dim": 1152,
    "rope_theta": 256.0,
    "rope_axes_dim": [16, 56, 56],
    "target_size": 640,
    "task_type": "t2v",
    "use_meanflow": False,
}
_TRANSFORMER_TINY = {
    **_TRANSFORMER,
    "in_channels": 4 * 2 + 1,
    "out_channels": 4,
    "num_attention_heads": 2,
    "attention_head_dim": 16,  # rope splits it 4 / 6 / 6 (t, h, w)
    "num_layers": 3,  # three blocks: offload=stream keeps two in its window and streams the third
    "num_refiner_layers": 1,
    "text_embed_dim": 32,
    "text_embed_2_dim": 32,
    "image_embed_dim": 8,
    "rope_axes_dim": [4, 6, 6],
    "target_size": 64,
}
_VAE = {  # HunyuanVideo-1.5 vae/config.json (AutoencoderKLHunyuanVideo15)
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 32,
    "block_out_channels": [128, 256, 512, 1024, 1024],
    "layers_per_block": 2,
    "spatial_compression_ratio": 16,
    "temporal_compression_ratio": 4,
    "downsample_match_channel": True,
    "upsample_match_channel": True,
    "scaling_factor": 1.03682,
}
_VAE_TINY = {**_VAE, "latent_channels": 4, "block_out_channels": [8, 8, 16, 16, 16], "layers_per_block": 1}

_BYT5 = {  # the glyph ByT5 encoder (T5EncoderModel; google/byt5-small's shape)
    "vocab_size": 384,
    "d_model": 1472,
    "d_ff": 3584,
    "d_kv": 64,
    "num_heads": 6,
    "num_layers": 12,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6,
    "dropout_rate": 0.1,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "eos_token_id": 1,
}
_BYT5_TINY = {**_BYT5, "vocab_size": TINY_T5_VOCAB, "d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4,
              "num_layers": 2}

_CONFIGS = {
    "full": {"transformer": _TRANSFORMER, "vae": _VAE, "text_encoder": _QWEN25_VL_7B["text_config"],
             "text_encoder_2": _BYT5},
    "tiny": {"transformer": _TRANSFORMER_TINY, "vae": _VAE_TINY, "text_encoder": _QWEN25_VL_TINY["text_config"],
             "text_encoder_2": _BYT5_TINY},
}
# Qwen2.5-VL tokens after the template (trainer.max_sequence_length's default): the pipeline's
# tokenizer_max_length; the tiny byte-level tokenizer keeps short captions whole in 96.
MAX_SEQUENCE_LENGTH = {"full": 1000, "tiny": 96}
BYT5_MAX_LENGTH = 256  # the pipeline's tokenizer_2_max_length (glyph text in quotes)
IMAGE_TOKENS = 729  # the pipeline's vision_num_semantic_tokens: SigLIP's 27x27 (zeros for text-to-video)
CROP_START = 108  # the pipeline's prompt_template_encode_start_idx: the real tokenizer's system-template tokens
# The published 480p pipeline's sampling: FlowMatchEulerDiscreteScheduler with shift 5.0, classifier-free
# guidance 6.0, 121 frames at 24 fps.
FLOW_SHIFT = 5.0
GUIDANCE = 6.0
FPS = 24.0


def hunyuan_video15_configs(size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the HunyuanVideo 1.5 modules (transformer, vae, text_encoder, text_encoder_2) of one size."""
    _check_size(size)
    return copy.deepcopy(_CONFIGS[size])
