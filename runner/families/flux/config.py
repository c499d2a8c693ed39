"""The ``trainer=flux`` option schema (Flux (FLUX.1)), importable without torch: Hydra composes a run against it
before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass

from runner.loss.config import FLOW
from runner.registry import TrainerEntry


@dataclass
class FluxTrainerConfig:
    _target_: str = "runner.families.flux.trainer.FluxTrainer"
    guidance: float = 1.0  # value fed to the guidance embedding (guidance-distilled models only)


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="flux",
                 target="runner.families.flux.trainer.FluxTrainer",
                 config=FluxTrainerConfig,
                 description="Flux transformer, rectified-flow matching loss",
                 objective=FLOW),
)
