"""Adapters over quantized bases (runner/adapters.py QUANTIZED_BASES): LoKr and LoHa train over
the int8 and fp8 layers, planned within the planner tests' 5 % of a real CPU step; the pairs not
checked (LoKr/LoHa over nf4, DoRA over any quantization) are refused before step 1 naming both keys."""
from __future__ import annotations

import pytest
import torch
from planner_truth import prepared_step, real_step
from torch import nn

from runner.cli.compose import compose_config
from runner.checks import check_config, validate
from runner.errors import UserError
from runner.plan import plan_step

pytestmark = pytest.mark.usefixtures("one_thread")

WORKS = [("lokr", "int8"), ("loha", "fp8")]
REFUSED = [(["model.train=lokr"], "nf4", "model.train=lokr"), (["model.train=loha"], "nf4", "model.train=loha"),
           (["model.train=lora", "model.lora_dora=true"], "int8", "model.lora_dora=true"),
           (["model.train=lora", "model.lora_dora=true"], "fp8", "model.lora_dora=true"),
           (["model.train=lora", "model.lora_dora=true"], "nf4", "model.lora_dora=true")]


def cfg_of(*overrides: str):
    cfg = compose_config(["train.device=cpu", "data.resolution=64", *overrides])
    validate(cfg)
    return cfg


@pytest.mark.parametrize("train, quant", WORKS)
def test_lokr_and_loha_train_over_a_quantized_base_and_are_planned(train, quant):
    cfg = cfg_of(f"model.train={train}", f"quantization={quant}")
    ctx, params, _raw, _micro = prepared_step(cfg)
    try:
        from peft.tuners.lycoris_utils import LycorisLayer

        layers = [m for m in ctx.models["unet"].modules() if isinstance(m, LycorisLayer)]
        assert layers and all(type(m.get_base_layer()) is not nn.Linear for m in layers)  # the bases are quantized
        loss = ctx.trainer.loss(ctx.models, ctx.trainer.example_batch(1, "cpu"))
        loss.backward()
        assert torch.isfinite(loss) and params and all(p.grad is not None for p in params)
        assert any(p.grad.abs().max() > 0 for p in params)
    finally:
        ctx.teardown()
    # The planner's peak and each phase's against a real step, the planner tests' 5 %. (Not the
    # weights category byte for byte: the int8 simulation differs from the real layers by the same
    # bytes under plain LoRA, a gap of the int8 plugin's, not the adapters'.)
    plan, real = plan_step(cfg), real_step(cfg)
    assert plan.peak_bytes == pytest.approx(real["peak_bytes"], rel=0.05)
    for phase in ("forward", "backward"):
        assert plan.phases[phase] == pytest.approx(real["peak_by_phase"][phase], rel=0.05), phase


@pytest.mark.parametrize("adapter, quant, key", REFUSED)
def test_unchecked_adapter_and_quantization_pairs_are_refused(adapter, quant, key):
    with pytest.raises(UserError, match=rf"{key} with quantization={quant}: .*not checked"):
        check_config(compose_config([*adapter, f"quantization={quant}"]))
