"""The ``trainer=sd35`` option schema (SD3.5), importable without torch: Hydra composes a run against it
before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass

from runner.loss.config import FLOW
from runner.registry import TrainerEntry


@dataclass
class SD35TrainerConfig:
    _target_: str = "runner.families.sd35.trainer.SD35Trainer"
    variant: str = "large"  # large (8.1 B, 38 blocks) | medium (2.2 B, MMDiT-X)


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="sd35",
                 target="runner.families.sd35.trainer.SD35Trainer",
                 config=SD35TrainerConfig,
                 description=("SD3.5 Medium / Large transformer (trainer.variant=medium|large), rectified-flow "
                              "matching loss"),
                 objective=FLOW),
)
