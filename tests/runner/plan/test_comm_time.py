"""Communication in the step-time model (runner/plan/comm.py): the links of conf/devices.yaml, and a
rank's collectives computed from the planner's unit sizes on the tiny SDXL model, planned for a GPU.

Bytes, not times: each collective's bytes are the units' parameter bytes (counted here from the
built model) x (n-1)/n of the ring; times are only compared with each other (a faster link, less time).
"""
from __future__ import annotations

import functools

import pytest
import torch

from runner.cli.compose import compose_config
from runner.checks import validate
from runner.devices import device_table, link_spec, link_table
from runner.errors import UserError
from runner.plan import plan_step
from runner.plan.comm import Ring, repriced, ring_sent, step_seconds

BASE = ["train.batch_size=4", "model.train=full", "optimizer=adamw", "train.mixed_precision=bf16"]  # for the (reference) GPU


@functools.cache
def plan(*overrides: str):
    cfg = compose_config(["mode=plan", *BASE, *overrides])
    validate(cfg)
    return plan_step(cfg)


@functools.cache
def unet_and_blocks():
    from runner.blocks import find_repeated_blocks
    from runner.parts import build_trainer, prepare_models
    from runner.plan.target import DEVICE
    from runner.resolved import resolve

    cfg = compose_config(BASE)
    run = resolve(cfg)
    unet = prepare_models(build_trainer(cfg, run).build_models(DEVICE), cfg.model, run)["unet"]
    return unet, find_repeated_blocks(unet)


def rows(p, kind, phase, exposed=False):
    return [c for c in p.step_time["comm"]["collectives"] if c["kind"] == kind and c["phase"] == phase
            and c["exposed"] == exposed]


def test_every_interconnect_loads_and_every_device_names_one():
    table = link_table()
    assert {"nvlink4", "nvlink3", "pcie4_x16", "pcie5_x16", "ib_100", "ib_400"} <= set(table)
    for name in table:
        spec = link_spec(name)
        assert spec.gbps > 0 and spec.hop_latency_us > 0 and spec.label
    for name, row in device_table().items():
        assert row["link"] in table, name
    assert link_spec("ib_400").gbps == 4 * link_spec("ib_100").gbps  # 400 and 100 Gb/s line rates


def test_an_unknown_interconnect_is_refused_naming_the_valid_ones():
    with pytest.raises(UserError) as e:
        link_spec("nvlink9")
    assert "dist.interconnect='nvlink9'" in str(e.value) and "nvlink4" in str(e.value)
    for key in ("dist.interconnect", "dist.inter_node_interconnect"):
        cfg = compose_config(["mode=plan", *BASE, "dist=fsdp", "dist.world_size=2", f"{key}=infiniband"])
        with pytest.raises(UserError) as e:
            validate(cfg)
        assert f"{key}='infiniband'" in str(e.value) and "ib_100" in str(e.value)
    cfg = compose_config(["mode=plan", *BASE, "dist=ddp", "dist.world_size=2", "dist.ranks_per_node=0"])
    with pytest.raises(UserError, match="dist.ranks_per_node=0"):
        validate(cfg)


