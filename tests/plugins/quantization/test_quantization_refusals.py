"""quantization=nf4|int8|fp8 settings refused before anything is built (the precision conflicts, bad keys), a
fully trained module refused at setup, and the valid combinations accepted."""
from __future__ import annotations

import pytest

from runner.checks import validate
from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.parts import build_plugins, build_trainer, make_context, prepare_models
from runner.resolved import resolve


# ---- validation ---------------------------------------------------------------------------------
# The precision conflicts exist where autocast runs: a run for CUDA (mode=plan plans one from this
# CPU-only machine). A CPU run trains in float32 without autocast (runner/resolved.py), so there the
# same settings are no conflict.
@pytest.mark.parametrize("overrides,keys", [
    (["quantization=nf4", "model.train=lora", "quantization.nf4.compute_dtype=float16", "train.mixed_precision=bf16",
      "mode=plan"],
     ["quantization.nf4.compute_dtype=float16", "train.mixed_precision=bf16"]),
    (["quantization=fp8", "model.train=lora", "quantization.fp8.compute_dtype=bfloat16", "train.mixed_precision=fp16",
      "mode=plan"],
     ["quantization.fp8.compute_dtype=bfloat16", "train.mixed_precision=fp16"]),
    (["quantization=nf4", "model.train=lora", "model.dtype=float16", "train.mixed_precision=bf16", "mode=plan"],
     ["model.dtype=float16", "train.mixed_precision=bf16", "quantization.nf4.compute_dtype=bfloat16"]),
    (["quantization=int8", "quantization.int8.skip=['attn(']"], ["quantization.int8.skip[0]"]),
    (["quantization=fp8", "quantization.fp8.storage_dtype=float8"], ["quantization.fp8.storage_dtype", "float8_e4m3fn"]),
    (["quantization=nf4", "quantization.nf4.compute_dtype=float64"], ["quantization.nf4.compute_dtype", "bfloat16"]),
    (["quantization=int8", "quantization.int8.threshold=-1"], ["quantization.int8.threshold"]),
])
def test_conflicts_are_user_errors(overrides, keys):
    with pytest.raises(UserError) as e:
        validate(compose_config(overrides))
    for key in keys:
        assert key in str(e.value)


# Quantizing a fully trained module is refused when transform_models finds its trained Linear layers
# (the config alone cannot know which modules a trainer trains): validation passes, setup stops.
@pytest.mark.parametrize("overrides,keys", [
    (["quantization=nf4", "quantization.nf4.modules=[unet]"], ["quantization.nf4.modules", "'unet'", "model.train=lora"]),
    (["quantization=fp8", "trainer=flux", "quantization.fp8.modules=[transformer, text_encoder]"],
     ["quantization.fp8.modules", "'transformer'", "model.train=lora"]),
], ids=["nf4-unet", "fp8-flux-transformer"])
def test_quantizing_a_fully_trained_module_is_refused(overrides, keys):
    cfg = compose_config([*overrides, "train.device=cpu"])
    validate(cfg)
    run = resolve(cfg)
    assert run.train_mode == "full"
    trainer = build_trainer(cfg, run)
    ctx = make_context(cfg, run, build_plugins(cfg, run), None)
    ctx.models = prepare_models(trainer.build_models("cpu"), cfg.model, run)
    try:
        with pytest.raises(UserError) as e:
            ctx.apply_setup_phases()
    finally:
        ctx.teardown()
    for key in keys:
        assert key in str(e.value)
    assert not ctx.facts.quantized  # refused before any layer was replaced


def test_valid_combinations_pass_validation():
    for overrides in (["quantization=nf4", "model.train=lora", "quantization.nf4.modules=[unet]"],
                      ["quantization=nf4"],  # full fine-tune: only the frozen encoders are quantized
                      ["quantization=int8", "model.train=lora", "quantization.int8.skip=[]"],
                      ["quantization=int8", "model.train=lora", "model.dtype=float16", "train.mixed_precision=bf16"],
                      ["quantization=nf4", "model.train=lora", "model.dtype=float16", "train.mixed_precision=bf16",
                       "quantization.nf4.compute_dtype=float32"],
                      ["quantization=fp8", "trainer=flux", "model.train=lora", "quantization.fp8.compute_dtype=bfloat16",
                       "train.mixed_precision=bf16"]):
        validate(compose_config(overrides))  # a run on this machine (CPU)
        validate(compose_config([*overrides, "mode=plan"]))  # planned for CUDA, where autocast applies
