"""The ``trainer=hunyuan_video15`` option schema (HunyuanVideo 1.5 text-to-video), importable without torch: Hydra
composes a run against it before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.loss.config import FLOW
from runner.registry import TrainerEntry

NATIVE_RESOLUTION = {"": 480}  # px at model.size=full: the 480p model (data.width/data.height default to it)


@dataclass
class HunyuanVideo15TrainerConfig:
    _target_: str = "runner.families.hunyuan_video15.trainer.HunyuanVideo15Trainer"
    # Qwen2.5-VL tokens kept after the system template (padded or truncated), as the pipeline's
    # tokenizer_max_length. null: the pipeline's 1000 (96 for the random tiny model's byte-level tokenizer).
    max_sequence_length: Optional[int] = None


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="hunyuan_video15",
                 target="runner.families.hunyuan_video15.trainer.HunyuanVideo15Trainer",
                 config=HunyuanVideo15TrainerConfig,
                 description=("HunyuanVideo 1.5 text-to-video dual-stream transformer (8.3 B), Qwen2.5-VL-7B and "
                              "glyph ByT5 text encoders, rectified-flow matching loss"),
                 native_resolution=NATIVE_RESOLUTION,
                 objective=FLOW),
)
