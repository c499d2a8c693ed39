"""The model, data and loss of the README's hosted-mode example (plain_loop.py, hosted_loop.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import UNet2DModel


def make_unet() -> UNet2DModel:
    torch.manual_seed(0)
    return UNet2DModel(sample_size=16, in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
                       norm_num_groups=8, down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"))


def batches(n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` seeded batches of two noisy 16 px images with their timesteps."""
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        out.append({"x": torch.randn(2, 3, 16, 16, generator=g), "t": torch.tensor([1, 500])})
    return out


def my_loss(unet: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(unet(batch["x"], batch["t"]).sample.float(), batch["x"].float())
