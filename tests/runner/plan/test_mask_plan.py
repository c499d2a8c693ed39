"""The planner with ``data.masks``: the loss mask is on the device during the step (the raw batch's
pixel-size mask through the encode, the latent-grid ``loss_mask`` through the loss), so the simulated
batches carry both, and the plan still agrees with a real CPU step. Without masks the batches are
unchanged (every shipped preset's planned bytes: bench/plan_snapshot.py)."""
from __future__ import annotations

import pytest
from planner_truth import assert_plan_matches_a_real_cpu_step

from runner.parts import build_trainer
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.plan import plan_step
from runner.plan.batch import example_batch
from runner.resolved import resolve

pytestmark = pytest.mark.usefixtures("one_thread")


def compose(*overrides: str):
    cfg = compose_config(["train.device=cpu", "data.resolution=128", *overrides])
    validate(cfg)
    return cfg


@pytest.mark.parametrize("trainer", ["sdxl", "flux"])
def test_the_simulated_batches_carry_the_masks(trainer):
    on = build_trainer(c := compose(f"trainer={trainer}", "data.masks=true"), resolve(c))
    off = build_trainer(c := compose(f"trainer={trainer}"), resolve(c))
    raw, encoded = example_batch(on, True, 2), example_batch(on, False, 2)
    assert tuple(raw["mask"].shape) == (2, 1, 128, 128)
    lat = encoded["latents"]
    assert tuple(encoded["loss_mask"].shape) == (2, 1, *lat.shape[-2:]) and encoded["loss_mask"].device == lat.device
    assert "mask" not in example_batch(off, True, 2) and "loss_mask" not in example_batch(off, False, 2)


def test_masks_add_their_bytes_to_the_plan_and_it_matches_a_real_step():
    cfg = compose("data.masks=true")
    assert_plan_matches_a_real_cpu_step(cfg)
    with_masks, without = plan_step(cfg), plan_step(compose())
    assert with_masks.peak_bytes > without.peak_bytes