def test_fsdp_collectives_are_the_units_bytes_times_n_minus_1_over_n():
    """bf16 autocast with float32 weights: FSDP2 gathers each unit in bf16, reduce-scatters float32."""
    unet, blocks = unet_and_blocks()
    params = list(unet.parameters())
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)
    gathered = sum(p.numel() * 2 for p in params)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = sum(p.numel() * 2 for p in params if id(p) not in in_blocks)
    grads = sum(p.numel() * 4 for p in params)
    for n in (2, 4):
        p = plan("dist=fsdp", f"dist.world_size={n}")
        (fwd,), (bwd,), (rs,) = rows(p, "all-gather", "forward"), rows(p, "all-gather", "backward"), \
            rows(p, "reduce-scatter", "backward")
        assert (fwd["gathered_bytes"], fwd["sent_bytes"]) == (gathered, gathered * (n - 1) // n)
        assert (bwd["gathered_bytes"], bwd["sent_bytes"]) == (gathered - root, (gathered - root) * (n - 1) // n)
        assert (rs["gathered_bytes"], rs["sent_bytes"]) == (grads, grads * (n - 1) // n)
        assert fwd["calls"] == len(blocks) + 1 and bwd["calls"] == len(blocks)
        comm = p.step_time["comm"]
        assert comm["seconds"] == pytest.approx(fwd["seconds"] + bwd["seconds"] + rs["seconds"])
    kept = plan("dist=fsdp", "dist.world_size=2", "dist.reshard_after_forward=false")
    assert not rows(kept, "all-gather", "backward")  # gathered once, kept to the backward


def test_ddp_all_reduces_every_trained_gradient_twice_n_minus_1_over_n_after_the_passes():
    unet, _ = unet_and_blocks()
    grads = sum(p.numel() * 4 for p in unet.parameters())
    p = plan("dist=ddp", "dist.world_size=2")
    (ar,) = rows(p, "all-reduce", "optimizer")
    assert (ar["gathered_bytes"], ar["sent_bytes"]) == (grads, ring_sent(grads, 2, "all-reduce")) == (grads, grads)
    comm = p.step_time["comm"]
    assert comm["exposed"]["optimizer"] == comm["phases"]["optimizer"]  # nothing hides it
    assert p.step_time["phases"]["optimizer"] == pytest.approx(comm["compute_phases"]["optimizer"]
                                                               + comm["phases"]["optimizer"], abs=1e-6)


def test_a_faster_link_gives_less_communication_and_no_slower_step():
    by_link = {name: plan("dist=fsdp", "dist.world_size=2", f"dist.interconnect={name}")
               for name in ("ib_100", "pcie4_x16", "nvlink4")}
    comm = [by_link[k].step_time["comm"]["seconds"] for k in ("ib_100", "pcie4_x16", "nvlink4")]
    step = [by_link[k].step_time["seconds"] for k in ("ib_100", "pcie4_x16", "nvlink4")]
    assert comm[0] > comm[1] > comm[2] > 0
    assert step[0] >= step[1] >= step[2]
    for p in by_link.values():  # what the link adds to compute alone: at least what nothing can hide
        st = p.step_time
        assert st["comm"]["added_seconds"] == pytest.approx(st["seconds"] - st["comm"]["compute_seconds"])
        assert st["comm"]["added_seconds"] >= sum(st["comm"]["exposed"].values()) * (1 - 1e-9) > 0
    assert plan("dist=fsdp").step_time.get("comm") is None  # one process: nothing sent


def test_rings_across_nodes_are_bounded_by_the_network_and_a_replan_equals_its_repricing():
    """16 ranks, 8 per node, NVLink within: the ring crosses nodes on 8 NICs at once; one node of 16
    runs at NVLink. Repricing a plan's collectives over its own links gives its own s/step."""
    args = ("dist=fsdp", "dist.world_size=16", "train.batch_size=16", "dist.interconnect=nvlink4",
            "dist.inter_node_interconnect=ib_100")
    two_nodes, one_node = plan(*args), plan(*args, "dist.ranks_per_node=16")
    assert {c["link"] for c in two_nodes.step_time["comm"]["collectives"]} == {"ib_100"}
    assert {c["link"] for c in one_node.step_time["comm"]["collectives"]} == {"nvlink4"}
    assert two_nodes.step_time["comm"]["seconds"] > one_node.step_time["comm"]["seconds"]
    nv, ib = link_spec("nvlink4"), link_spec("ib_100")
    assert Ring(16, 2, nv, ib).gbps == 8 * ib.gbps and Ring(2, 2, nv, ib).gbps == ib.gbps
    pcie, ib400 = link_spec("pcie4_x16"), link_spec("ib_400")
    assert Ring(16, 2, pcie, ib400).gbps == pcie.gbps  # 8 NICs of 50 GB/s: the node's PCIe bounds the ring
    for p in (two_nodes, one_node):
        again = repriced(p.step_time["comm"], nv, ib)
        assert again.seconds == pytest.approx(p.step_time["comm"]["seconds"])
        assert step_seconds(p.step_time, again) == pytest.approx(p.step_time["seconds"])
    moved = repriced(one_node.step_time["comm"], nv, ib, ranks_per_node=8)
    assert moved.seconds == pytest.approx(two_nodes.step_time["comm"]["seconds"])


def test_hybrid_shard_all_reduces_each_gradient_shard_across_nodes_on_one_nic():
    """hybrid_shard over 2 nodes of 2: gathers and reduce-scatters stay in the node (its link), then each
    rank's float32 gradient shard (1/2 of them) is all-reduced with its replica on the other node."""
    unet, _ = unet_and_blocks()
    grads = sum(p.numel() * 4 for p in unet.parameters())
    p = plan("dist=fsdp", "dist.world_size=4", "dist.sharding_strategy=hybrid_shard", "dist.ranks_per_node=2",
             "dist.interconnect=nvlink4", "dist.inter_node_interconnect=ib_400")
    (rs,), (ar,) = rows(p, "reduce-scatter", "backward"), rows(p, "all-reduce", "backward")
    assert (rs["group"], rs["nodes"], rs["link"], rs["sent_bytes"]) == (2, 1, "nvlink4", grads // 2)
    assert (ar["group"], ar["nodes"], ar["link"]) == (2, 2, "ib_400")
    assert ar["gathered_bytes"] == grads // 2 and ar["sent_bytes"] == ring_sent(grads // 2, 2, "all-reduce")


def test_a_device_spec_of_ones_own_names_its_link_or_is_refused(tmp_path):
    import yaml

    row = dict(device_table()["rtx4090"])
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump({"name": "my_card", **row, "link": "pcie5_x16"}))
    bad.write_text(yaml.safe_dump({"name": "my_card", **row, "link": "nvlink9"}))
    validate(compose_config(["mode=plan", *BASE, f"device.spec={good}"]))
    with pytest.raises(UserError) as e:
        validate(compose_config(["mode=plan", *BASE, f"device.spec={bad}"]))
    assert "'nvlink9'" in str(e.value) and "pcie5_x16" in str(e.value)
