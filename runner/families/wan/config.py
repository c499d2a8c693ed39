"""The ``trainer=wan`` option schema (Wan 2.1, 2.2 and image-to-video), importable without torch: Hydra composes a run
against it before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.loss.config import FLOW
from runner.registry import TrainerEntry

WAN_NATIVE_RESOLUTION = {"14b": 480, "1.3b": 480, "2.2-5b": 704, "2.2-a14b": 480, "i2v-2.1-14b": 480,
                         "i2v-2.2-a14b": 480}  # px at model.size=full, by trainer.variant


@dataclass
class WanTrainerConfig:
    _target_: str = "runner.families.wan.trainer.WanTrainer"
    # image-to-video: variant i2v-2.1-14b (Wan 2.1 I2V 14B, CLIP image encoder) | i2v-2.2-a14b (Wan 2.2 I2V A14B,
    # trainer.experts=high|low at its 0.9 boundary): runner/families/wan/i2v.py
    variant: str = "14b"  # 14b | 1.3b (Wan 2.1 T2V) | 2.2-5b (Wan 2.2 TI2V-5B, text-to-video) | 2.2-a14b (Wan 2.2 T2V A14B)
    experts: Optional[str] = None  # 2.2-a14b only: both (switch by timestep) | high (t >= 0.875, transformer/) | low (transformer_2/)
    # UMT5 tokens per caption (zero-padded); null: the pipeline's 512 (64 for the random tiny model).
    max_sequence_length: Optional[int] = None


# The Wan 2.2 models as trainer options of their own: trainer=wan with the variant (and expert) set.
# A preset for one of them names the option instead of setting trainer.* keys, so the preset still
# composes with any other trainer (trainer=custom, sdxl, ...), which has no trainer.variant.
@dataclass
class Wan22A14BTrainerConfig(WanTrainerConfig):
    variant: str = "2.2-a14b"
    experts: Optional[str] = "both"  # both experts in one run (runner/families/wan/experts.py); high|low: one of them


@dataclass
class Wan22_5BTrainerConfig(WanTrainerConfig):
    variant: str = "2.2-5b"


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="wan",
                 target="runner.families.wan.trainer.WanTrainer",
                 config=WanTrainerConfig,
                 description=("Wan 2.1/2.2 text-to-video transformer (trainer.variant=14b|1.3b|2.2-5b|2.2-a14b; "
                              "image-to-video: i2v-2.1-14b|i2v-2.2-a14b), rectified-flow matching loss"),
                 native_resolution=WAN_NATIVE_RESOLUTION,
                 objective=FLOW),
    TrainerEntry(name="wan22_a14b",
                 target="runner.families.wan.trainer.WanTrainer",
                 config=Wan22A14BTrainerConfig,
                 description=("trainer=wan with trainer.variant=2.2-a14b trainer.experts=both: Wan 2.2 T2V A14B, both"
                              " experts in one run, switched by timestep (trainer.experts=high or low: one expert per"
                              " run)"),
                 native_resolution=WAN_NATIVE_RESOLUTION,
                 objective=FLOW),
    TrainerEntry(name="wan22_5b",
                 target="runner.families.wan.trainer.WanTrainer",
                 config=Wan22_5BTrainerConfig,
                 description="trainer=wan with trainer.variant=2.2-5b: Wan 2.2 TI2V-5B in its text-to-video mode",
                 native_resolution=WAN_NATIVE_RESOLUTION,
                 objective=FLOW),
)
