"""Every shipped preset runs a user's trainer that has only a denoiser, unchanged.

The trainer is tests/assets/dit_trainer.py: a class-conditional DiT named ``denoiser``, with no VAE,
no text encoder and no encode step, so a preset may assume nothing of it beyond the protocol of
runner/trainer.py. The first tests show that the trainer itself is sound (no preset: it trains,
micro-batches exactly, plans, and its plan matches a real step); the preset tests then fail only
where a preset or plugin assumes more than that protocol.

Runs are in-process (compose_config + run, as test_run.py does: no ~15 s of imports per run);
the README's command is run as the CLI it is.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from planner_truth import assert_plan_matches_a_real_cpu_step

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.files import conf_dir
from runner.output.report import read_metrics

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets"
PRESETS = sorted(p.stem for p in (conf_dir() / "preset").glob("*.yaml"))  # a new preset is covered too
DIT = ["trainer=custom", "trainer._target_=dit_trainer.ClassConditionalDiT", "train.device=cpu"]

# One intra-op thread (tests/conftest.py): tiny ops on shared cores run ~100x faster without OpenMP stalls.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _assets_on_path(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ASSETS))  # the trainer lives outside the package, as a user's would
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # anything a preset caches stays in tmp


def train_dit(out: Path, *overrides: str) -> list[dict[str, Any]]:
    """Three optimizer steps of the DiT trainer in-process; the rows of metrics.jsonl."""
    task(compose_config([*DIT, "train.steps=3", "train.progress=false", f"output_dir={out}", *overrides]))
    return read_metrics(out / "metrics.jsonl")


def assert_three_finite_steps(rows: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows), rows


# ---- the trainer on its own ------------------------------------------------------------------------
def test_the_dit_trainer_trains_without_a_preset(tmp_path):
    assert_three_finite_steps(train_dit(tmp_path))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "checkpoints" / "step-00000003" / "trainable.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all(n.startswith("denoiser.") for n in names)  # its one module, by its own name


def test_micro_batches_give_the_losses_of_whole_batches(tmp_path):
    """Noise, timesteps and label drops are drawn per sample, so splitting a batch changes nothing."""
    whole = train_dit(tmp_path / "whole")
    split = train_dit(tmp_path / "split", "train.grad_accum=2")
    assert [r["loss"] for r in split] == pytest.approx([r["loss"] for r in whole], rel=1e-5)


def test_mode_plan_plans_the_dit_trainer_without_a_preset(tmp_path):
    assert task(compose_config([*DIT, "mode=plan", f"output_dir={tmp_path}"])) is None
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["run"]["modules"] == ["denoiser"] and plan["run"]["trained"] == "denoiser"
    from dit_trainer import ClassConditionalDiT

    dit = ClassConditionalDiT(compose_config(DIT)).build_models("meta")["denoiser"]
    stored = sum(t.numel() * 4 for t in [*dit.parameters(), *dit.buffers()])  # float32
    assert plan["by_module"]["denoiser"]["weights"] == stored
    assert plan["by_module"]["denoiser"]["optimizer_state"] == 8 * sum(p.numel() for p in dit.parameters())  # AdamW


# ---- the shipped presets ---------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_every_shipped_preset_trains_the_dit_trainer(tmp_path, preset):
    assert_three_finite_steps(train_dit(tmp_path / "run", f"+preset={preset}"))


@pytest.mark.parametrize("preset", [None, "sdxl_24gb", "constrained"])
def test_planned_peak_of_the_dit_trainer_matches_a_real_cpu_step(preset):
    cfg = compose_config([*DIT, *([f"+preset={preset}"] if preset else [])])
    validate(cfg)
    assert_plan_matches_a_real_cpu_step(cfg)


def test_readme_custom_trainer_command_runs_with_a_preset(tmp_path):
    """The README's "Your own trainer" command, with a preset, as a user types it."""
    command = ["trainer=custom", "trainer._target_=custom_trainer.PixelDiffusionTrainer", "data.resolution=16",
               "+preset=sdxl_24gb", "train.steps=2", "train.device=cpu"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, ["tests/assets", os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "runner", *command, f"output_dir={tmp_path}", "train.progress=false"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2
