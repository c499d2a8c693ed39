"""Architecture config dicts of the Wan text-to-video family (``trainer=wan``), per variant and size.

A sibling of :mod:`runner.families.common.model_configs` (same rules: plain data, accessors return deep
copies). ``trainer.variant`` picks the published model ``model.size=full`` builds; ``tiny`` keeps
that variant's structure (its VAE's channels and compression, 3-D patching, cross-attention to
UMT5 states, fp32-kept modules) at a few dozen channels:

* ``14b``: Wan-AI/Wan2.1-T2V-14B-Diffusers (40 blocks of width 5120; 14.3 B parameters);
* ``1.3b``: Wan-AI/Wan2.1-T2V-1.3B-Diffusers (30 blocks of width 1536; 1.4 B);
* ``2.2-5b``: Wan-AI/Wan2.2-TI2V-5B-Diffusers (30 blocks of width 3072 over the 48-channel,
  16x-compressing Wan 2.2 VAE; 5.0 B), trained here in its text-to-video mode;
* ``2.2-a14b``: Wan-AI/Wan2.2-T2V-A14B-Diffusers, two experts of Wan 2.1 14B's architecture
  (``transformer/`` for the high-noise steps, ``transformer_2/`` for the low-noise ones, split at
  ``boundary_ratio`` 0.875 of the 1000 training timesteps, both ``config.json`` equal to 2.1 14B's)
  over the Wan 2.1 VAE; a run trains one expert or both (``trainer.experts``; both:
  runner/families/wan/experts.py).

Wan 2.1 variants share the 16-channel Wan 2.1 VAE (8x spatial, 4x temporal compression); every
variant uses UMT5-XXL (``google/umt5-xxl``'s encoder, 5.7 B) with 512 text tokens. Values from
the published ``config.json`` files (diffusers' ``scripts/convert_wan_to_diffusers.py`` writes
the same ones).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from runner.errors import UserError, valid_list
from runner.families.common.model_configs import _T5_XXL, TINY_T5_VOCAB, _check_size
from runner.families.qwen_image.architecture import WAN21_VAE

# Image-to-video (runner/families/wan/i2v.py, tables at the end of this file): Wan2.1-I2V-14B, Wan2.2-I2V-A14B.
I2V_VARIANTS = ("i2v-2.1-14b", "i2v-2.2-a14b")
VARIANTS = ("14b", "1.3b", "2.2-5b", "2.2-a14b", *I2V_VARIANTS)
EXPERTS = ("high", "low")  # Wan 2.2 A14B: the expert a run trains (trainer.experts)
BOTH = "both"  # trainer.experts=both: one run trains both, switching by timestep (runner/families/wan/experts.py)
# Wan2.2-T2V-A14B-Diffusers model_index.json boundary_ratio: t >= 0.875 (of 1, 1 = noise) is the
# high-noise expert's, below it the low-noise one's.
A14B_BOUNDARY = 0.875
A14B_FOLDER = {"high": "transformer", "low": "transformer_2"}  # each expert's subfolder of the diffusers folder

_WAN21_14B = {  # Wan2.1-T2V-14B transformer/config.json
    "patch_size": [1, 2, 2],
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
}
_WAN21_1_3B = {**_WAN21_14B, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}
_WAN22_5B = {**_WAN21_14B, "num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30,
             "in_channels": 48, "out_channels": 48}
_TRANSFORMER_TINY = {
    **_WAN21_14B,
    "num_attention_heads": 2,
    "attention_head_dim": 12,  # rope splits it 4 / 4 / 4 (t, h, w)
    "text_dim": 32,
    "freq_dim": 16,
    "ffn_dim": 48,
    "num_layers": 3,  # three blocks: offload=stream keeps two in its window and streams the third
}

_VAE21 = {**WAN21_VAE, "scale_factor_temporal": 4, "scale_factor_spatial": 8}  # Wan2.1 vae/config.json (AutoencoderKLWan)
_VAE22 = {  # Wan2.2-TI2V-5B vae/config.json (the residual, 48-channel Wan 2.2 VAE, 16x16 per latent)
    "base_dim": 160,
    "decoder_base_dim": 256,
    "z_dim": 48,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 16,
    "latents_mean": [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
                     0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
                     -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313,
                     -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
                     0.3573, -0.0548, -0.1681, -0.0667],
    "latents_std": [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744],
}
_VAE21_TINY = {**_VAE21, "base_dim": 8, "num_res_blocks": 1}
_VAE22_TINY = {**_VAE22, "base_dim": 8, "decoder_base_dim": 8, "num_res_blocks": 1}

_UMT5_XXL = {**_T5_XXL, "vocab_size": 256384, "decoder_start_token_id": 0}  # google/umt5-xxl encoder: T5 v1.1 XXL's shape
_UMT5_TINY = {**_UMT5_XXL, "vocab_size": TINY_T5_VOCAB, "d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4,
              "num_layers": 2}

_FULL = {
    "14b": {"transformer": _WAN21_14B, "vae": _VAE21, "text_encoder": _UMT5_XXL},
    "1.3b": {"transformer": _WAN21_1_3B, "vae": _VAE21, "text_encoder": _UMT5_XXL},
    "2.2-5b": {"transformer": _WAN22_5B, "vae": _VAE22, "text_encoder": _UMT5_XXL},
    "2.2-a14b": {"transformer": _WAN21_14B, "vae": _VAE21, "text_encoder": _UMT5_XXL},
}
_TINY = {
    "14b": {"transformer": _TRANSFORMER_TINY, "vae": _VAE21_TINY, "text_encoder": _UMT5_TINY},
    "1.3b": {"transformer": _TRANSFORMER_TINY, "vae": _VAE21_TINY, "text_encoder": _UMT5_TINY},
    "2.2-5b": {"transformer": {**_TRANSFORMER_TINY, "in_channels": 48, "out_channels": 48}, "vae": _VAE22_TINY,
               "text_encoder": _UMT5_TINY},
    "2.2-a14b": {"transformer": _TRANSFORMER_TINY, "vae": _VAE21_TINY, "text_encoder": _UMT5_TINY},
}
# UMT5 prompt length: the pipeline pads every prompt with zeros to 512 tokens and the model was
# trained that way; the tiny byte-level tokenizer keeps short captions whole in 64.
WAN_MAX_SEQUENCE_LENGTH = {"full": 512, "tiny": 64}
# The published pipelines' sampling settings per variant: the scheduler's flow shift (3.0 is the
# 480p value of Wan 2.1; 2.2-5B ships 5.0; Wan 2.2's t2v-A14B config samples with shift 12.0), the
# frame rate of the training clips, and whether the pipeline passes one timestep per latent token
# (Wan 2.2 TI2V's expand_timesteps).
WAN_PIPELINE = {
    "14b": {"flow_shift": 3.0, "fps": 16, "expand_timesteps": False},
    "1.3b": {"flow_shift": 3.0, "fps": 16, "expand_timesteps": False},
    "2.2-5b": {"flow_shift": 5.0, "fps": 24, "expand_timesteps": True},
    "2.2-a14b": {"flow_shift": 12.0, "fps": 16, "expand_timesteps": False},
    # Image-to-video: Wan 2.1 I2V 480P samples with shift 3.0 (diffusers' converter writes it), Wan 2.2
    # I2V A14B with 5.0 (its original config's sample_shift); both 16 fps, one timestep per sample.
    "i2v-2.1-14b": {"flow_shift": 3.0, "fps": 16, "expand_timesteps": False},
    "i2v-2.2-a14b": {"flow_shift": 5.0, "fps": 16, "expand_timesteps": False},
}


def check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise UserError(f"Unknown trainer.variant '{variant}' for trainer=wan. Valid variants: "
                        f"{valid_list(variant, VARIANTS)}.")
    return variant


def a14b_boundary(source: tuple[str, str] | None, default: float = A14B_BOUNDARY) -> float:
    """The expert boundary: ``boundary_ratio`` of a diffusers folder's model_index.json, else ``default``
    (:data:`A14B_BOUNDARY`, the T2V model's; the I2V model's is 0.9)."""
    if source is not None and source[0] == "folder":
        index = Path(source[1]) / "model_index.json"
        if index.is_file():
            ratio = json.loads(index.read_text()).get("boundary_ratio")
            if isinstance(ratio, (int, float)) and 0 < ratio < 1:
                return float(ratio)
    return default


def check_expert(variant: str, expert: Any) -> str | None:
    """``trainer.experts``: required with ``2.2-a14b`` (``both``, ``high`` or ``low``), refused with the others."""
    if variant != "2.2-a14b":
        if expert is not None:
            raise UserError(f"trainer.experts={expert} applies to trainer.variant=2.2-a14b only (Wan 2.2's two 14 B "
                            f"experts); trainer.variant={variant} has one transformer. Unset trainer.experts.")
        return None
    if expert not in (*EXPERTS, BOTH):
        raise UserError(
            f"trainer.variant=2.2-a14b needs trainer.experts=both, high or low"
            f"{'' if expert is None else f' (not {expert!r})'}: Wan 2.2 A14B is two 14 B transformers, one for the "
            f"high-noise steps (t >= {A14B_BOUNDARY}: layout and motion, its transformer/ folder) and one for the rest "
            "(detail, transformer_2/). both trains the two in one run (each step's timestep picks its expert, the other "
            "waits on the host); high or low trains one of them.")
    return str(expert)


def wan_configs(size: str, variant: str = "14b") -> dict[str, dict[str, Any]]:
    """Config dicts of the Wan modules (transformer, vae, text_encoder) of one size and variant."""
    _check_size(size)
    check_variant(variant)
    if variant in I2V_VARIANTS:  # with the image encoder of Wan 2.1 I2V
        return i2v_configs(size, variant)
    return copy.deepcopy((_FULL if size == "full" else _TINY)[variant])


# ---- image-to-video -------------------------------------------------------------------------
# Architecture config dicts of Wan image-to-video (``trainer=wan trainer.variant=i2v-*``), per variant and size.
#
# * ``i2v-2.1-14b``: Wan-AI/Wan2.1-I2V-14B-480P-Diffusers (and -720P, the same architecture): Wan 2.1
#   14B's transformer with 36 input channels (16 noisy latent + 4 first-frame mask + 16 condition
#   latent channels) and an image cross-attention (``image_dim`` 1280, ``added_kv_proj_dim`` 5120),
#   fed the penultimate hidden state of a CLIP ViT-H/14 vision tower (``image_encoder/``,
#   laion/CLIP-ViT-H-14-laion2B-s32B-b79K's vision config, 257 tokens of width 1280);
# * ``i2v-2.2-a14b``: Wan-AI/Wan2.2-I2V-A14B-Diffusers: two such 36-channel 14 B experts without the
#   image cross-attention and without an image encoder (``image_dim`` None), split at
#   ``boundary_ratio`` 0.9 (its model_index.json; the T2V A14B's is 0.875); one run trains one
#   expert (``trainer.experts=high|low``), as for the text-to-video A14B.
#
# Sources: the transformer dicts are diffusers' ``scripts/convert_wan_to_diffusers.py``
# (``get_transformer_config``: "Wan-I2V-14B-480p"/"-720p" and "Wan2.2-I2V-14B-720p"), which writes
# the published folders' ``transformer/config.json``; the same script builds the pipeline with
# ``boundary_ratio=0.9`` for Wan 2.2 I2V and loads the image encoder and processor from
# laion/CLIP-ViT-H-14-laion2B-s32B-b79K (its ``vision_config``: 32 layers of width 1280, 16 heads,
# MLP 5120, 14 px patches at 224 px; its preprocessor: shortest edge 224, centre crop 224, bicubic,
# OpenAI CLIP mean/std). Every variant keeps the Wan 2.1 VAE and UMT5-XXL of the text-to-video tables.
I2V_A14B_BOUNDARY = 0.9  # Wan2.2-I2V-A14B-Diffusers model_index.json boundary_ratio
MASK_CHANNELS = 4  # the first-frame mask: one channel per pixel frame of a latent frame (VAE temporal factor 4)

_I2V21_14B = {**_WAN21_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
_I2V22_A14B = {**_WAN21_14B, "in_channels": 36}  # image_dim/added_kv_proj_dim None: no image cross-attention
_CLIP_VIT_H14 = {  # laion/CLIP-ViT-H-14-laion2B-s32B-b79K vision_config (CLIPVisionModel)
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "projection_dim": 1024,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 14,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
}
_CLIP_PROCESSOR = {  # laion/CLIP-ViT-H-14-laion2B-s32B-b79K preprocessor_config.json (CLIPImageProcessor)
    "size": {"shortest_edge": 224},
    "crop_size": {"height": 224, "width": 224},
    "do_center_crop": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "do_convert_rgb": True,
    "resample": 3,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
# Tiny: the image tower keeps two layers (the pipeline reads the penultimate hidden state) at the tiny
# transformer's image width; 8 px patches at 32 px give 17 tokens (16 patches + the class token).
_CLIP_TINY = {**_CLIP_VIT_H14, "hidden_size": 32, "intermediate_size": 64, "projection_dim": 32,
              "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 32, "patch_size": 8}
_TINY_INNER = _TRANSFORMER_TINY["num_attention_heads"] * _TRANSFORMER_TINY["attention_head_dim"]

_I2V_FULL = {
    "i2v-2.1-14b": {"transformer": _I2V21_14B, "vae": _VAE21, "text_encoder": _UMT5_XXL, "image_encoder": _CLIP_VIT_H14},
    "i2v-2.2-a14b": {"transformer": _I2V22_A14B, "vae": _VAE21, "text_encoder": _UMT5_XXL},
}
_I2V_TINY = {
    "i2v-2.1-14b": {"transformer": {**_TRANSFORMER_TINY, "in_channels": 36, "image_dim": _CLIP_TINY["hidden_size"],
                                    "added_kv_proj_dim": _TINY_INNER},
                    "vae": _VAE21_TINY, "text_encoder": _UMT5_TINY, "image_encoder": _CLIP_TINY},
    "i2v-2.2-a14b": {"transformer": {**_TRANSFORMER_TINY, "in_channels": 36}, "vae": _VAE21_TINY,
                     "text_encoder": _UMT5_TINY},
}
I2V_PIPELINE = "WanImageToVideoPipeline"


def has_image_encoder(variant: str) -> bool:
    """Wan 2.1 I2V feeds CLIP image embeddings; Wan 2.2 I2V A14B has no image encoder."""
    return "image_encoder" in _I2V_FULL[variant]


def i2v_configs(size: str, variant: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the I2V modules (transformer, vae, text_encoder[, image_encoder]) of one size."""
    _check_size(size)
    return copy.deepcopy((_I2V_FULL if size == "full" else _I2V_TINY)[variant])


