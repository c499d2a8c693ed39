"""Foundation checks that only a CUDA device can show (skipped without one).

Checkpointing's saving in real ``torch.cuda`` peak bytes, the live-bytes tracker against the
CUDA allocator's own count, the allocator cap raising a real OOM, and a tiny run on the GPU.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel

from runner.blocks import find_repeated_blocks
from runner.memory.live_bytes import LiveBytesTracker
from runner.plugins.checkpoint import (
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def mid_unet() -> UNet2DConditionModel:
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=64, block_out_channels=(64, 128, 256), layers_per_block=2, cross_attention_dim=256,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=8,
    ).cuda()


def step_peak(unet, x, t, ctx) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    unet.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = unet(x, t, ctx).sample
    out.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grads = {n: p.grad.detach().clone() for n, p in unet.named_parameters()}
    return peak, out.detach(), grads


def test_checkpointing_lowers_the_cuda_peak_and_keeps_gradients():
    unet = mid_unet()
    x = torch.randn(4, 4, 64, 64, device="cuda")
    t = torch.tensor([10, 200, 500, 900], device="cuda")
    ctx = torch.randn(4, 77, 256, device="cuda")
    peak_plain, out_plain, g_plain = step_peak(unet, x, t, ctx)
    blocks = find_repeated_blocks(unet)
    apply_activation_checkpointing(blocks)
    peak_ckpt, out_ckpt, g_ckpt = step_peak(unet, x, t, ctx)
    remove_activation_checkpointing(blocks)
    print(f"cuda peak above weights: plain {peak_plain / 2**20:.1f} MiB, checkpointed {peak_ckpt / 2**20:.1f} MiB")
    assert peak_ckpt < 0.7 * peak_plain
    torch.testing.assert_close(out_ckpt, out_plain, rtol=1e-4, atol=1e-5)
    for n in g_plain:
        torch.testing.assert_close(g_ckpt[n], g_plain[n], rtol=1e-3, atol=1e-5, msg=n)


def test_tracker_agrees_with_the_cuda_allocator():
    unet = mid_unet()
    x = torch.randn(2, 4, 64, 64, device="cuda")
    t = torch.tensor([10, 500], device="cuda")
    ctx = torch.randn(2, 77, 256, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    tracker = LiveBytesTracker()
    tracker.track(unet, "weights")
    with tracker:
        unet(x, t, ctx).sample.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    cuda_peak = torch.cuda.max_memory_allocated() - base
    weights = sum(p.numel() * p.element_size() for p in unet.parameters())
    tracked = tracker.snapshot()["devices"]["cuda:0"]["peak_bytes"] - weights
    print(f"peak above weights: tracker {tracked / 2**20:.1f} MiB, torch.cuda {cuda_peak / 2**20:.1f} MiB")
    # The allocator rounds every block up to 512 B and kernels take workspaces the tracker cannot see.
    assert abs(tracked - cuda_peak) / cuda_peak < 0.10


def test_allocator_cap_makes_the_card_behave_like_a_small_one(tmp_path):
    code = """
import torch
from omegaconf import OmegaConf
from runner.plugins.allocator import AllocatorConfig, apply_allocator_settings
apply_allocator_settings(OmegaConf.structured(AllocatorConfig(cap_to_budget=True)), budget_gb=1.0, device=torch.device('cuda'))
small = torch.empty(512 * 2**20, dtype=torch.uint8, device='cuda')
try:
    torch.empty(2 * 2**30, dtype=torch.uint8, device='cuda')
except torch.OutOfMemoryError:
    print('OOM at the cap')
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "OOM at the cap" in r.stdout, r.stdout + r.stderr


def test_tiny_preset_run_on_cuda(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-m", "runner", "+preset=sdxl_24gb", "train.steps=5", "train.progress=false",
                        f"output_dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 5 and '"memory_peak_gb"' in rows[0]
