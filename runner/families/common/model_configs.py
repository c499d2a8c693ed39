"""Architecture config dicts of the built-in model families, in two sizes.

No model hub can be reached, so every model is built from one of these dicts (random init) unless
``model.path`` points at local weights. ``"full"`` reproduces the published architectures (the
values of the ``config.json`` files of stabilityai/stable-diffusion-xl-base-1.0,
black-forest-labs/FLUX.1-dev, stable-diffusion-v1-5/stable-diffusion-v1-5,
stabilityai/stable-diffusion-2-1, stabilityai/stable-diffusion-3.5-{medium,large} and
lodestones/Chroma1-HD), so that
the planner sees real parameter counts and activation shapes when it builds them on ``meta``.
``"tiny"`` keeps each architecture family and every structural feature the trainers depend on
(SDXL's ``text_time`` added conditioning fed by two text encoders, an 8x VAE, Flux's guidance
embedding, 2x2 packing and gated-GELU T5, SD2.1's linear projections and upcast attention, SD3.5
Medium's dual-attention blocks and the CLIP embeddings padded to T5's width) but with widths of a
few dozen channels, so tests and the demo run on a CPU in seconds.

The dicts are plain data: diffusers models take them through ``Model.from_config(d)``,
transformers models through ``ConfigClass(**d)`` (see :func:`runner.families.common.loading.build_module`).
Use the accessor functions, which return deep copies, so a caller cannot change the tables.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.errors import UserError, valid_list

SIZES = ("tiny", "full")

# ---- tokenizer geometry ---------------------------------------------------------------------
# The tiny CLIP tokenizer (see common.clip_tokenizer) has 256 byte symbols, their "</w>" forms and
# the two specials: ids 0..511, <|startoftext|> = 512, <|endoftext|> = 513.
TINY_CLIP_VOCAB = 514
TINY_CLIP_BOS = 512
TINY_CLIP_EOS = 513
# transformers.ByT5Tokenizer: 3 specials + 256 bytes + 125 extra ids.
TINY_T5_VOCAB = 384
CLIP_MAX_LENGTH = 77

# ---- CLIP text encoders -----------------------------------------------------------------------
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

# ---- VAEs ------------------------------------------------------------------------------------
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

_VAE_SD15 = {**_VAE_SDXL, "scaling_factor": 0.18215, "sample_size": 512}  # SD1.5; SD2.1's is the same at 768
_VAE_SD15_TINY = {**_VAE_TINY, "scaling_factor": 0.18215}
_VAE_SD3 = {**_VAE_FLUX, "scaling_factor": 1.5305, "shift_factor": 0.0609}  # 16 channels, like Flux's
_VAE_SD3_TINY = {**_VAE_FLUX_TINY, "scaling_factor": 1.5305, "shift_factor": 0.0609}

# ---- denoisers ------------------------------------------------------------------------------
_UNET_SDXL = {
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "block_out_channels": [320, 640, 1280],
    "layers_per_block": 2,
    "transformer_layers_per_block": [1, 2, 10],
    "attention_head_dim": [5, 10, 20],
    "cross_attention_dim": 2048,  # 768 (CLIP-L) + 1280 (bigG)
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,  # 6 time ids * 256 + 1280 pooled
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "act_fn": "silu",
}
_UNET_SDXL_TINY = {
    **_UNET_SDXL,
    "sample_size": 8,
    "block_out_channels": [32, 64],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
    "layers_per_block": 2,
    "transformer_layers_per_block": [1, 2],
    "attention_head_dim": [2, 4],
    "cross_attention_dim": 64,  # 32 + 32: the two tiny text encoders
    "addition_time_embed_dim": 8,
    "projection_class_embeddings_input_dim": 6 * 8 + 32,  # time ids + pooled (projection_dim)
    "norm_num_groups": 32,
}
_FLUX_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 64,  # 16 latent channels * 2x2 packing
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,  # T5-XXL d_model
    "pooled_projection_dim": 768,  # CLIP-L hidden size (pooler output)
    "guidance_embeds": True,  # FLUX.1-dev is guidance-distilled
    "axes_dims_rope": [16, 56, 56],  # sums to attention_head_dim
}
_FLUX_TRANSFORMER_TINY = {
    **_FLUX_TRANSFORMER,
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "axes_dims_rope": [4, 6, 6],
}
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

_SD15_UNET = {  # stable-diffusion-v1-5 unet/config.json (~860 M params)
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "block_out_channels": [320, 640, 1280, 1280],
    "layers_per_block": 2,
    "attention_head_dim": 8,
    "cross_attention_dim": 768,
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "act_fn": "silu",
}
_UNET_SD15_TINY = {
    **_SD15_UNET,
    "sample_size": 8,
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "block_out_channels": [32, 64],
    "attention_head_dim": 4,
    "cross_attention_dim": 32,  # the tiny CLIP's hidden size
}
_SD21_UNET = {  # stabilityai/stable-diffusion-2-1 unet/config.json (768 px, v-prediction; ~866 M params)
    **_SD15_UNET,
    "sample_size": 96,
    "attention_head_dim": [5, 10, 20, 20],
    "cross_attention_dim": 1024,  # OpenCLIP ViT-H
    "use_linear_projection": True,
    "upcast_attention": True,
}
_UNET_SD21_TINY = {**_UNET_SD15_TINY, "attention_head_dim": [2, 4], "use_linear_projection": True,
                   "upcast_attention": True}
_SD3_MEDIUM = {  # stable-diffusion-3-medium transformer/config.json (~2.0 B params)
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 192,
}
_SD35_LARGE = {  # stable-diffusion-3.5-large transformer/config.json (~8.1 B params)
    **_SD3_MEDIUM,
    "num_layers": 38,
    "num_attention_heads": 38,
    "caption_projection_dim": 2432,
    "qk_norm": "rms_norm",
}
_SD35_MEDIUM = {  # stable-diffusion-3.5-medium transformer/config.json (MMDiT-X, ~2.2 B params)
    **_SD3_MEDIUM,
    "pos_embed_max_size": 384,
    "dual_attention_layers": list(range(13)),  # blocks 0-12 add a second, image-only attention
    "qk_norm": "rms_norm",
}
_SD35_LARGE_TINY = {
    **_SD35_LARGE,
    "sample_size": 8,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 4,
    "caption_projection_dim": 32,  # = heads * head dim, as in the real models
    "joint_attention_dim": 96,  # the tiny T5's width; the two tiny CLIPs (32 + 32) are zero-padded to it
    "pooled_projection_dim": 64,  # the two tiny CLIPs' projections, concatenated
    "pos_embed_max_size": 16,
}
_SD35_MEDIUM_TINY = {**_SD35_LARGE_TINY, "dual_attention_layers": [0]}
_T5_SD3_TINY = {**_T5_TINY, "d_model": 96}

_SDXL = {
    "full": {"unet": _UNET_SDXL, "vae": _VAE_SDXL, "text_encoder": _CLIP_L, "text_encoder_2": _CLIP_BIGG},
    "tiny": {"unet": _UNET_SDXL_TINY, "vae": _VAE_TINY, "text_encoder": _CLIP_TINY, "text_encoder_2": _CLIP_TINY_2},
}
_FLUX = {
    "full": {"transformer": _FLUX_TRANSFORMER, "vae": _VAE_FLUX, "text_encoder": _CLIP_L, "text_encoder_2": _T5_XXL},
    "tiny": {
        "transformer": _FLUX_TRANSFORMER_TINY,
        "vae": _VAE_FLUX_TINY,
        "text_encoder": _CLIP_TINY,
        "text_encoder_2": _T5_TINY,
    },
}
_CHROMA = {  # Flux's VAE and T5-XXL; no CLIP
    "full": {"transformer": _CHROMA_TRANSFORMER, "vae": _VAE_FLUX, "text_encoder": _T5_XXL},
    "tiny": {"transformer": _CHROMA_TRANSFORMER_TINY, "vae": _VAE_FLUX_TINY, "text_encoder": _T5_TINY},
}
# T5 prompt length: FLUX.1-dev's pipeline default is 512; the tiny byte-level tokenizer needs
# one token per byte, 64 keeps short captions whole.
FLUX_T5_MAX_LENGTH = {"full": 512, "tiny": 64}
_SD15 = {
    "sd15": {
        "full": {"unet": _SD15_UNET, "vae": _VAE_SD15, "text_encoder": _CLIP_L},
        "tiny": {"unet": _UNET_SD15_TINY, "vae": _VAE_SD15_TINY, "text_encoder": _CLIP_TINY},
    },
    "sd21": {
        "full": {"unet": _SD21_UNET, "vae": {**_VAE_SD15, "sample_size": 768}, "text_encoder": _CLIP_H},
        "tiny": {"unet": _UNET_SD21_TINY, "vae": _VAE_SD15_TINY, "text_encoder": _CLIP_H_TINY},
    },
}
_SD35_ENCODERS = {
    "full": {"vae": _VAE_SD3, "text_encoder": _CLIP_L, "text_encoder_2": _CLIP_BIGG, "text_encoder_3": _T5_XXL},
    "tiny": {"vae": _VAE_SD3_TINY, "text_encoder": _CLIP_TINY, "text_encoder_2": _CLIP_TINY_2,
             "text_encoder_3": _T5_SD3_TINY},
}
_SD35_TRANSFORMER = {
    "medium": {"full": _SD35_MEDIUM, "tiny": _SD35_MEDIUM_TINY},
    "large": {"full": _SD35_LARGE, "tiny": _SD35_LARGE_TINY},
}
# T5 prompt length: the SD3 pipelines' default max_sequence_length is 256.
SD3_T5_MAX_LENGTH = {"full": 256, "tiny": 64}

# Denoiser-only tables for the planner: name -> (diffusers class name, config).
DENOISERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sd15": ("UNet2DConditionModel", _SD15_UNET),
    "sdxl": ("UNet2DConditionModel", _UNET_SDXL),
    "sd21": ("UNet2DConditionModel", _SD21_UNET),
    "sd3": ("SD3Transformer2DModel", _SD3_MEDIUM),
    "sd35_medium": ("SD3Transformer2DModel", _SD35_MEDIUM),
    "sd35_large": ("SD3Transformer2DModel", _SD35_LARGE),
    "flux": ("FluxTransformer2DModel", _FLUX_TRANSFORMER),
    "chroma": ("ChromaTransformer2DModel", _CHROMA_TRANSFORMER),
}


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise UserError(f"Unknown model.size '{size}'. Valid sizes: {valid_list(size, SIZES)}.")


def sdxl_configs(size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the SDXL modules (unet, vae, text_encoder, text_encoder_2) of one size."""
    _check_size(size)
    return copy.deepcopy(_SDXL[size])


