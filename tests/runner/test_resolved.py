"""The run is decided once (runner/resolved.py), so a CPU run and a CPU plan agree to the byte."""
from __future__ import annotations

import json

import pytest
import torch

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.resolved import GiB, resolve

PRESETS = ("sdxl_24gb", "flux_24gb", "constrained", "flux_24gb_full")


def test_cpu_target_trains_in_float32_unless_asked():
    cfg = compose_config(["+preset=sdxl_24gb", "train.device=cpu"])
    cpu = resolve(cfg)
    assert (cpu.target, cpu.precision, cpu.train_dtype) == ("cpu", "no", torch.float32)
    assert cpu.frozen_dtype == torch.float32 and cpu.budget_bytes == 24 * GiB
    gpu = resolve(cfg, target="cuda", device=torch.device("meta"))
    assert (gpu.precision, gpu.train_dtype) == ("bf16", torch.bfloat16)
    kept = resolve(compose_config(["+preset=sdxl_24gb", "train.device=cpu", "train.cpu_autocast=true"]))
    assert (kept.precision, kept.train_dtype) == ("bf16", torch.bfloat16)
    sim = gpu.simulated()
    assert sim.simulate and sim.device.type == "meta" and sim.target == "cuda" and sim.micro_batch == 2


def _plan(path):
    p = json.loads((path / "plan.json").read_text())
    return {k: p[k] for k in ("peak_bytes", "by_category", "host_peak_bytes", "host_pinned_bytes", "peak_phase")}


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [[f"+preset={p}"] for p in PRESETS] + [["offload=activations"]],
                         ids=[*PRESETS, "offload=activations"])
def test_cpu_run_preflight_and_cpu_plan_are_the_same_plan(tmp_path, overrides, one_thread):
    common = [*overrides, "train.device=cpu", "train.progress=false"]
    if any("preset" in o for o in overrides):
        common.append(f"offload.park.cache_dir={tmp_path / 'cache'}")
    task(compose_config([*common, f"output_dir={tmp_path / 'run'}", "train.steps=1"]))
    task(compose_config([*common, f"output_dir={tmp_path / 'plan'}", "mode=plan"]))
    assert _plan(tmp_path / "run") == _plan(tmp_path / "plan")
