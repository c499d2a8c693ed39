"""The ``trainer=qwen_image21`` option schema (Qwen-Image 2.1), importable without torch: Hydra composes a run against
it before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.loss.config import FLOW
from runner.registry import TrainerEntry


@dataclass
class QwenImage21TrainerConfig:
    _target_: str = "runner.families.qwen_image21.trainer.QwenImage21Trainer"
    # Caption tokens kept after the system line (the pipeline truncates nothing; a cache entry needs one
    # shape): longer captions are truncated. null: 512 (96 for the random tiny model's byte-level tokenizer).
    max_sequence_length: Optional[int] = None


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="qwen_image21",
                 target="runner.families.qwen_image21.trainer.QwenImage21Trainer",
                 config=QwenImage21TrainerConfig,
                 description=("Qwen-Image 2.1 single-stream block-causal DiT (7 B), Qwen3-VL-8B text encoder, "
                              "rectified-flow matching loss"),
                 objective=FLOW),
)
