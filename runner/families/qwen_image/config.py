"""The ``trainer=qwen_image`` option schema (Qwen-Image), importable without torch: Hydra composes a run against it
before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.loss.config import FLOW
from runner.registry import TrainerEntry


@dataclass
class QwenImageTrainerConfig:
    _target_: str = "runner.families.qwen_image.trainer.QwenImageTrainer"
    # Text tokens after the template's dropped prefix; captions are truncated to it and padded to it
    # (masked). null: the pipeline's 512 (96 for the random tiny model's byte-level tokenizer).
    max_sequence_length: Optional[int] = None


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="qwen_image",
                 target="runner.families.qwen_image.trainer.QwenImageTrainer",
                 config=QwenImageTrainerConfig,
                 description="Qwen-Image MMDiT (20 B), Qwen2.5-VL text encoder, rectified-flow matching loss",
                 objective=FLOW),
)
