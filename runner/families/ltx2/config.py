"""The ``trainer=ltx2`` option schema (LTX-2, audio and video), importable without torch: Hydra composes a run
against it before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.loss.config import FLOW
from runner.registry import TrainerEntry

LTX2_NATIVE_RESOLUTION = {"": 512}  # px at model.size=full: the short side of LTX-2's 768x512


@dataclass
class LTX2TrainerConfig:
    _target_: str = "runner.families.ltx2.trainer.LTX2Trainer"
    # Gemma tokens per caption (left-padded, as LTX2Pipeline's max_sequence_length). null: the pipeline's 1024
    # (64 for the random tiny model).
    max_sequence_length: Optional[int] = None
    # Image-to-video as LTX2ImageToVideoPipeline conditions: the share of samples (0 to 1, drawn per sample from its
    # seed) whose first latent frame is kept clean (its tokens at timestep 0) and left out of the video loss.
    first_frame_p: float = 0.0


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="ltx2",
                 target="runner.families.ltx2.trainer.LTX2Trainer",
                 config=LTX2TrainerConfig,
                 description=("LTX-2 audio-video transformer (19B), Gemma-3-12B text encoder and connectors; "
                              "rectified-flow matching loss over video and audio (loss.audio_weight; "
                              "data.audio=false: video only)"),
                 native_resolution=LTX2_NATIVE_RESOLUTION,
                 objective=FLOW),
)
