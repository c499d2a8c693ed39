"""One rank's plan: ``mode=plan dist=ddp|fsdp dist.world_size=N`` (runner/plan/dist.py).

* Against the truth: two processes (torchrun, gloo) each plan their own rank and then run the same
  step for real under the live-bytes tracker (tests/dist_truth.py; the tracker follows FSDP2's
  storage resizes and counts a DTensor's local shard): the planned peak is within 5 % on each rank,
  for DDP and for FSDP2.
* What the plan is made of, on the tiny SDXL model in this process: FSDP's weights are exactly
  this rank's padded shards, its optimizer state the share of them, the all-gather and
  reduce-scatter rows follow the units; DDP's buckets hold the trained gradients; one process is
  byte for byte the plan without ``dist``.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cli.compose import compose_config
from runner.checks import validate
from runner.plan import plan_step
from runner.plan.dist import ALL_GATHER, DDP_BUCKETS, REDUCE_SCATTER, shard_bytes

ROOT = Path(__file__).resolve().parents[3]
TINY = ["train.device=cpu", "train.batch_size=4"]


@functools.cache
def plan(*overrides: str):
    cfg = compose_config(["mode=plan", *TINY, *overrides])
    validate(cfg)
    return plan_step(cfg)


@pytest.mark.slow
def test_each_ranks_plan_is_within_5_percent_of_its_real_step(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "dist_truth", str(tmp_path), *TINY], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for dist in ("ddp", "fsdp"):
        for rank in (0, 1):
            got = json.loads((tmp_path / f"{dist}-rank-{rank}.json").read_text())
            assert got["world"] == 2 and got["rank"] == rank
            assert got["plan_peak"] == pytest.approx(got["real_peak"], rel=0.05), (dist, rank, got)
            for phase in ("forward", "backward"):
                assert got["plan_phases"][phase] == pytest.approx(got["real_phases"][phase], rel=0.05), (dist, phase)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["optimizer.fused_backward=true"]], ids=["", "fused_backward"])
def test_fsdp_mixed_precision_plan_is_within_5_percent_of_its_real_step(tmp_path, extra):
    """The same truth, for FSDP2 with a MixedPrecisionPolicy (bf16 units from float32 shards; bf16 autocast
    kept on the CPU by train.cpu_autocast=true), a full fine-tune with checkpointed blocks; and the same
    with fused backward (each shard steps in its hook after the reduce-scatter, its gradient freed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
           "RUNNER_TRUTH_DISTS": "fsdp"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "dist_truth", str(tmp_path), *TINY, "train.cpu_autocast=true",
                           "train.mixed_precision=bf16", "model.train=full", "checkpoint=blocks", *extra],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"fsdp-rank-{rank}.json").read_text())
        assert got["plan_peak"] == pytest.approx(got["real_peak"], rel=0.05), (rank, got)
        for phase in ("forward", "backward"):
            assert got["plan_phases"][phase] == pytest.approx(got["real_phases"][phase], rel=0.05), (phase, got)


@pytest.fixture(scope="module")
def unet_params():
    from runner.parts import build_trainer, prepare_models
    from runner.plan.target import DEVICE
    from runner.resolved import resolve

    cfg = compose_config(TINY)
    run = resolve(cfg)
    return list(prepare_models(build_trainer(cfg, run).build_models(DEVICE), cfg.model, run)["unet"].parameters())


def test_fsdp_plans_this_ranks_shards_and_the_gather_and_scatter_buffers(unet_params):
    one, two = plan(), plan("dist=fsdp", "dist.world_size=2")
    full = sum(p.numel() * p.element_size() for p in unet_params)
    shards = sum(shard_bytes(p, 2) for p in unet_params)
    assert one.by_module["unet"]["weights"] == full
    assert two.by_module["unet"]["weights"] == shards and full / 2 <= shards < full / 2 * 1.01
    assert two.optimizer_state_bytes["meta"] == pytest.approx(one.optimizer_state_bytes["meta"] / 2, rel=0.01)
    assert ALL_GATHER in two.by_module
    assert two.peak_bytes < one.peak_bytes
    four = plan("dist=fsdp", "dist.world_size=4", "train.batch_size=4")
    assert four.by_module["unet"]["weights"] == sum(shard_bytes(p, 4) for p in unet_params)
    assert four.peak_bytes < two.peak_bytes


