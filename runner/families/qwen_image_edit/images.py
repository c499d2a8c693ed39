"""The reference's size for Qwen2.5-VL, shared by the Qwen-Image-Edit trainer and its sampler."""
from __future__ import annotations

import math

CONDITION_IMAGE_AREA = 384 * 384  # QwenImageEditPlusPipeline.CONDITION_IMAGE_SIZE: what the VL encoder sees


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """``(width, height)`` of ``area`` pixels at ``ratio`` = w / h, multiples of 32 (the pipelines' function)."""
    width = math.sqrt(area * ratio)
    return round(width / 32) * 32, round(width / ratio / 32) * 32
