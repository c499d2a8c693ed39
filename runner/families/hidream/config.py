"""The ``trainer=hidream`` option schema (HiDream-I1), importable without torch: Hydra composes a run against it
before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass

from runner.loss.config import FLOW
from runner.registry import TrainerEntry


@dataclass
class HiDreamTrainerConfig:
    _target_: str = "runner.families.hidream.trainer.HiDreamTrainer"


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="hidream",
                 target="runner.families.hidream.trainer.HiDreamTrainer",
                 config=HiDreamTrainerConfig,
                 description=("HiDream-I1 sparse DiT (17 B, 4 experts), two Long-CLIPs, T5-XXL and Llama-3.1-8B text "
                              "encoders, rectified-flow matching loss"),
                 objective=FLOW),
)
