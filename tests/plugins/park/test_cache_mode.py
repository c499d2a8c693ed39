"""``mode=cache`` (issue 46): the encoder cache filled as its own step, on the device or the host, keyed as the
training run keys it; ``offload.park.fill`` is checked before anything is built."""
from __future__ import annotations

import json

import pytest
from runner_setup import job

from runner.cli.compose import compose_config
from runner.checks import check_config
from runner.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_mode_cache_fills_on_the_host_and_the_next_run_plans_and_runs_no_pre_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache = tmp_path / "c"
    common = ["offload=park", f"offload.park.cache_dir={cache}", "data.demo_size=4", "train.device=cuda_sim",
              "train.steps=2", "model.train=lora"]
    s = job(tmp_path / "fill", "mode=cache", "offload.park.fill=host", *common)
    assert s["status"] == "ok" and s["steps_done"] == 0
    filled = {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")}
    assert len(filled) == 8  # 4 samples' latents and text embeddings
    s = job(tmp_path / "train", *common)
    assert s["status"] == "ok" and s["steps_done"] == 2
    plan = json.loads((tmp_path / "train" / "plan.json").read_text())["cache_fill"]
    assert plan["entries"] == {"latents": [4, 4], "text": [4, 4]} and plan["parts"] == []  # no pre-pass planned
    assert plan["host_parts"] == [] and plan["fill"] is None  # nor timed
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")} == filled  # none run: nothing rewritten
    assert 0.97 <= s["peak_memory_gb"] / s["planned_peak_gb"] <= 1.03


def test_an_unknown_fill_placement_is_refused_naming_the_key_and_the_choices():
    with pytest.raises(UserError, match=r"offload\.park\.fill='gpu' is not valid\. Valid values: device, host, stream"):
        check_config(compose_config(["mode=cache", "offload=park", "offload.park.fill=gpu"]))


def test_a_streamed_fill_holds_one_encoder_block_on_the_card_and_the_card_peaks_as_planned(tmp_path, monkeypatch):
    # chroma_16gb's first run peaks in T5's pre-pass (test_plan_cache.py); fill=stream parks each T5 block
    # apart, so the pre-pass holds one block's weights, not T5's, and the simulated card agrees with its plan.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    common = ["+preset=chroma_16gb", "train.device=cuda_sim", "train.steps=1"]
    peaks = {}
    for fill in ("stream", "device"):
        s = job(tmp_path / fill, *common, f"offload.park.fill={fill}", f"offload.park.cache_dir={tmp_path / fill / 'c'}")
        assert s["status"] == "ok", s.get("error")
        assert 0.97 <= s["peak_memory_gb"] / s["planned_peak_gb"] <= 1.03
        plan = json.loads((tmp_path / fill / "plan.json").read_text())
        assert plan["peak_phase"] == "setup, in cache fill" and plan["cache_fill"]["fill"]["on"] == fill
        peaks[fill] = plan["cache_fill"]["peak_bytes"]
    assert peaks["stream"] < peaks["device"]


def test_mode_cache_without_a_cache_is_refused_before_anything_is_built(tmp_path):
    s = job(tmp_path / "none", "mode=cache", "offload=none")
    assert s["status"] != "ok" and "no plugin of this run keeps one: add offload=park" in s["error"]


def test_a_run_that_fills_on_the_host_plans_no_device_bytes_for_its_pre_pass(tmp_path, capsys):
    # chroma_16gb's first run peaks in T5's pre-pass on the card (test_plan_cache.py); with fill=host the
    # encoders run on the CPU, so the plan's peak is training's.
    from runner.__main__ import task
    from runner.cli.launch import run_job

    try:
        run_job(task, compose_config([f"output_dir={tmp_path / 'p'}", "mode=plan", "+preset=chroma_16gb",
                                      "train.device=cuda_sim", "offload.park.fill=host"]))
    except SystemExit:
        pass
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    fill = plan["cache_fill"]
    assert fill["parts"] == [] and fill["host_parts"] == ["latents", "text"] and fill["run_peak"] == "training"
    assert plan["peak_bytes"] == fill["training_peak_bytes"] and "cache fill" not in plan["peak_phase"]
    assert fill["fill"]["on"] == "host" and fill["fill"]["entries"] == {"latents": 16, "text": 16}
    out = capsys.readouterr().out
    assert "pre-pass (latents, text) on the host: no device bytes" in out
    assert "planned fill time on the host CPU (200 GFLOP/s, 20 GB/s assumed): " in out
    assert "for 16 latents + 16 text entries (per batch of 2: latents " in out
