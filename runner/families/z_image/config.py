"""The ``trainer=z_image`` option schema (Z-Image), importable without torch: Hydra composes a run against it
before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.loss.config import FLOW
from runner.registry import TrainerEntry


@dataclass
class ZImageTrainerConfig:
    _target_: str = "runner.families.z_image.trainer.ZImageTrainer"
    # Caption tokens (chat template included) per prompt, zero-padded and masked; longer captions are
    # truncated. null: ZImagePipeline's default, 512.
    max_sequence_length: Optional[int] = None


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="z_image",
                 target="runner.families.z_image.trainer.ZImageTrainer",
                 config=ZImageTrainerConfig,
                 description="Z-Image single-stream DiT (6.2 B), Qwen3-4B text encoder, rectified-flow matching loss",
                 objective=FLOW),
)
