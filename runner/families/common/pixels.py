"""Pixels back to an image: what the edit and image-to-video families hand their pipelines and VL encoders."""
from __future__ import annotations

import torch
from PIL import Image


def to_pil(pixels: torch.Tensor) -> Image.Image:
    """``[3, H, W]`` pixels in [-1, 1] (the data set's) -> the RGB image they were read from (exact for 8 bit)."""
    arr = ((pixels.detach().float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(arr.permute(1, 2, 0).numpy())
