"""The HunyuanVideo 1.5 VAE's frame-causal attention mask, built one frame at a time.

diffusers 0.42.1's ``HunyuanVideo15AttnBlock.prepare_causal_attention_mask`` fills the mask one row per token:
``frames x height x width`` small writes per call, which on a card is that many kernel launches and in the planner's
simulated step that many simulated ops (most of a full-size plan's time). The mask here has the same values, from
one write per frame; it is set on each block of a built VAE, so the diffusers class is untouched.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def frame_causal_mask(n_frame: int, n_hw: int, dtype: torch.dtype, device: Any,
                      batch_size: int | None = None) -> torch.Tensor:
    """``-inf`` everywhere except where a token's frame is at or before the query token's frame (0)."""
    seq_len = n_frame * n_hw
    mask = torch.full((seq_len, seq_len), float("-inf"), dtype=dtype, device=device)
    for frame in range(n_frame):
        mask[frame * n_hw:(frame + 1) * n_hw, :(frame + 1) * n_hw] = 0
    return mask if batch_size is None else mask.unsqueeze(0).expand(batch_size, -1, -1)


def use_frame_causal_masks(vae: nn.Module) -> None:
    """Every attention block of ``vae`` builds its mask with :func:`frame_causal_mask` (an instance attribute
    shadows the class's static method, which the block calls through ``self``)."""
    for module in vae.modules():
        if hasattr(type(module), "prepare_causal_attention_mask"):
            module.prepare_causal_attention_mask = frame_causal_mask
