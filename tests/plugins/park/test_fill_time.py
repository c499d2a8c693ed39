"""The planned fill time of park's encoder cache (issue 46): the pre-pass's ops counted per part, timed on the
device or on the host, times the batches the data set's entries need (runner/plan/fill_time.py)."""
from __future__ import annotations

import math

import pytest

from runner.cli.compose import compose_config
from runner.plan import plan_step
from runner.plan.result import format_plan

pytestmark = pytest.mark.usefixtures("one_thread")


def _plan(*overrides: str):
    return plan_step(compose_config(["+preset=chroma_16gb", "train.device=cuda_sim", *overrides]))


def test_the_plan_times_the_pre_pass_where_it_runs_for_the_demo_sets_entries():
    fills = {where: _plan(f"offload.park.fill={where}").cache_fill["fill"] for where in ("device", "host")}
    device, host = fills["device"], fills["host"]
    assert (device["on"], host["on"]) == ("device", "host") and host["where"].startswith("the host CPU")
    for f in (device, host):
        assert f["entries"] == {"latents": 16, "text": 16} and f["batch_size"] == 2  # the demo set, cold
        assert f["seconds"] == pytest.approx(sum(math.ceil(16 / 2) * s for s in f["seconds_per_batch"].values()), rel=1e-4)
        assert f["untimed"] == [] and all(s > 0 for s in f["seconds_per_batch"].values())
    # The same encoders' work, placed apart: equal FLOPs; park moves the parked encoders in for each device
    # batch (the text encoder's weights at least), the host fill copies nothing to the device.
    assert device["flops_per_batch"] == host["flops_per_batch"] and all(host["flops_per_batch"].values())
    assert device["h2d_bytes_per_batch"]["text"] > 0 and set(host["h2d_bytes_per_batch"].values()) == {0}


def test_flipped_views_and_a_data_folder_change_the_entries_timed(tmp_path):
    flipped = _plan("data.random_flip=true").cache_fill["fill"]
    assert flipped["entries"] == {"latents": 32, "text": 16}  # both orientations of each image; one caption each
    plan = _plan(f"data.path={tmp_path}")  # mode=plan reads no data: the time per sample only
    fill = plan.cache_fill["fill"]
    assert fill["entries"] is None and fill["seconds"] is None
    assert fill["seconds_per_sample"] == pytest.approx(sum(fill["seconds_per_batch"].values()) / 2, abs=1e-5)
    assert "per sample (the data folder is not read: x its samples)" in format_plan(plan)


def test_a_plan_over_budget_in_the_pre_pass_suggests_filling_block_by_block():
    # chroma_16gb's tiny first run peaks in T5's pre-pass (1.06 MiB; training 0.81): at 0.12 GiB with the
    # 128 MiB of workspaces it does not fit, and park's declared setting is suggested, saving up to the excess.
    plan = _plan("budget_gb=0.12")
    fill = plan.cache_fill
    suggested = {s["override"]: s for s in plan.suggestions}
    assert suggested["offload.park.fill=stream"]["saves_bytes"] == fill["peak_bytes"] - fill["training_peak_bytes"]
    streamed = _plan("budget_gb=0.12", "offload.park.fill=stream")
    assert streamed.cache_fill["peak_bytes"] < fill["peak_bytes"] and streamed.cache_fill["fill"]["on"] == "stream"
    assert "offload.park.fill=stream" not in {s["override"] for s in streamed.suggestions}
