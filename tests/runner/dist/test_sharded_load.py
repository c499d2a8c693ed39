"""Issue 29: under ``dist=fsdp`` the trained module is built on ``meta`` on every rank, sharded, then
filled shard by shard (runner/dist/loading.py): from a safetensors file each rank reads only its rows;
at random init rank 0 builds it and the others receive their shards by broadcast. Two CPU ranks
(gloo, ``torchrun``) train a full fine-tune of the tiny SDXL U-Net 2 steps and must give one
process's losses (the same weights bit for bit, so only the ranks' float sums differ: REL).

Marked ``slow``: each launch starts two processes that import torch and diffusers (~40 s here).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.output.report import read_metrics
from test_dist_training import BASE, assert_same_losses, launch, one_process

pytestmark = pytest.mark.slow

FULL = [*BASE, "trainer=sdxl", "model.train=full", "train.steps=2"]


def tiny_unet_file(path: Path) -> Path:
    """The tiny SDXL U-Net's state dict (another seed than the runs' own init) in bfloat16, diffusers'
    key layout with the ``unet.`` prefix: what ``model.path=<file>`` reads (and converts to float32)."""
    from safetensors.torch import save_file

    from runner.cli.compose import compose_config
    from runner.trainers.sdxl import SDXLTrainer

    torch.manual_seed(1234)
    unet = SDXLTrainer(compose_config([*FULL])).build_models("cpu")["unet"]
    save_file({f"unet.{k}": v.to(torch.bfloat16).contiguous() for k, v in unet.state_dict().items()}, str(path))
    return path


def test_fsdp_reads_each_ranks_rows_of_a_safetensors_file_like_one_process(tmp_path):
    file = tiny_unet_file(tmp_path / "unet.safetensors")
    extra = [*FULL, f"model.path={file}"]
    reference = one_process(tmp_path / "one", common=extra)
    proc = launch("torchrun", tmp_path / "run", "dist=fsdp", *extra, f"output_dir={tmp_path / 'two'}")
    logs = proc.stdout + proc.stderr
    assert "unet built on meta; each rank reads its shard's rows from 1 safetensors file(s)" in logs
    assert_same_losses(read_metrics(tmp_path / "two" / "metrics.jsonl"), reference)


def test_fsdp_at_random_init_broadcasts_rank_0s_module_like_one_process(tmp_path):
    reference = one_process(tmp_path / "one", common=FULL)
    proc = launch("torchrun", tmp_path / "run", "dist=fsdp", *FULL, f"output_dir={tmp_path / 'two'}")
    logs = proc.stdout + proc.stderr
    assert "rank 0 builds unet whole (random init); the other ranks receive their shards from it" in logs
    assert_same_losses(read_metrics(tmp_path / "two" / "metrics.jsonl"), reference)
