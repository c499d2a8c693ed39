"""The planner's sampling pass (runner/plan/sampling.py) against real CPU sampling of tiny models.

Truth: what a real ``Sampler.sample`` adds on top of what lives anyway, counted by a
LiveBytesTracker on the CPU, against the plan's sampling peak minus its between-steps bytes.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from runner_setup import prepared_context

from runner.cli.compose import compose_config
from runner.memory.live_bytes import LiveBytesTracker
from runner.plan import plan_step
from runner.sampling import build_sampler

SAMPLE = ["sample.every=1", "sample.prompts=[a cat]", "sample.steps=2", "train.device=cpu"]


def real_sampling_bytes(tmp: Path, overrides: list[str]) -> tuple[int, int]:
    """(bytes sampling adds at its peak on a real CPU run, bytes of the VAE's weights)."""
    ctx = prepared_context(tmp, *overrides)
    sampler = build_sampler(ctx)
    ctx.apply_setup_phases()
    tracker = LiveBytesTracker()
    modules = sampler.modules()
    for name, m in modules.items():
        tracker.track(m, "weights", module=name)
    vae_bytes = sum(p.numel() * p.element_size() for p in modules["vae"].parameters())
    try:
        with tracker:
            tracker.reset_peaks()
            before = tracker.current_bytes("cpu")
            sampler.sample(0)
    finally:
        ctx.teardown()
    return tracker.snapshot()["devices"]["cpu"]["peak_bytes"] - before, vae_bytes


@pytest.mark.parametrize("family", ["sdxl", "flux", "sd15", "sd35"])
def test_planned_sampling_pass_matches_real_sampling_within_5_percent(tmp_path, family):
    overrides = [f"trainer={family}", *SAMPLE, "sample.resolution=128"]
    real, _ = real_sampling_bytes(tmp_path, overrides)
    s = plan_step(compose_config(overrides)).sampling
    planned = s["peak_bytes"] - s["between_steps_bytes"]
    assert abs(planned - real) <= 0.05 * real, (planned, real)
    assert s["resolution"] == 128 and s["denoiser_batch"] == {"sdxl": 2, "flux": 1, "sd15": 2, "sd35": 2}[family] and s["vae_decode"]


def test_with_park_the_dropped_vae_visits_the_device_for_the_decode(tmp_path):
    """On a GPU the kept VAE is copied in for the decode: the plan counts its weights there; a
    CPU run has nothing to copy, so the plan is the real bytes plus the VAE's."""
    overrides = ["trainer=flux", *SAMPLE, "sample.resolution=128", "offload=park",
                 f"offload.park.cache_dir={tmp_path / 'cache'}"]
    real, vae_bytes = real_sampling_bytes(tmp_path / "run", overrides)
    plan = plan_step(compose_config(overrides))
    assert "vae" not in plan.run["modules"]  # dropped from training
    planned = plan.sampling["peak_bytes"] - plan.sampling["between_steps_bytes"]
    assert abs(planned - (real + vae_bytes)) <= 0.05 * real, (planned, real, vae_bytes)


def test_tiled_vae_lowers_the_planned_sampling_peak_and_says_so():
    base = ["trainer=sdxl", *SAMPLE, "sample.resolution=256"]
    whole = plan_step(compose_config(base)).sampling
    tiled = plan_step(compose_config([*base, "tiling=vae", "tiling.vae.vae_tile_size=64",
                                      "tiling.vae.vae_tile_overlap=16"])).sampling
    assert tiled["vae_tiled"] and not whole["vae_tiled"]
    assert tiled["peak_bytes"] < whole["peak_bytes"]


def test_sampling_joins_the_plan_peak_table_and_json_only_when_on(tmp_path):
    off = plan_step(compose_config(["trainer=sdxl", "train.device=cpu"]))
    assert off.sampling is None and "sample" not in off.phases and "sampling pass" not in off.format_table()
    on = plan_step(compose_config(["trainer=sdxl", *SAMPLE, "sample.resolution=256"]))
    # Sampling adds a phase; the training step's phases are planned as before.
    assert {k: v for k, v in on.phases.items() if k != "sample"} == off.phases
    s = on.sampling
    assert s["peak_bytes"] == on.phases["sample"] and s["training_step_peak_bytes"] == max(off.phases.values())
    # At 256 px (training: 64 px) the sampling pass is the run's peak, and the fit check uses it.
    assert on.peak_bytes == s["peak_bytes"] > s["training_step_peak_bytes"] and on.peak_phase.startswith("sample")
    assert "sampling pass (sample.every, 256 px, denoiser batch 2)" in on.format_table()
    saved = json.loads(on.write_json(tmp_path / "plan.json").read_text())
    assert saved["sampling"] == s
