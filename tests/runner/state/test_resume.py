"""Resume is strict: the checkpoint's command line is the base, and what was trained cannot change.

Checkpoints store the run's command line and composed config (config.yaml) and a description of
the trained state (trained.json). A resume recomposes from the saved command line plus the new
one, refuses changes to the trainer, model, LoRA settings, optimizer kind, quantization or preset
(listing each) before anything is built, compares shapes before loading, and continues one
metrics curve.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.output.report import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[3]
COMMON = ["train.device=cpu", "train.progress=false", "train.preflight=false", "data.demo_size=4"]


def train(out: Path, *overrides: str) -> list[dict]:
    task(compose_config([f"output_dir={out}", *COMMON, *overrides]))
    return read_metrics(out / "metrics.jsonl")


def ckpt(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora")
    train(out, "model.train=lora", "train.steps=2")
    return out


def test_a_checkpoint_holds_its_command_line_config_and_trained_state(lora_run):
    c = ckpt(lora_run, 2)
    from omegaconf import OmegaConf

    saved = OmegaConf.load(c / "config.yaml")
    assert saved.config.model.train == "lora" and saved.config.model.lora_rank == 4
    described = json.loads((c / "trained.json").read_text())
    assert described["optimizer"]["name"] == "adamw"
    shapes = {n: d["shape"] for n, d in described["parameters"].items()}
    assert any(".lora_A." in n and s[0] == 4 for n, s in shapes.items())
    assert set(described["optimizer"]["state"]["0"]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("change, listed", [
    ("model.lora_rank=8", "model.lora_rank: 4 -> 8"),
    ("model.lora_dora=true", "model.lora_dora: False -> True"),
    ("optimizer=adafactor", "optimizer.name: 'adamw' -> 'adafactor'"),
    ("quantization=nf4", "quantization: [] -> ['nf4']"),
    ("model.train=full", "model.train: 'lora' -> 'full'"),
    ("+preset=constrained", "preset: None -> 'constrained'"),
])
def test_a_change_to_what_was_trained_is_refused_before_anything_is_built(lora_run, tmp_path, change, listed):
    out = tmp_path / "resumed"
    with pytest.raises(UserError) as e:
        train(out, "model.train=lora", "train.steps=3", f"train.resume={lora_run}", change)
    assert listed in str(e.value) and "this run would change what the checkpoint trained" in str(e.value)
    assert not out.exists()  # refused before the output folder, the plan or any model


def test_a_shape_mismatch_is_refused_before_loading_even_without_a_saved_config(lora_run, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(ckpt(lora_run, 2), old)
    (old / "config.yaml").unlink()  # a checkpoint of the earlier format: only the weights tell
    (old / "trained.json").unlink()
    with pytest.raises(UserError, match="have another shape") as e:
        train(tmp_path / "r", "model.train=lora", "model.lora_rank=8", "train.steps=3", f"train.resume={old}")
    assert "lora_A" in str(e.value) and "(4, " in str(e.value)


def test_an_old_format_checkpoint_still_resumes_exactly(lora_run, tmp_path):
    full = train(tmp_path / "full", "model.train=lora", "train.steps=3")
    old = tmp_path / "old"
    shutil.copytree(ckpt(lora_run, 2), old)
    (old / "config.yaml").unlink()
    (old / "trained.json").unlink()
    rows = train(tmp_path / "r", "model.train=lora", "train.steps=3", f"train.resume={old}")
    assert [r["loss"] for r in rows] == [full[2]["loss"]]


ADAPTERS = {  # command line -> a tensor name only that adapter trains
    "dora": (("model.train=lora", "model.lora_dora=true"), "lora_magnitude_vector"),
    "lokr": (("model.train=lokr",), "lokr_w1"),
    "loha": (("model.train=loha",), "hada_w2_b"),
}


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_an_adapter_run_resumes_bit_for_bit(tmp_path, adapter):
    """4 steps straight vs 2 saved + 2 resumed give the same losses and the same final adapter
    weights (DoRA magnitudes, LoKr and LoHa factors), bit for bit."""
    from safetensors.torch import load_file

    overrides, marker = ADAPTERS[adapter]
    run = (*overrides, "optimizer.lr=0.01", "train.save_every=2", "train.steps=4")
    full = train(tmp_path / "full", *run)
    rows = train(tmp_path / "r", *run, f"train.resume={ckpt(tmp_path / 'full', 2)}")
    assert [r["step"] for r in rows] == [3, 4]
    assert [r["loss"] for r in rows] == [r["loss"] for r in full[2:]]
    a, b = (load_file(ckpt(tmp_path / o, 4) / "trainable.safetensors") for o in ("full", "r"))
    assert a.keys() == b.keys() and any(marker in k for k in a)
    assert not [k for k in a if not torch.equal(a[k], b[k])]


def test_resuming_from_an_older_checkpoint_continues_one_metrics_curve(tmp_path):
    out = tmp_path / "run"
    first = train(out, "train.steps=4", "train.save_every=1", "train.keep_saved=4")
    rows = train(out, "train.steps=4", "train.save_every=1", "train.keep_saved=4", f"train.resume={ckpt(out, 2)}")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # steps 3 and 4 once, from the resumed run
    assert [r["loss"] for r in rows] == [r["loss"] for r in first]


def test_resume_from_the_command_line_needs_no_preset_and_may_change_steps(tmp_path):
    """The saved command line is the base: an adamw8bit preset run resumes with only train.resume."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "runner", *COMMON, *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)

    base = ["+preset=sdxl_24gb", "train.save_every=2", "train.device=cpu"]
    full = cli(*base, "train.steps=5", f"output_dir={tmp_path / 'full'}")
    assert full.returncode == 0, full.stderr[-2000:]
    short = cli(*base, "train.steps=3", f"output_dir={tmp_path / 'a'}")
    assert short.returncode == 0, short.stderr[-2000:]
    r = cli(f"train.resume={tmp_path / 'a'}", "train.steps=5", f"output_dir={tmp_path / 'b'}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "changed (saved -> now): train.steps: 3 -> 5" in r.stdout + r.stderr
    expected = [row["loss"] for row in read_metrics(tmp_path / "full" / "metrics.jsonl")][3:]  # resumed from step 3
    assert [row["loss"] for row in read_metrics(tmp_path / "b" / "metrics.jsonl")] == expected
    bad = cli(f"train.resume={tmp_path / 'a'}", "optimizer=adamw", f"output_dir={tmp_path / 'c'}")
    assert bad.returncode == 2 and "optimizer.name: 'adamw8bit' -> 'adamw'" in bad.stderr
    assert "Traceback" not in bad.stdout + bad.stderr


def test_a_resume_trains_with_the_configured_learning_rate(tmp_path):
    """optimizer.lr changed on resume (the advice after a divergence) is the rate the resumed steps use,
    on the same schedule: the saved optimizer and scheduler no longer keep the old one. As typed on
    the command line, so that the resume composes on the checkpoint's saved command line."""
    from bad_input import run_main

    def cli(name: str, *overrides: str) -> list[dict]:
        r = run_main([*COMMON, f"output_dir={tmp_path / name}", f"hydra.run.dir={tmp_path / 'h' / name}", *overrides])
        assert r.code == 0, r.err
        return read_metrics(tmp_path / name / "metrics.jsonl")

    first = cli("run", "train.steps=2", "optimizer.lr=1e-3", "train.lr_scheduler=linear", "train.lr_warmup_steps=0")
    resumed = f"train.resume={ckpt(tmp_path / 'run', 2)}"
    same = cli("same", resumed, "train.steps=4")
    lower = cli("lower", resumed, "train.steps=4", "optimizer.lr=5e-4")
    assert [r["step"] for r in same] == [r["step"] for r in lower] == [3, 4]
    # linear decay over the 2 steps first planned, continued: the same factor at each step, half the base
    assert [r["lr"] for r in lower] == pytest.approx([r["lr"] / 2 for r in same], rel=1e-12)
    assert len(first) == 2 and same[0]["lr"] > 0 and lower[0]["lr"] > 0
