"""The planner counts the EMA copy (runner/plan/ema.py): where it lives, in its dtype, exactly.

Its bytes must equal the trained parameters' element count times the EMA dtype's size, and what
the live-bytes tracker counts when the real EMA is built on CPU with real tiny models.
"""
from __future__ import annotations

import pytest
from runner_setup import prepared_context

from runner.cli.compose import compose_config
from runner.ema.average import CATEGORY, build_ema
from runner.memory.live_bytes import LiveBytesTracker
from runner.plan import plan_step

pytestmark = pytest.mark.usefixtures("one_thread")


def trained_elements(ctx) -> int:
    return sum(p.numel() for p in ctx.models.trainable_parameters())


@pytest.mark.parametrize("train, device", [("full", "device"), ("lora", "cpu")])
def test_planned_ema_bytes_equal_the_trackers_on_cpu(tmp_path, train, device):
    overrides = ["train.device=cpu", f"model.train={train}", "ema.enabled=true", f"ema.device={device}"]
    plan = plan_step(compose_config(overrides))
    ctx = prepared_context(tmp_path, *overrides)
    ctx.apply_setup_phases()
    tracker = LiveBytesTracker()
    with tracker, tracker.phase("ema", category=CATEGORY):
        ema = build_ema(ctx)
    real = tracker.category_bytes("cpu")[CATEGORY]
    expected = trained_elements(ctx) * 4
    where = "host_bytes" if device == "cpu" else "device_bytes"
    assert plan.ema[where] == real == expected and sum(ema.nbytes().values()) == expected
    assert plan.ema["host_bytes" if where == "device_bytes" else "device_bytes"] == 0
    if device == "device":
        assert plan.by_category["ema"] == expected  # live at the peak, in its own column
    else:
        assert "ema" not in plan.by_category and plan.host_steady_bytes >= expected


def test_the_ema_dtype_and_placement_on_cuda():
    """The sdxl_24gb preset trains bf16 weights on CUDA: the EMA is float32 (4 B/param) unless
    ema.dtype=bfloat16 (2 B/param); on the host it costs the device nothing."""
    base = ["+preset=sdxl_24gb", "budget_gb=0.01", "ema.enabled=true"]  # a budget it cannot fit: suggestions
    f32 = plan_step(compose_config(base))
    bf16 = plan_step(compose_config([*base, "ema.dtype=bfloat16"]))
    host = plan_step(compose_config([*base, "ema.device=cpu"]))
    off = plan_step(compose_config(base[:2]))
    n = f32.ema["parameters"]
    assert f32.target == "cuda" and f32.run["train_dtype"] == "bfloat16" and n > 1e6
    assert f32.ema["device_bytes"] == 4 * n and f32.ema["host_bytes"] == 0 and f32.ema["dtype"] == "float32"
    assert bf16.ema["device_bytes"] == 2 * n and bf16.ema["dtype"] == "bfloat16"
    assert host.ema["host_bytes"] == 4 * n and host.ema["device_bytes"] == 0
    assert f32.phases["backward"] - off.phases["backward"] == 4 * n  # the copy lives through the step
    assert host.peak_bytes == off.peak_bytes
    assert host.host_steady_bytes - off.host_steady_bytes == 4 * n
    assert off.ema is None and "ema" not in off.by_category and "ema" not in off.phases
    assert any(s["override"] == "ema.device=cpu" and s["saves_bytes"] == 4 * n for s in f32.suggestions)
    assert "EMA of the trained weights (ema.device=device, float32)" in f32.format_table()
