"""A trainer that runs out of memory on purpose, for CLI tests that cannot register a plugin.

``trainer.options.oom_above=N`` raises a real ``torch.OutOfMemoryError`` whenever a micro-batch
holds more than N samples (0: always, even at micro-batch 1), like a card too small for
micro-batches above N. Use it in a subprocess with ``PYTHONPATH=tests/assets``::

    python -m runner trainer=custom trainer._target_=oom_trainer.OOMPixelTrainer data.resolution=16 \
        +trainer.options.oom_above=1
"""
from __future__ import annotations

import torch
from custom_trainer import PixelDiffusionTrainer


class OOMPixelTrainer(PixelDiffusionTrainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.oom_above = int(cfg.trainer.options.get("oom_above", -1))

    def loss(self, models, batch):
        n = len(batch["sample_seed"])
        if 0 <= self.oom_above < n:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB (injected: micro-batch {n} > {self.oom_above})")
        return super().loss(models, batch)
