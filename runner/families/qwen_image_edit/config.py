"""The ``trainer=qwen_image_edit`` option schema (Qwen-Image-Edit), importable without torch: Hydra composes a run
against it before any model code loads (runner/families/__init__.py registers it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from runner.loss.config import FLOW
from runner.registry import TrainerEntry


@dataclass
class QwenImageEditTrainerConfig:
    _target_: str = "runner.families.qwen_image_edit.trainer.QwenImageEditTrainer"
    variant: str = "edit"  # edit (Qwen-Image-Edit, one reference) | plus (2509/2511, QwenImageEditPlusPipeline, up to 3)
    # Qwen-Image-Edit-2511's transformer flag (its config.json: zero_cond_t true): the reference tokens are modulated
    # at t=0. null: a model.path folder's config.json says (off when built from model.size or a single file, as
    # 2509); true: 2511 (variant=plus), for a single file or a random build; refused when a folder says otherwise.
    zero_cond_t: Optional[bool] = None
    # Instruction tokens kept after the reference's vision tokens; captions are truncated to it and the
    # embedding padded (masked) to the vision tokens plus it. null: 512 (96 for the tiny byte-level tokenizer).
    max_sequence_length: Optional[int] = None


# The trainer options this family registers (runner/families/__init__.py: register_family).
OPTIONS = (
    TrainerEntry(name="qwen_image_edit",
                 target="runner.families.qwen_image_edit.trainer.QwenImageEditTrainer",
                 config=QwenImageEditTrainerConfig,
                 description=("Qwen-Image-Edit MMDiT (trainer.variant=edit|plus): reference images (data.references) "
                              "join the sequence and Qwen2.5-VL sees them with the instruction, rectified-flow "
                              "matching loss on the target"),
                 objective=FLOW),
)
