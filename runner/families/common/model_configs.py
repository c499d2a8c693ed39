"""Architecture config dicts the built-in families share, in two sizes: the CLIP and T5 text encoders and
the VAEs of SDXL, FLUX.1, Chroma, SD1.5/SD2.1 and SD3.5 (each family's denoiser is in its folder's
``architecture.py``; Wan, Lumina 2 and Z-Image read T5 or FLUX.1's VAE from here too), the tokenizer
geometry of the tiny tokenizers, and :data:`SIZES`.

No model hub can be reached, so every model is built from these dicts (random init) unless
``model.path`` points at local weights. ``"full"`` reproduces the published architectures (the
values of the published ``config.json`` files), so that the planner sees real parameter counts and
activation shapes when it builds them on ``meta``. ``"tiny"`` keeps each architecture and every
structural feature the trainers depend on (an 8x VAE, gated-GELU T5, SD2.1's OpenCLIP tower) but with
widths of a few dozen channels, so tests and the demo run on a CPU in seconds.

The dicts are plain data: diffusers models take them through ``Model.from_config(d)``,
transformers models through ``ConfigClass(**d)`` (see :func:`runner.families.common.loading.build_module`).
A family's accessor returns deep copies, so a caller cannot change the tables.
"""
from __future__ import annotations

from runner.errors import UserError, valid_list

SIZES = ("tiny", "full")
# The tiny CLIP tokenizer (see common.clip_tokenizer) has 256 byte symbols, their "</w>" forms and
# the two specials: ids 0..511, <|startoftext|> = 512, <|endoftext|> = 513.
TINY_CLIP_VOCAB = 514
TINY_CLIP_BOS = 512
TINY_CLIP_EOS = 513
# transformers.ByT5Tokenizer: 3 specials + 256 bytes + 125 extra ids.
TINY_T5_VOCAB = 384
CLIP_MAX_LENGTH = 77
_CLIP_L = {  # openai/clip-vit-large-patch14 text tower (SDXL text_encoder, Flux text_encoder)
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "projection_dim": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": CLIP_MAX_LENGTH,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "bos_token_id": 0,
    "eos_token_id": 2,  # 2 selects transformers' legacy "argmax id" pooling, as in the real config
    "pad_token_id": 1,
}
_CLIP_BIGG = {  # laion/CLIP-ViT-bigG-14 text tower (SDXL text_encoder_2, with projection)
    **_CLIP_L,
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "projection_dim": 1280,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "hidden_act": "gelu",
}
_CLIP_TINY = {
    "vocab_size": TINY_CLIP_VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "projection_dim": 32,
    "num_hidden_layers": 2,  # >= 2: SDXL reads the penultimate hidden state
    "num_attention_heads": 4,
    "max_position_embeddings": CLIP_MAX_LENGTH,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "bos_token_id": TINY_CLIP_BOS,
    "eos_token_id": TINY_CLIP_EOS,
    "pad_token_id": TINY_CLIP_EOS,
}
_CLIP_TINY_2 = {**_CLIP_TINY, "hidden_act": "gelu", "projection_dim": 32}
_CLIP_H = {  # laion/CLIP-ViT-H-14 text tower as stabilityai/stable-diffusion-2-1 ships it (last layer dropped)
    **_CLIP_L,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "projection_dim": 512,
    "num_hidden_layers": 23,
    "num_attention_heads": 16,
    "hidden_act": "gelu",
}
_CLIP_H_TINY = {**_CLIP_TINY, "hidden_act": "gelu", "num_hidden_layers": 3}
_VAE_SDXL = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "act_fn": "silu",
    "sample_size": 1024,
    "scaling_factor": 0.13025,
    "force_upcast": True,
}
_VAE_FLUX = {
    **_VAE_SDXL,
    "latent_channels": 16,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
_VAE_TINY = {
    **_VAE_SDXL,
    # Four blocks, as in the real VAE: three downsamplers, i.e. the same factor 8.
    "block_out_channels": [8, 16, 16, 16],
    "layers_per_block": 1,
    "norm_num_groups": 8,
    "sample_size": 64,
    "force_upcast": False,
}
_VAE_FLUX_TINY = {
    **_VAE_TINY,
    "latent_channels": 16,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
_T5_XXL = {  # google/t5-v1_1-xxl encoder (Flux text_encoder_2)
    "vocab_size": 32128,
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_heads": 64,
    "num_layers": 24,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6,
    "dropout_rate": 0.1,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "eos_token_id": 1,
}
_T5_TINY = {
    **_T5_XXL,
    "vocab_size": TINY_T5_VOCAB,
    "d_model": 32,
    "d_ff": 64,
    "d_kv": 8,
    "num_heads": 4,
    "num_layers": 2,
}


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise UserError(f"Unknown model.size '{size}'. Valid sizes: {valid_list(size, SIZES)}.")
