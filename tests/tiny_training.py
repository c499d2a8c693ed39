"""Helpers shared by the offload tests: tiny trainers, bit-exact training comparisons, fake U-Net inputs.

Not a test module (no ``test_`` prefix); pytest puts tests/ on ``sys.path``, so test files import it
by name.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from runner.parts import build_trainer
from runner.cli.compose import compose_config


def built_as_run(overrides: list[str]) -> tuple[Any, Any]:
    """(trainer, models) of the composed ``overrides``, built and prepared as a run builds them, with
    the run's seed set first: the weights a run of those overrides starts from."""
    from accelerate.utils import set_seed

    from runner.parts import prepare_models
    from runner.resolved import resolve

    cfg = compose_config(overrides)
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    set_seed(run.seed)
    return trainer, prepare_models(trainer.build_models("cpu"), cfg.model, run)


@functools.cache
def tiny_trainer(family: str, train: str) -> Any:
    """The built-in ``family`` trainer (sdxl | flux) at tiny size, ``model.train=train``; built once."""
    return build_trainer(compose_config([f"trainer={family}", f"model.train={train}"]))


def assert_identical_training(base: tuple, other: tuple) -> None:
    """Two runs' (losses per step, gradients per step, final weights, ...) are bitwise equal."""
    losses_a, grads_a, weights_a = base[:3]
    losses_b, grads_b, weights_b = other[:3]
    for step, (a, b) in enumerate(zip(losses_a, losses_b)):
        assert torch.equal(a, b), f"loss of step {step + 1}: {a.item()!r} != {b.item()!r}"
    for step, (ga, gb) in enumerate(zip(grads_a, grads_b)):
        assert ga.keys() == gb.keys() and ga
        bad = [n for n in ga if not torch.equal(ga[n], gb[n])]
        assert not bad, f"step {step + 1}: {len(bad)} gradients differ, e.g. {bad[:3]}"
    assert weights_a.keys() == weights_b.keys()
    bad = [n for n in weights_a if not torch.equal(weights_a[n], weights_b[n])]
    assert not bad, f"{len(bad)} weights differ after {len(losses_a)} steps, e.g. {bad[:3]}"


def fake_unet_inputs(batch: dict[str, Any], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(latents, timesteps, encoder_hidden_states, added_cond_kwargs) of an SDXL U-Net call on ``meta``,
    shaped like ``batch`` (a trainer's ``example_batch``). Call inside the simulation mode."""
    x = torch.empty(batch["latents"].shape, dtype=dtype, device="meta")
    t = torch.empty(2, dtype=torch.int64, device="meta")
    ehs = torch.empty(batch["prompt_embeds"].shape, dtype=dtype, device="meta")
    cond = {"text_embeds": torch.empty(batch["pooled_prompt_embeds"].shape, dtype=dtype, device="meta"),
            "time_ids": torch.empty(batch["time_ids"].shape, dtype=dtype, device="meta")}
    return x, t, ehs, cond
