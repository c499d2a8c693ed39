"""The ``trainer=flux2`` option schema (FLUX.2 (dev and klein)), importable without torch: Hydra composes a run
against it before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass

from runner.loss.config import FLOW
from runner.registry import TrainerEntry


@dataclass
class Flux2TrainerConfig:
    _target_: str = "runner.families.flux2.trainer.Flux2Trainer"
    variant: str = "dev"  # dev (FLUX.2 dev, 32 B, Mistral-Small-3.1) | klein (4 B, Qwen3-4B) | klein-9b (9 B, Qwen3-8B)
    guidance: float = 1.0  # value fed to the guidance embedding (dev is guidance-distilled; klein has none)


# FLUX.2 klein as a trainer option of its own (trainer=flux2 with the variant set): a preset for it names the
# option instead of setting trainer.variant, so the preset still composes with any other trainer.
@dataclass
class Flux2KleinTrainerConfig(Flux2TrainerConfig):
    variant: str = "klein"  # klein (4 B) | klein-9b


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="flux2",
                 target="runner.families.flux2.trainer.Flux2Trainer",
                 config=Flux2TrainerConfig,
                 description=("Flux.2 dev transformer (32 B, Mistral-Small-3.1 text encoder), optional reference "
                              "images (data.references=1..4), rectified-flow matching loss"),
                 objective=FLOW),
    TrainerEntry(name="flux2_klein",
                 target="runner.families.flux2.trainer.Flux2Trainer",
                 config=Flux2KleinTrainerConfig,
                 description=("trainer=flux2 with trainer.variant=klein: FLUX.2 klein 4B (Qwen3-4B; "
                              "trainer.variant=klein-9b for the 9B)"),
                 objective=FLOW),
)
