"""The ``trainer=flux_kontext`` option schema (FLUX.1 Kontext), importable without torch: Hydra composes a run
against it before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass

from runner.loss.config import FLOW
from runner.registry import TrainerEntry


@dataclass
class FluxKontextTrainerConfig:
    _target_: str = "runner.families.flux_kontext.trainer.FluxKontextTrainer"
    guidance: float = 1.0  # value fed to the guidance embedding (FLUX.1 Kontext dev is guidance-distilled)


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="flux_kontext",
                 target="runner.families.flux_kontext.trainer.FluxKontextTrainer",
                 config=FluxKontextTrainerConfig,
                 description=("Flux.1 Kontext (edit) transformer: reference images (data.references=1) join the "
                              "sequence, rectified-flow matching loss on the target"),
                 objective=FLOW),
)