def flux_configs(size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the Flux modules (transformer, vae, text_encoder, text_encoder_2) of one size."""
    _check_size(size)
    return copy.deepcopy(_FLUX[size])


def chroma_configs(size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the Chroma modules (transformer, vae, text_encoder: T5-XXL) of one size."""
    _check_size(size)
    return copy.deepcopy(_CHROMA[size])


def sd15_configs(variant: str, size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the SD1.5 or SD2.1 modules (unet, vae, text_encoder); ``variant``: sd15 | sd21."""
    _check_size(size)
    return copy.deepcopy(_SD15[variant][size])


def sd35_configs(variant: str, size: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the SD3.5 modules (transformer, vae, three text encoders); ``variant``: medium | large."""
    _check_size(size)
    return copy.deepcopy({"transformer": _SD35_TRANSFORMER[variant][size], **_SD35_ENCODERS[size]})


def denoiser_config(name: str) -> tuple[str, dict[str, Any]]:
    """(diffusers class name, config dict) of a full-size denoiser: sd15, sd21, sdxl, sd3, sd35_medium, sd35_large, flux, chroma."""
    if name not in DENOISERS:
        raise UserError(f"Unknown denoiser '{name}'. Valid names: {valid_list(name, DENOISERS)}.")
    cls_name, cfg = DENOISERS[name]
    return cls_name, copy.deepcopy(cfg)
