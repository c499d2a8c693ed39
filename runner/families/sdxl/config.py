"""The ``trainer=sdxl`` option schema (SDXL), importable without torch: Hydra composes a run against it
before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass

from runner.loss.config import DDPM
from runner.registry import TrainerEntry


@dataclass
class SDXLTrainerConfig:
    _target_: str = "runner.families.sdxl.trainer.SDXLTrainer"
    prediction_type: str = "epsilon"  # epsilon | v_prediction


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="sdxl",
                 target="runner.families.sdxl.trainer.SDXLTrainer",
                 config=SDXLTrainerConfig,
                 description="SDXL U-Net, DDPM loss",
                 objective=DDPM),
)
