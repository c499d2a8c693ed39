"""Architecture config dicts of Wan image-to-video (``trainer=wan trainer.variant=i2v-*``), per variant and size.

A sibling of :mod:`runner.trainers.wan_configs` (same rules: plain data, accessors return deep copies):

* ``i2v-2.1-14b``: Wan-AI/Wan2.1-I2V-14B-480P-Diffusers (and -720P, the same architecture): Wan 2.1
  14B's transformer with 36 input channels (16 noisy latent + 4 first-frame mask + 16 condition
  latent channels) and an image cross-attention (``image_dim`` 1280, ``added_kv_proj_dim`` 5120),
  fed the penultimate hidden state of a CLIP ViT-H/14 vision tower (``image_encoder/``,
  laion/CLIP-ViT-H-14-laion2B-s32B-b79K's vision config, 257 tokens of width 1280);
* ``i2v-2.2-a14b``: Wan-AI/Wan2.2-I2V-A14B-Diffusers: two such 36-channel 14 B experts without the
  image cross-attention and without an image encoder (``image_dim`` None), split at
  ``boundary_ratio`` 0.9 (its model_index.json; the T2V A14B's is 0.875); one run trains one
  expert (``trainer.experts=high|low``), as for the text-to-video A14B.

Sources: the transformer dicts are diffusers' ``scripts/convert_wan_to_diffusers.py``
(``get_transformer_config``: "Wan-I2V-14B-480p"/"-720p" and "Wan2.2-I2V-14B-720p"), which writes
the published folders' ``transformer/config.json``; the same script builds the pipeline with
``boundary_ratio=0.9`` for Wan 2.2 I2V and loads the image encoder and processor from
laion/CLIP-ViT-H-14-laion2B-s32B-b79K (its ``vision_config``: 32 layers of width 1280, 16 heads,
MLP 5120, 14 px patches at 224 px; its preprocessor: shortest edge 224, centre crop 224, bicubic,
OpenAI CLIP mean/std). Every variant keeps the Wan 2.1 VAE and UMT5-XXL of ``wan_configs``.

Torch-free: the trainer config checks import it.
"""
from __future__ import annotations

import copy
from typing import Any

from runner.errors import UserError
from runner.trainers.model_configs import _check_size
from runner.trainers.wan_configs import (
    _TRANSFORMER_TINY,
    _UMT5_TINY,
    _UMT5_XXL,
    _VAE21,
    _VAE21_TINY,
    _WAN21_14B,
    A14B_FOLDER,
    EXPERTS,
    a14b_boundary,
)

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

_FULL = {
    "i2v-2.1-14b": {"transformer": _I2V21_14B, "vae": _VAE21, "text_encoder": _UMT5_XXL, "image_encoder": _CLIP_VIT_H14},
    "i2v-2.2-a14b": {"transformer": _I2V22_A14B, "vae": _VAE21, "text_encoder": _UMT5_XXL},
}
_TINY = {
    "i2v-2.1-14b": {"transformer": {**_TRANSFORMER_TINY, "in_channels": 36, "image_dim": _CLIP_TINY["hidden_size"],
                                    "added_kv_proj_dim": _TINY_INNER},
                    "vae": _VAE21_TINY, "text_encoder": _UMT5_TINY, "image_encoder": _CLIP_TINY},
    "i2v-2.2-a14b": {"transformer": {**_TRANSFORMER_TINY, "in_channels": 36}, "vae": _VAE21_TINY,
                     "text_encoder": _UMT5_TINY},
}
PIPELINE = "WanImageToVideoPipeline"


def has_image_encoder(variant: str) -> bool:
    """Wan 2.1 I2V feeds CLIP image embeddings; Wan 2.2 I2V A14B has no image encoder."""
    return "image_encoder" in _FULL[variant]


def i2v_configs(size: str, variant: str) -> dict[str, dict[str, Any]]:
    """Config dicts of the I2V modules (transformer, vae, text_encoder[, image_encoder]) of one size."""
    _check_size(size)
    return copy.deepcopy((_FULL if size == "full" else _TINY)[variant])


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

