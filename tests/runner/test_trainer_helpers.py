"""The runner's helpers for trainers (runner/trainer.py) run under the planner's fake tensors too."""
from __future__ import annotations

import torch

from runner.compat import is_fake
from runner.plan.fake import simulation_mode
from runner.trainer import per_sample_rand, per_sample_randn


def test_per_sample_draws_from_seeds_computed_inside_the_planned_step():
    with simulation_mode():
        seeds = torch.tensor([1, 2, 3]) * 31 + 17  # computed in the step: a fake tensor without values
        assert is_fake(seeds)
        noise = per_sample_randn(seeds, (4, 8, 8), "cpu", torch.bfloat16)
        u = per_sample_rand(seeds, 5, "cpu")
    assert is_fake(noise) and noise.shape == (3, 4, 8, 8) and noise.dtype == torch.bfloat16
    assert is_fake(u) and u.shape == (3,)


def test_real_seeds_still_give_each_row_its_own_numbers():
    both = per_sample_randn(torch.tensor([48, 79]), (2, 3), "cpu", torch.float32)
    alone = per_sample_randn(torch.tensor([79]), (2, 3), "cpu", torch.float32)
    assert torch.equal(both[1], alone[0]) and not torch.equal(both[0], both[1])
    assert per_sample_rand(torch.tensor([48, 79]), 5, "cpu")[1] == per_sample_rand(torch.tensor([79]), 5, "cpu")[0]
