"""train.compile=true: the repeated blocks compiled (inductor's C++ backend on the CPU) train as eager does.

Whole runs of the tiny Flux transformer (two block classes, so two graphs), LoRA with block
checkpointing, with offload=stream, with activation offload and on an nf4 base: the losses and the trained weights equal the eager run's
within float tolerance (a compiled kernel may fuse and reorder float operations, so not bit for
bit). The first run of a test session compiles (tens of seconds here); later ones hit inductor's
on-disk cache.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.compile.regional import KIND, NoCompile, RegionalCompile, build_compiler
from runner.checks import validate
from runner.errors import UserError
from runner.output.report import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = ["trainer=flux", "model.train=lora", "train.device=cpu", "train.progress=false", "train.steps=2",
          "export.enabled=false"]


def train(out: Path, *overrides: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    task(compose_config([f"output_dir={out}", *COMMON, *overrides]))
    rows = read_metrics(out / "metrics.jsonl")
    weights = load_file(str(out / "checkpoints" / f"step-{rows[-1]['step']:08d}" / "trainable.safetensors"))
    return [r["loss"] for r in rows], weights


def assert_close(eager: tuple, compiled: tuple) -> None:
    assert compiled[0] == pytest.approx(eager[0], rel=1e-5, abs=1e-6)
    assert eager[1].keys() == compiled[1].keys()
    moved = 0
    for k, w in eager[1].items():
        torch.testing.assert_close(compiled[1][k], w, rtol=1e-4, atol=1e-6)
        moved += int(not torch.equal(w, torch.zeros_like(w)))
    assert moved  # the adapters trained: the comparison is not of untouched zeros


@pytest.mark.parametrize("plugins", [["checkpoint=blocks"], ["offload=stream", "offload.stream.device_fraction=0.9", "offload.stream.prefetch=0"],
                                     ["offload=activations"], ["quantization=[nf4]", "checkpoint=blocks"]],
                         ids=["checkpoint", "stream", "activations", "nf4"])
def test_compiled_blocks_train_like_eager(tmp_path, plugins, caplog) -> None:
    eager = train(tmp_path / "eager", *plugins)
    with caplog.at_level("INFO", logger="runner"):
        compiled = train(tmp_path / "compiled", *plugins, "train.compile=true")
    assert_close(eager, compiled)
    logged = caplog.text
    assert "compile: transformer: 3 blocks (FluxSingleTransformerBlock, FluxTransformerBlock)" in logged
    assert "FluxTransformerBlock compiled in" in logged and "FluxSingleTransformerBlock compiled in" in logged


def test_teardown_restores_each_blocks_forward(tmp_path) -> None:
    from runner_setup import prepared_context

    ctx = prepared_context(tmp_path, *COMMON, "checkpoint=blocks", "train.compile=true")
    assert isinstance(ctx.compiler, RegionalCompile)
    before = {id(m): m.__dict__.get("forward") for m in ctx.models["transformer"].modules()}
    ctx.apply_setup_phases()
    compiled = [e.module() for e in ctx.hooks.entries(KIND)]
    assert len(compiled) == 3 and ctx.facts.compiled == {"transformer": 3}
    ctx.teardown()
    assert {id(m): m.__dict__.get("forward") for m in ctx.models["transformer"].modules()} == before


def test_off_by_default_and_never_in_the_planner() -> None:
    cfg = compose_config([])
    assert isinstance(build_compiler(cfg.train), NoCompile)
    from runner.parts import idle_parts
    from runner.resolved import resolve

    assert isinstance(idle_parts(resolve(cfg))["compiler"], NoCompile)  # what the planner's context gets


@pytest.mark.parametrize(("overrides", "names"), [
    (["train.compile_mode=reduce-overhead"], ["train.compile_mode", "CUDA graphs", "max-autotune-no-cudagraphs"]),
    (["train.compile_mode=fast"], ["train.compile_mode='fast'", "default"]),
    (["train.compile=true", "dist=fsdp"], ["train.compile=true", "dist=fsdp", "dist=ddp"]),
])
def test_what_it_cannot_do_is_refused_naming_the_key(overrides, names) -> None:
    with pytest.raises(UserError) as e:
        validate(compose_config(overrides))
    assert all(n in str(e.value) for n in names), str(e.value)
