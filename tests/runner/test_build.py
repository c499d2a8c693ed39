"""End-to-end runs of the tiny SDXL model on CPU: outputs, loss, checkpoints, resume, signals."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.output.report import read_metrics

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets"


def run_cfg(tmp: Path, *overrides: str):
    cfg = compose_config([f"output_dir={tmp}", "train.progress=false", *overrides])
    return task(cfg), read_metrics(tmp / "metrics.jsonl")


def cli(*args: str, cwd: Path = ROOT, env_extra: dict | None = None, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600, **kw)


def test_preset_run_writes_outputs_and_loss_goes_down(tmp_path):
    _, rows = run_cfg(tmp_path, "+preset=sdxl_24gb", "train.steps=24", "optimizer.lr=1e-3")
    assert [r["step"] for r in rows] == list(range(1, 25))
    losses = [r["loss"] for r in rows]
    assert sum(losses[-6:]) / 6 < 0.8 * (sum(losses[:6]) / 6), losses
    for key in ("lr", "s_per_step", "memory_in_use_gb", "samples_seen"):
        assert key in rows[0]
    assert (tmp_path / "resolved_config.yaml").read_text().count("sdxl_24gb") >= 1
    assert "diffusers" in json.loads((tmp_path / "versions.json").read_text())
    ckpt = tmp_path / "checkpoints" / "step-00000024"
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(
        ["trainable.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "state.json", "config.yaml", "trained.json",
         "export"])
    # a full fine-tune whose text encoders park dropped: the pipeline folder is rebuilt (runner/export/)
    assert (ckpt / "export" / "diffusers" / "model_index.json").is_file()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == ckpt.name
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    # Every file and folder as open()/mkdir would make it (0644/0755 under umask 022), the
    # safetensors files written through temporary files included (runner/files.py).
    from runner.files import current_umask

    umask = current_umask()
    wrong = [(str(p.relative_to(tmp_path)), oct(p.stat().st_mode & 0o777)) for p in tmp_path.rglob("*")
             if p.stat().st_mode & 0o777 != (0o777 if p.is_dir() else 0o666) & ~umask]
    assert not wrong, wrong


def test_interrupt_then_resume_gives_the_same_losses(tmp_path):
    common = ["train.steps=6", "train.grad_accum=2", "train.progress=false", "train.save_every=100"]
    _, full = run_cfg(tmp_path / "full", *common)

    # Interrupt a real CLI run with SIGTERM after its second step is logged.
    part = tmp_path / "part"
    proc = subprocess.Popen([sys.executable, "-m", "runner", f"output_dir={part}", *common], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = part / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    done = len(read_metrics(metrics))
    assert 2 <= done < 6, "the run must stop early, after the step in flight"
    assert (part / "checkpoints" / f"step-{done:08d}" / "state.json").is_file()

    _, resumed = run_cfg(tmp_path / "resumed", *common, f"train.resume={part}")
    assert [r["step"] for r in resumed] == list(range(done + 1, 7))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[done:]]


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    run_cfg(tmp_path / "a", "train.steps=2")
    ckpt = tmp_path / "a" / "checkpoints" / "step-00000002"
    (ckpt / "trainable.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError) as e:
        run_cfg(tmp_path / "b", "train.steps=3", f"train.resume={tmp_path / 'a'}")
    assert "trainable.safetensors" in str(e.value) and "corrupt" in str(e.value)
    run_cfg(tmp_path / "d", "train.steps=2")
    ckpt = tmp_path / "d" / "checkpoints" / "step-00000002"
    (ckpt / "optimizer.pt").unlink()
    with pytest.raises(UserError, match="optimizer.pt"):
        run_cfg(tmp_path / "c", "train.steps=3", f"train.resume={ckpt}")


def test_custom_trainer_from_outside_the_package(tmp_path):
    overrides = ["trainer=custom", "trainer._target_=custom_trainer.PixelDiffusionTrainer", "train.steps=3",
                 "data.resolution=16", "+preset=constrained",
                 # LoRA over the nf4 base: this U-Net has no attention, so target its Linear and conv layers.
                 "model.lora_targets=[time_emb_proj,conv1,conv2]",
                 # The asset trainer has no cacheable encode split, so park only parks (test_park.py shows the error otherwise).
                 "offload.park.cache_latents=false", "offload.park.cache_text=false"]
    sys.path.insert(0, str(ASSETS))
    try:
        _, rows = run_cfg(tmp_path, *overrides)
    finally:
        sys.path.remove(str(ASSETS))
    assert len(rows) == 3 and all(r["loss"] > 0 for r in rows)


def test_bad_trainer_target_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no_such_module.Trainer"):
        run_cfg(tmp_path, "trainer=custom", "trainer._target_=no_such_module.Trainer")


def test_missing_data_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="data.path"):
        run_cfg(tmp_path, f"data.path={tmp_path / 'nope'}", "train.steps=1")


@pytest.mark.parametrize("preset", ["sdxl_24gb", "flux_24gb", "constrained",
                                    pytest.param("flux_24gb_full", marks=pytest.mark.slow)])
def test_every_preset_trains_the_tiny_model_end_to_end(tmp_path, preset):
    _, rows = run_cfg(tmp_path / "run", f"+preset={preset}", "train.steps=3",
                      f"offload.park.cache_dir={tmp_path / 'cache'}")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in rows)  # finite, positive
