"""The ``trainer=chroma`` option schema (Chroma), importable without torch: Hydra composes a run against it
before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass

from runner.loss.config import FLOW
from runner.registry import TrainerEntry


@dataclass
class ChromaTrainerConfig:
    """Chroma has no trainer option of its own: no guidance embedding (it is not guidance-distilled),
    and T5's prompt length is the tokenizer's (512 for a real folder, the pipeline's limit)."""

    _target_: str = "runner.families.chroma.trainer.ChromaTrainer"


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="chroma",
                 target="runner.families.chroma.trainer.ChromaTrainer",
                 config=ChromaTrainerConfig,
                 description="Chroma transformer (8.9 B, Flux-derived, T5 only), rectified-flow matching loss",
                 objective=FLOW),
)
