"""The built-in trainers' option schemas (``trainer=sdxl``, ``trainer=flux``), importable without torch.

Hydra composes every run against the selected trainer's schema, and ``trainer=sdxl`` is the
default, so the schema must not import diffusers or torch (``--help`` and config errors answer
without them). The trainer classes (runner/trainers/sdxl.py, flux.py) take their ``Config``
from here; runner/trainers/__init__.py registers each option with its class's path.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SDXLTrainerConfig:
    _target_: str = "runner.trainers.sdxl.SDXLTrainer"
    prediction_type: str = "epsilon"  # epsilon | v_prediction


@dataclass
class FluxTrainerConfig:
    _target_: str = "runner.trainers.flux.FluxTrainer"
    guidance: float = 1.0  # value fed to the guidance embedding (guidance-distilled models only)
    timestep_sampling: str = "logit_normal"  # logit_normal | uniform