def test_fsdp_plans_the_ema_of_this_ranks_shards(unet_params):
    """Issue 29: each FSDP rank keeps the EMA of its own shards (runner/ema/average.py). The plan's EMA
    line and its column at the peak are this rank's share of one process's copy (the shards' share of
    the trained bytes), on the host with ema.device=cpu (the host's steady figure too), and the rest of
    the rank's plan is its plan without an EMA."""
    off = plan("dist=fsdp", "dist.world_size=2")
    on = plan("dist=fsdp", "dist.world_size=2", "ema.enabled=true")
    host = plan("dist=fsdp", "dist.world_size=2", "ema.enabled=true", "ema.device=cpu")
    one = plan("ema.enabled=true")
    trained = [p for p in unet_params if p.requires_grad]
    share = sum(shard_bytes(p, 2) for p in trained) / sum(p.numel() * p.element_size() for p in trained)
    copy = one.ema["device_bytes"]
    assert copy == 4 * one.ema["parameters"] and 0.5 <= share < 0.51
    assert on.ema["device_bytes"] == int(copy * share) and on.ema["host_bytes"] == 0
    assert on.by_category["ema"] == on.ema["device_bytes"]
    assert on.peak_bytes == off.peak_bytes + on.ema["device_bytes"]
    assert host.ema["host_bytes"] == on.ema["device_bytes"] and host.ema["device_bytes"] == 0
    assert host.peak_bytes == off.peak_bytes and "ema" not in host.by_category
    assert host.host_steady_bytes - off.host_steady_bytes == on.ema["device_bytes"]
    offload = plan("dist=fsdp", "dist.world_size=2", "ema.enabled=true", "dist.cpu_offload=true")
    assert offload.ema["host_bytes"] == on.ema["device_bytes"] and offload.ema["device_bytes"] == 0
    assert offload.peak_bytes == plan("dist=fsdp", "dist.world_size=2", "dist.cpu_offload=true").peak_bytes


def test_fsdp_cpu_offload_and_kept_gathered_weights_move_the_bytes_where_fsdp_keeps_them():
    base = plan("dist=fsdp", "dist.world_size=2")
    offload = plan("dist=fsdp", "dist.world_size=2", "dist.cpu_offload=true")
    assert offload.by_module["unet"].get("weights", 0) == 0 and offload.optimizer_state_bytes.get("meta", 0) == 0
    assert offload.peak_bytes < base.peak_bytes and offload.host_peak_bytes > base.host_peak_bytes
    kept = plan("dist=fsdp", "dist.world_size=2", "dist.reshard_after_forward=false")
    assert kept.peak_bytes > base.peak_bytes  # every unit stays gathered from its forward to its backward


def test_fsdp_mixed_precision_plans_bf16_units_and_no_cast_cache_of_the_weights():
    """Issue 29: with bf16 autocast and float32 trained weights FSDP2 gathers each unit in bf16
    (runner/distributed/runtime.py), so no op casts a weight and autocast caches none. Against the same plan
    with ``dist.mixed_precision=false`` (float32 gathers, autocast's cast cache), the forward holds
    exactly less: the cache (a bf16 copy of every Linear/Conv weight and bias of the U-Net, alive to
    the end of the forward) and half the forward's gather window (the root unit and two blocks)."""
    import torch
    from torch import nn

    from runner.blocks import find_repeated_blocks
    from runner.parts import build_trainer, prepare_models
    from runner.plan.target import DEVICE
    from runner.resolved import resolve

    bf16 = ("dist=fsdp", "dist.world_size=2", "train.cpu_autocast=true", "train.mixed_precision=bf16",
            "model.train=full")
    mp, off = plan(*bf16), plan(*bf16, "dist.mixed_precision=false")
    cfg = compose_config([*TINY, *bf16[2:]])
    run = resolve(cfg)
    unet = prepare_models(build_trainer(cfg, run).build_models(DEVICE), cfg.model, run)["unet"]
    assert all(p.dtype == torch.float32 for p in unet.parameters())
    half = torch.bfloat16.itemsize
    blocks = find_repeated_blocks(unet)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = sum(p.numel() * half for p in unet.parameters() if id(p) not in in_blocks)
    largest = max(sum(p.numel() * half for p in b.parameters()) for b in blocks)
    cache = sum(p.numel() * half for m in unet.modules() if isinstance(m, (nn.Linear, nn.Conv2d))
                for p in m.parameters(recurse=False))
    assert off.phases["forward"] - mp.phases["forward"] == cache + root + 2 * largest
    assert mp.peak_bytes < off.peak_bytes
    assert mp.run["rank_text"] == off.run["rank_text"]


def test_ddp_keeps_the_trained_gradients_in_its_buckets(unet_params):
    one, two = plan(), plan("dist=ddp", "dist.world_size=2")
    trained = sum(p.numel() * p.element_size() for p in unet_params if p.requires_grad)
    assert two.by_module[DDP_BUCKETS]["gradients"] in (trained, 2 * trained)
    assert REDUCE_SCATTER not in two.by_module and two.by_module["unet"]["weights"] == one.by_module["unet"]["weights"]


