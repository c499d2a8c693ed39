"""The plan's reserved bytes: the step's device allocations replayed through the caching allocator's model."""
from __future__ import annotations

from typing import Any

import pytest

from runner.cli.compose import compose_config
from runner.checks import validate
from runner.plan import GiB, plan_step
from runner.plan.allocator import AllocationLog, expandable_segments


def compose(*overrides: str) -> Any:
    cfg = compose_config(list(overrides))
    validate(cfg)
    return cfg


def test_a_cuda_plan_reports_what_the_caching_allocator_reserves() -> None:
    plan = plan_step(compose())
    r = plan.reserved
    assert r is not None and r["expandable_segments"] is True  # the allocator plugin's default
    # The replay's allocated peak is the plan's steady-state peak with each request rounded to
    # 512 B (the second step replayed with the first step's optimizer state in place).
    assert plan.peak_bytes <= r["allocated_peak_bytes"] <= plan.peak_bytes * 1.05
    assert r["allocated_peak_bytes"] <= r["reserved_peak_bytes"]
    assert plan.reserved_required_bytes == r["reserved_peak_bytes"] + plan.margin_bytes
    assert "reserved by the caching allocator (expandable segments)" in plan.format_table()
    assert plan.to_dict()["reserved_required_bytes"] == plan.reserved_required_bytes


def test_the_allocator_setting_and_the_environment_choose_the_model(monkeypatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert expandable_segments(compose()) is True
    assert expandable_segments(compose("allocator.default.expandable_segments=false")) is False
    assert expandable_segments(compose("allocator=[]")) is False  # PyTorch's own default
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:False")
    assert expandable_segments(compose()) is False
    plan = plan_step(compose())
    assert plan.reserved["expandable_segments"] is False


def test_no_reserved_figure_without_a_caching_allocator() -> None:
    plan = plan_step(compose("train.device=cpu"))
    assert plan.reserved is None and plan.reserved_required_bytes is None
    assert "reserved by the caching allocator" not in plan.format_table()


def test_a_budget_the_allocator_cannot_serve_does_not_fit() -> None:
    """At a budget just above the allocated peak plus workspaces, the requests rounded to 512 B
    no longer fit the cap: the allocator would raise OOM, so the plan says it does not fit."""
    roomy = plan_step(compose())
    rounded = roomy.reserved["allocated_peak_bytes"] - roomy.peak_bytes
    assert rounded > 4096  # the case needs rounding to matter
    tight = plan_step(compose(f"budget_gb={(roomy.required_bytes + rounded // 2) / GiB!r}"))
    assert tight.required_bytes <= tight.budget_bytes
    assert tight.reserved["ooms"] > 0 and not tight.fits
    assert "the caching allocator cannot serve it" in tight.format_table()
    ok = plan_step(compose(f"budget_gb={(roomy.reserved_required_bytes + 2**20) / GiB!r}"))
    assert ok.reserved["ooms"] == 0 and ok.reserved["retries"] == 0 and ok.fits


def test_the_second_step_is_replayed_on_the_first_steps_blocks() -> None:
    log = AllocationLog("meta")
    log.born("meta", 1, 100 * 2**20)  # a weight
    log.step_started()
    log.born("meta", 2, 30 * 2**20)  # an activation
    log.born("cpu", 3, 10**9)  # a host tensor: not the device's
    log.died("meta", 2)
    log.died("meta", 1)  # a death of something born before the step is not replayed
    log.step_ended()
    log.born("meta", 4, 8 * 2**20)  # optimizer state, between the steps
    from runner.memory.caching_allocator import CachingAllocatorModel

    m = log.replay(CachingAllocatorModel(expandable_segments=True))
    assert m.peak_allocated == 100 * 2**20 + 30 * 2**20
    assert m.allocated == 8 * 2**20  # the replayed activation died again; the weight stays dead
    assert m.peak_reserved == 7 * 20 * 2**20  # 130 MiB in 20 MiB pages; step 2 reuses them


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_planned_reserved_matches_the_cuda_allocator() -> None:
    from test_planner import cuda_step_peak

    cfg = compose("data.resolution=512", "train.batch_size=4", "train.device=cuda", "train.mixed_precision=bf16")
    plan = plan_step(cfg)
    measured = cuda_step_peak(cfg, reserved=True)
    # The workspaces (the margin) are reserved too; the replay's reserved peak is the floor.
    assert plan.reserved["reserved_peak_bytes"] * 0.97 <= measured <= plan.reserved_required_bytes * 1.03, (
        plan.reserved, measured)
