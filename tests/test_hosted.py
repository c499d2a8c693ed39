"""Hosted mode: a user's own loop calls ctx.prepare and gets the configured plugins applied."""
from __future__ import annotations

import torch
from diffusers import UNet2DModel

from runner.hosted import session


def tiny_unet() -> UNet2DModel:
    torch.manual_seed(0)
    return UNet2DModel(sample_size=16, in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
                       norm_num_groups=8, down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"))


def user_loop(overrides: list[str], steps: int = 3) -> tuple[list[float], torch.nn.Module]:
    ctx = session(overrides)
    unet, optimizer, loader = ctx.prepare(tiny_unet(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), [0] * steps)
    losses = []
    for i in loader:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(2, 3, 16, 16, generator=g)
        with ctx.step_context(), ctx.accelerator.autocast():
            loss = torch.nn.functional.mse_loss(unet(x, torch.tensor([1, 500])).sample, x)
        ctx.accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, unet


def test_hosted_loop_runs_with_plugins_applied():
    plain, _ = user_loop(["train.device=cpu"])
    ckpt, unet = user_loop(["train.device=cpu", "checkpoint=blocks"])
    # Checkpointing changes memory, not math.
    torch.testing.assert_close(torch.tensor(ckpt), torch.tensor(plain), rtol=1e-5, atol=1e-6)
    assert any(getattr(m, "_runner_checkpointed", False) for m in unet.modules()), "checkpoint plugin not applied"