def image_processor_config(side: int) -> dict[str, Any]:
    """The CLIP image processor's published settings for an image tower of ``side`` px inputs (224 at
    full size; the tiny tower's 32): shortest side resized to it, then the centre crop."""
    return {**copy.deepcopy(_CLIP_PROCESSOR), "size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}


def check_i2v_expert(variant: str, expert: Any) -> str | None:
    """``trainer.experts``: required with ``i2v-2.2-a14b`` (``high`` or ``low``), refused with ``i2v-2.1-14b``."""
    if variant != "i2v-2.2-a14b":
        if expert is not None:
            raise UserError(f"trainer.experts={expert} applies to trainer.variant=i2v-2.2-a14b (and 2.2-a14b) only: "
                            f"trainer.variant={variant} has one transformer. Unset trainer.experts.")
        return None
    if expert not in EXPERTS:
        raise UserError(
            f"trainer.variant=i2v-2.2-a14b needs trainer.experts=high or low{'' if expert is None else f' (not {expert!r})'}"
            f": Wan 2.2 I2V A14B is two 14 B transformers, one for the high-noise steps (t >= {I2V_A14B_BOUNDARY}, its "
            f"{A14B_FOLDER['high']}/ folder) and one for the rest ({A14B_FOLDER['low']}/). A run trains one of them; "
            "train the other in a second run with the same data.")
    return str(expert)


def i2v_boundary(source: tuple[str, str] | None) -> float:
    """The expert boundary: ``boundary_ratio`` of a diffusers folder's model_index.json, else 0.9."""
    return a14b_boundary(source, I2V_A14B_BOUNDARY)
