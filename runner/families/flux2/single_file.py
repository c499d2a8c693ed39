"""FLUX.2's original single file (BFL's ``flux2-dev.safetensors`` / klein's, ComfyUI's diffusion_models):
recognised and converted with diffusers' own converter.

Why diffusers' converter here, when Flux.1's is our own (runner/families/common/single_file.py): diffusers'
``convert_flux2_transformer_checkpoint_to_diffusers`` takes every width from the tensors it splits (it chunks
each fused qkv in three, renames the rest, swaps the final adaLN's shift and scale), so it converts the tiny
and the published sizes alike; Flux.1's hard-codes 3072. Trade-off: it converts the whole state at once, so
the peak is the file's size plus the split q/k/v copies of one model (Flux.1's path converts block by block).
The tests write a Flux.2 model in BFL's names (tests/runner/families/flux2/test_flux2.py) and read it back bit for bit.
"""
from __future__ import annotations

import torch
from torch import nn

# Key roots of BFL's FLUX.2 transformer (optionally under model.diffusion_model.).
FLUX2_ROOTS = ("double_blocks.", "single_blocks.", "img_in.", "txt_in.", "time_in.", "guidance_in.", "final_layer.",
               "double_stream_modulation_img.", "double_stream_modulation_txt.", "single_stream_modulation.")


def is_flux2(keys: list[str]) -> bool:
    """FLUX.2's file: the shared modulation of the single blocks, which FLUX.1 has not (diffusers' own test,
    ``CHECKPOINT_KEY_NAMES["flux2"]``)."""
    return any(k.removeprefix("model.diffusion_model.").startswith("single_stream_modulation.") for k in keys)


def convert_flux2_transformer(state: dict, config: dict, model: nn.Module) -> dict[str, torch.Tensor]:
    """BFL's FLUX.2 names -> diffusers' ``Flux2Transformer2DModel`` names (diffusers' converter)."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    src = {k.removeprefix("model.diffusion_model."): v for k, v in state.items()}
    state.clear()
    return convert_flux2_transformer_checkpoint_to_diffusers(src)
