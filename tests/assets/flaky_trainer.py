"""A user's trainer whose loss is NaN for chosen sample positions: a transient non-finite step.

``trainer.options.nan_positions=[4,5]`` makes every micro-batch holding the samples at global
positions 4 or 5 return a NaN loss (the runner's sample seed is ``seed * 1_000_003 + position``),
as a corrupt sample or a rare overflow would. Used by tests/runner/test_faults.py.
"""
from __future__ import annotations

import torch
from custom_trainer import PixelDiffusionTrainer


class FlakyTrainer(PixelDiffusionTrainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        seed = int(cfg.train.seed)
        self.bad_seeds = {seed * 1_000_003 + int(p) for p in cfg.trainer.options.get("nan_positions", [])}

    def loss(self, models, batch) -> torch.Tensor:
        loss = super().loss(models, batch)
        if any(int(s) in self.bad_seeds for s in batch["sample_seed"]):
            return loss * float("nan")
        return loss
