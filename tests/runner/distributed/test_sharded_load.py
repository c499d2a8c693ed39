"""Issue 29: under ``dist=fsdp`` the trained module is built on ``meta`` on every rank, sharded, then
filled shard by shard (runner/distributed/loading.py): from a safetensors file each rank reads only its rows;
at random init rank 0 builds it and the others receive their shards by broadcast. Two CPU ranks
(gloo, ``torchrun``) train a full fine-tune of the tiny SDXL U-Net 2 steps and must give one
process's losses (the same weights bit for bit, so only the ranks' float sums differ: REL).

Marked ``slow``: each launch starts two processes that import torch and diffusers (~40 s here).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_dist_training import BASE, assert_same_losses, launch, one_process

from runner.output.report import read_metrics

pytestmark = pytest.mark.slow

FULL = [*BASE, "trainer=sdxl", "model.train=full", "train.steps=2"]


def tiny_unet_file(path: Path) -> Path:
    """The tiny SDXL U-Net's state dict (another seed than the runs' own init) in bfloat16, diffusers'
    key layout with the ``unet.`` prefix: what ``model.path=<file>`` reads (and converts to float32)."""
    from safetensors.torch import save_file

    from runner.cli.compose import compose_config
    from runner.families.sdxl.trainer import SDXLTrainer

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


def test_each_rank_holds_about_half_the_trained_weights_while_loading(tmp_path):
    """The tracker's host peak on each of 2 ranks, from the build through FSDP2's sharding
    (tests/shard_load_truth.py), less what every rank holds whole (frozen modules, the U-Net's
    buffers): from a file, every rank's trained bytes stay within its shards and one tensor read and
    converted (about half the U-Net; before this change each rank loaded it whole); at random init
    rank 1 holds as little, rank 0 the whole U-Net (it builds and broadcasts it) and no more than one
    unit's shards beside it (not all of them: it shards unit by unit as it sends)."""
    import json
    import os
    import subprocess
    import sys

    from test_dist_training import ASSETS, ROOT

    file = tiny_unet_file(tmp_path / "unet.safetensors")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(ASSETS)])}
    for label, extra in (("file", [f"model.path={file}"]), ("random", [])):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "-m", "shard_load_truth", str(tmp_path), label, *FULL, *extra], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for label in ("file", "random"):
        ranks = [json.loads((tmp_path / f"{label}-rank-{r}.json").read_text()) for r in (0, 1)]
        for r in ranks:
            held = r["host_peak"] - r["frozen"] - r["buffers"]  # the trained weights' share of the peak
            assert r["whole"] / 2 <= r["shards"] < r["whole"] / 2 * 1.01
            if label == "random" and r["rank"] == 0:
                # rank 0 built it whole, and drops each unit's whole weights as it shards that unit
                assert r["whole"] <= held <= r["whole"] + 2 * r["largest"], (label, r)
            else:
                assert held <= r["shards"] + 2 * r["largest"], (label, r)
                assert held < 0.6 * r["whole"], (label, r)


@pytest.mark.parametrize("source", ["random", "file"])
def test_fsdp_lora_broadcasts_rank_0s_base_and_adapters_like_one_process(tmp_path, source):
    """model.train=lora without quantization: rank 0 builds the base (at random, or from a file) and
    draws the adapters, the other rank receives its shards of both (runner/distributed/loading.py; from a file
    it loads the frozen modules itself); the same losses as one process."""
    path = [f"model.path={tiny_unet_file(tmp_path / 'unet.safetensors')}"] if source == "file" else []
    lora = [*BASE, "trainer=sdxl", "model.train=lora", "train.steps=2", *path]
    reference = one_process(tmp_path / "one", common=lora)
    proc = launch("torchrun", tmp_path / "run", "dist=fsdp", *lora, f"output_dir={tmp_path / 'two'}")
    assert "rank 0 builds unet whole (model.train=lora: rank 0 builds the base and draws the adapters" \
        in proc.stdout + proc.stderr
    assert_same_losses(read_metrics(tmp_path / "two" / "metrics.jsonl"), reference)


def test_fsdp_ranks_each_read_a_quantized_lora_base_layer_by_layer_like_one_process(tmp_path):
    """model.train=lora over an nf4 base from a file: every rank builds the U-Net on meta and reads and
    quantizes it layer by layer itself (runner/meta_weights.py; the quantized weights stay whole on
    every rank), then FSDP2 shards what it can; the same losses as one process (which reads it the
    same way: tests/plugins/quantization/test_streamed_load.py compares that with loading it whole)."""
    file = tiny_unet_file(tmp_path / "unet.safetensors")
    lora = [*BASE, "trainer=sdxl", "model.train=lora", "quantization=[nf4]", "train.steps=2", f"model.path={file}"]
    reference = one_process(tmp_path / "one", common=lora)
    proc = launch("torchrun", tmp_path / "run", "dist=fsdp", *lora, f"output_dir={tmp_path / 'two'}")
    logs = proc.stdout + proc.stderr
    assert "the base is built on meta and every rank reads layer by layer from its safetensors files" in logs
    assert "each layer read from its file just before it was quantized" in logs
    assert "quantized tensors kept whole on every rank" in logs
    assert_same_losses(read_metrics(tmp_path / "two" / "metrics.jsonl"), reference)
