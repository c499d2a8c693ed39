"""A user's own trainer, outside the runner package (the README's example).

Run it with::

    PYTHONPATH=tests/assets python -m runner trainer=custom trainer._target_=custom_trainer.PixelDiffusionTrainer

It trains an unconditional diffusers ``UNet2DModel`` directly on pixels with a DDPM loss. The
runner still owns the loop, optimizer, placement, precision, checkpoints and memory plugins.
"""
from __future__ import annotations

import torch
from diffusers import DDPMScheduler, UNet2DModel

from runner.data import build_dataset
from runner.trainer import ModelSet, per_sample_rand, per_sample_randn
from runner.trainers.loading import attach_lora


class PixelDiffusionTrainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.scheduler = DDPMScheduler(num_train_timesteps=1000)

    def build_models(self, device="cpu") -> ModelSet:
        with torch.device(device):
            unet = UNet2DModel(sample_size=self.cfg.data.resolution, in_channels=3, out_channels=3,
                               block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8,
                               down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"))
        m = self.cfg.model
        if m.get("train", "full") == "lora":  # model.train=lora: peft adapters on model.lora_targets
            attach_lora(unet, m.lora_rank, m.lora_alpha, list(m.lora_targets), torch.float32)
        return ModelSet({"unet": unet}, trained={"unet"})

    def dataset(self):
        return build_dataset(self.cfg.data)

    def loss(self, models: ModelSet, batch) -> torch.Tensor:
        x0 = batch.get("pixel_values")
        if x0 is None:
            x0 = batch["sample"]
        seeds = batch["sample_seed"]
        noise = per_sample_randn(seeds, tuple(x0.shape[1:]), x0.device, x0.dtype)
        t = (per_sample_rand(seeds, salt=1, device=x0.device) * 999).long()
        noisy = self.scheduler.add_noise(x0, noise, t)
        pred = models["unet"](noisy, t).sample
        return torch.nn.functional.mse_loss(pred.float(), noise.float())

    def example_batch(self, batch_size: int, device="meta"):
        r = self.cfg.data.resolution
        return {"sample": torch.empty(batch_size, 3, r, r, device=device),
                "sample_seed": torch.zeros(batch_size, dtype=torch.int64)}
