"""The ``trainer=sd15`` option schema (SD1.5 / SD2.1), importable without torch: Hydra composes a run against it
before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.loss.config import DDPM
from runner.registry import TrainerEntry

SD15_NATIVE_RESOLUTION = {"sd15": 512, "sd21": 768}  # px at model.size=full, by trainer.variant


@dataclass
class SD15TrainerConfig:
    _target_: str = "runner.families.sd15.trainer.SD15Trainer"
    variant: str = "sd15"  # sd15 (SD1.5, CLIP ViT-L, 512 px) | sd21 (SD2.1, OpenCLIP ViT-H, 768 px)
    prediction_type: Optional[str] = None  # epsilon | v_prediction; None = the variant's (sd15 epsilon, sd21 v)


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="sd15",
                 target="runner.families.sd15.trainer.SD15Trainer",
                 config=SD15TrainerConfig,
                 description="SD1.5 / SD2.1 U-Net (trainer.variant=sd15|sd21), DDPM loss (epsilon or v)",
                 native_resolution=SD15_NATIVE_RESOLUTION,
                 objective=DDPM),
)
