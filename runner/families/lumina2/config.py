"""The ``trainer=lumina2`` option schema (Lumina-Image 2.0), importable without torch: Hydra composes a run against it
before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.loss.config import FLOW
from runner.registry import TrainerEntry


@dataclass
class Lumina2TrainerConfig:
    _target_: str = "runner.families.lumina2.trainer.Lumina2Trainer"
    # Tokens of the system prompt and caption together, padded and masked; longer ones are truncated.
    # null: Lumina2Pipeline's default, 256.
    max_sequence_length: Optional[int] = None


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="lumina2",
                 target="runner.families.lumina2.trainer.Lumina2Trainer",
                 config=Lumina2TrainerConfig,
                 description=("Lumina-Image 2.0 unified NextDiT (2.6 B), Gemma-2 2B text encoder, rectified-flow "
                              "matching loss"),
                 objective=FLOW),
)
