"""The planner and the validation pass (runner/plan/val.py): planned only when it can raise the peak.

At a validation batch no larger than the training micro-batch the pass is a subset of the training
step's own work and is not simulated (the plan says so and its bytes are unchanged); above it,
one no-grad encode + forward at that batch is simulated between steps and joins the plan's peak.
"""
from __future__ import annotations

import pytest

from runner.cli.compose import compose_config
from runner.plan import plan_step

pytestmark = pytest.mark.usefixtures("one_thread")


def test_validation_is_planned_only_when_it_can_raise_the_peak():
    base = ["train.batch_size=2"]
    off = plan_step(compose_config(base))
    small = plan_step(compose_config([*base, "data.val_fraction=0.25"]))
    assert small.validation["planned"] is False and small.validation["batch_size"] == 2
    assert "validation" not in small.phases and small.peak_bytes == off.peak_bytes and off.validation is None
    big = plan_step(compose_config([*base, "data.val_fraction=0.25", "val.batch_size=16"]))
    assert big.validation["planned"] is True and big.validation["batch_size"] == 16
    assert big.phases["validation"] == big.validation["peak_bytes"]
    assert big.peak_bytes == max(big.phases.values())
    # between steps the weights and optimizer state are live, the gradients are not
    assert big.validation["between_steps_bytes"] < big.phases["backward"]
    assert big.phases["validation"] > big.validation["between_steps_bytes"]  # its activations on top
    assert "validation pass (val.batch_size 16): peak" in big.format_table()