def test_one_process_plans_byte_for_byte_as_without_dist():
    a, b = plan(), plan("dist=fsdp")
    assert (a.peak_bytes, a.phases, a.by_module, a.host_peak_bytes) == (b.peak_bytes, b.phases, b.by_module,
                                                                        b.host_peak_bytes)


def test_plan_reports_host_ram_per_rank_and_per_node_as_the_ranks_load_the_trained_module(tmp_path):
    """Issue 29: host RAM per rank follows how the ranks get the trained module (runner/distributed/loading.py),
    per node = rank 0's peak + (dist.ranks_per_node - 1) x the others' (default: min(world_size, 8)).
    dist=ddp: every rank loads it whole. dist=fsdp at random init: rank 0 builds it whole (at least
    the DDP rank's peak), the other ranks hold their shards and one tensor instead of the whole U-Net.
    From a safetensors file every rank reads its rows: rank 0 holds no more than the others."""
    from safetensors.torch import save_file

    from runner.parts import build_trainer, prepare_models
    from runner.resolved import resolve

    full = ("model.train=full", "dist.world_size=4")
    cfg = compose_config([*TINY, *full[:1]])
    run = resolve(cfg)
    unet = prepare_models(build_trainer(cfg, run).build_models("cpu"), cfg.model, run)["unet"]
    whole = sum(p.numel() * p.element_size() for p in unet.parameters())
    shards = sum(shard_bytes(p, 4) for p in unet.parameters())
    largest = max(p.numel() * p.element_size() for p in unet.parameters())

    ddp = plan("dist=ddp", *full).host_ranks
    assert ddp["load"] == "whole" and ddp["ranks_per_node"] == 4
    assert ddp["rank0_bytes"] == ddp["per_rank_bytes"] and ddp["per_node_bytes"] == 4 * ddp["per_rank_bytes"]
    rand = plan("dist=fsdp", *full)
    h = rand.host_ranks
    assert h["load"] == "broadcast" and h["rank0_bytes"] >= ddp["per_rank_bytes"]
    assert h["per_rank_bytes"] <= ddp["per_rank_bytes"] - whole + shards + largest < ddp["per_rank_bytes"]
    # the shards are made on the device (runner/distributed/loading.py shard_units), not on the host: one tensor in flight
    assert h["per_rank_bytes"] <= ddp["per_rank_bytes"] - whole + largest
    assert rand.host_peak_bytes == h["per_rank_bytes"]
    assert h["per_node_bytes"] == h["rank0_bytes"] + 3 * h["per_rank_bytes"]
    assert "host RAM per rank" in rand.format_table() and "per node of 4 ranks" in rand.format_table()
    two = plan("dist=fsdp", *full, "dist.ranks_per_node=2").host_ranks
    assert two["per_node_bytes"] == two["rank0_bytes"] + two["per_rank_bytes"]

    file = tmp_path / "unet.safetensors"
    save_file({f"unet.{k}": v.contiguous() for k, v in unet.state_dict().items()}, str(file))
    sliced = plan("dist=fsdp", *full, f"model.path={file}").host_ranks
    assert sliced["load"] == "slices" and sliced["rank0_bytes"] == sliced["per_rank_bytes"]
    assert sliced["per_rank_bytes"] == h["per_rank_bytes"] and sliced["per_node_bytes"] == 4 * sliced["per_rank_bytes"]


def test_ranks_other_than_0_plan_their_setup_without_the_modules_only_rank_0_loads():
    """Issue 29: under offload=park on one node only rank 0 loads the modules whose outputs it caches
    (runner/distributed/loading.py), so the other ranks' host peak at setup lacks their parameters; rank 0's
    is the plan where every rank loads them (two nodes of one rank: a node may fill its own cache)."""
    from runner.parts import build_trainer

    one_node = plan("dist=ddp", "dist.world_size=2", "offload=park").host_ranks
    every_rank = plan("dist=ddp", "dist.world_size=2", "offload=park", "dist.ranks_per_node=1").host_ranks
    assert every_rank["rank0_bytes"] == every_rank["per_rank_bytes"] == one_node["rank0_bytes"]
    cfg = compose_config(["mode=plan", *TINY])
    models = build_trainer(cfg, validate(cfg).run).build_models("meta")
    params = {n: sum(p.numel() * p.element_size() for p in models[n].parameters()) for n in models.modules}
    # the setup peak's instant (rank 0's cache fill) holds both text encoders whole, the VAE not
    assert one_node["per_rank_bytes"] == every_rank["per_rank_bytes"] - params["text_encoder"] - params["text_encoder_2"]
    assert one_node["per_node_bytes"] == one_node["rank0_bytes"] + one_node["per_rank_bytes"]
