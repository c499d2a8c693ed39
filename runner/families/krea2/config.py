"""The ``trainer=krea2`` option schema (Krea 2), importable without torch: Hydra composes a run against it before
any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.loss.config import FLOW
from runner.registry import TrainerEntry


@dataclass
class Krea2TrainerConfig:
    _target_: str = "runner.families.krea2.trainer.Krea2Trainer"
    # The fixed text length after the system prefix (caption, padding, then the assistant suffix), as
    # Krea2Pipeline's max_sequence_length. null: the pipeline's 512 (96 for the random tiny model's tokenizer).
    max_sequence_length: Optional[int] = None


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="krea2",
                 target="runner.families.krea2.trainer.Krea2Trainer",
                 config=Krea2TrainerConfig,
                 description=("Krea 2 single-stream MMDiT, Qwen3-VL-4B text encoder (12 tapped layers), "
                              "rectified-flow matching loss"),
                 objective=FLOW),
)
