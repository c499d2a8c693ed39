"""The full-size denoisers of the families whose tables are split between a family folder and
runner/families/common/model_configs.py, by name, for the planner and the benchmarks:
name -> (diffusers class name, config dict)."""
from __future__ import annotations

import copy
from typing import Any

from runner.errors import UserError, valid_list
from runner.families.chroma.architecture import _CHROMA_TRANSFORMER
from runner.families.flux.architecture import _FLUX_TRANSFORMER
from runner.families.sd15.architecture import _SD15_UNET, _SD21_UNET
from runner.families.sd35.architecture import _SD3_MEDIUM, _SD35_LARGE, _SD35_MEDIUM
from runner.families.sdxl.architecture import _UNET_SDXL

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


def denoiser_config(name: str) -> tuple[str, dict[str, Any]]:
    """(diffusers class name, config dict) of a full-size denoiser: sd15, sd21, sdxl, sd3, sd35_medium, sd35_large, flux, chroma."""
    if name not in DENOISERS:
        raise UserError(f"Unknown denoiser '{name}'. Valid names: {valid_list(name, DENOISERS)}.")
    cls_name, cfg = DENOISERS[name]
    return cls_name, copy.deepcopy(cfg)
