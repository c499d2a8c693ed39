"""A user's trainer that reads the card on the host, and whose model size is an option.

``trainer.options.item_reads=k``: the loss calls ``.item()`` on a card tensor k times per micro-batch, as a
trainer logging a value would (each one a host sync on a GPU). ``trainer.options.layers_per_block=n``: the
U-Net's depth, so a test can double the parameters and their number. Used by tests/runner/test_host_syncs.py.
"""
from __future__ import annotations

import torch
from custom_trainer import PixelDiffusionTrainer
from diffusers import UNet2DModel

from runner.trainer import ModelSet


class SyncTrainer(PixelDiffusionTrainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        options = cfg.trainer.get("options") or {}
        self.item_reads = int(options.get("item_reads", 0))
        self.layers = int(options.get("layers_per_block", 1))

    def build_models(self, device="cpu") -> ModelSet:
        with torch.device(device):
            unet = UNet2DModel(sample_size=self.cfg.data.resolution, in_channels=3, out_channels=3,
                               block_out_channels=(16, 32), layers_per_block=self.layers, norm_num_groups=8,
                               down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"))
        return ModelSet({"unet": unet}, trained={"unet"})

    def loss(self, models, batch) -> torch.Tensor:
        loss = super().loss(models, batch)
        for _ in range(self.item_reads):
            loss.item()
        return loss
