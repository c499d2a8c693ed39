"""``hydra/sweeper=optuna`` end to end (two ``python -m runner -m`` processes, one tiny LoRA trial each): a pruned
trial keeps its checkpoint and is ``pruned`` in the study and the summary; a killed sweep, run again with the same
folder and a larger ``n_trials``, continues the study (a trial left running by hand, and a sweep process really
killed); a grid sweep's ``sweep.stop_if`` stops a diverging job; a rank sweep with ``train.auto_fit`` reports the
rank that cannot fit as ``does_not_fit`` and runs the other."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

optuna = pytest.importorskip("optuna")

TINY = ["model.train=lora", "train.steps=4", "train.progress=false", "data.val_fraction=0.25", "val.every=2",
        "sweep.objective=val_loss", "hydra.sweeper.sampler.seed=0"]


def _sweep(tmp_path, *overrides):
    r = subprocess.run([sys.executable, "-m", "runner", "-m", "hydra/sweeper=optuna", f"hydra.sweep.dir={tmp_path}",
                        *TINY, *overrides], check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _study(tmp_path):
    return optuna.load_study(study_name="runner", storage=f"sqlite:///{tmp_path}/optuna.db")


def test_a_pruned_trial_and_a_killed_sweep_that_continues(tmp_path):
    # A pruner that stops every trial whose held-out loss is above 0: trial 0 stops at its first validation.
    _sweep(tmp_path, "hydra.sweeper.n_trials=1", "optimizer.lr=tag(log,interval(1e-5,1e-3))",
           "hydra.sweeper.pruner._target_=optuna.pruners.ThresholdPruner", "~hydra.sweeper.pruner.n_startup_trials",
           "+hydra.sweeper.pruner.upper=0.0")
    trial = _study(tmp_path).trials[0]
    assert trial.state == optuna.trial.TrialState.PRUNED and list(trial.intermediate_values) == [2]
    (job,) = [d for d in tmp_path.iterdir() if d.name.startswith("0_")]
    summary = json.loads((job / "job_summary.json").read_text())
    assert summary["status"] == "pruned" and summary["steps_done"] == 2 and "pruner stopped trial 0" in summary["error"]
    assert (job / "checkpoints" / "step-00000002").is_dir()  # the last checkpoint is kept
    # The sweep is killed while trial 1 runs: the study holds it RUNNING.
    _study(tmp_path).ask()
    r = _sweep(tmp_path, "hydra.sweeper.n_trials=2", "optimizer.lr=tag(log,interval(1e-5,1e-3))",
               "hydra.sweeper.pruner=null")
    study = _study(tmp_path)
    states = [t.state.name for t in study.trials]
    assert states == ["PRUNED", "FAIL", "COMPLETE"]  # the killed trial failed; one more trial reached n_trials=2
    assert study.trials[1].user_attrs == {"runner_killed": True}
    assert "1 of 2 trials done, 1 to run" in r.stdout
    with open(tmp_path / "sweep_summary.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [(row["job"], row["status"]) for row in rows] == [("0", "pruned"), ("2", "ok")]
    assert float(rows[1]["val_loss"]) == pytest.approx(study.trials[2].value)
    assert "best by val_loss (minimize):\n  job 2: val_loss=" in r.stdout
    assert "python -m runner " in r.stdout and "optimizer.lr=" in r.stdout


def test_a_grid_sweeps_stop_if_stops_the_diverging_job(tmp_path):
    """lr=1e3 blows the tiny U-Net up at its first step (a full fine-tune: a tiny model's LoRA barely moves the
    loss): its held-out loss at step 1 is far above 3 x job 0's, or not finite."""
    r = subprocess.run([sys.executable, "-m", "runner", "-m", "train.steps=3", "train.progress=false",
                        "data.val_fraction=0.25", "val.every=1", "sweep.stop_if=3", "optimizer.lr=1e-4,1e3",
                        "train.max_weight_growth=0",  # the weight check would stop it first (nonfinite): the sweep's stop here
                        f"hydra.sweep.dir={tmp_path}"], check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]  # a pruned job is not a failure
    with open(tmp_path / "sweep_summary.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [(row["status"], row["steps_done"]) for row in rows] == [("ok", "3"), ("pruned", "1")]
    assert "sweep.stop_if=3: val_loss" in rows[1]["error"] or "is nan" in rows[1]["error"] or "is inf" in rows[1]["error"]
    assert (tmp_path / "1_lr=1000.0" / "checkpoints" / "step-00000001").is_dir()
    assert "sweep: 2 jobs, 1 ok, 1 pruned, 0 not ok" in r.stdout


def test_a_trial_with_a_learning_rate_100x_too_high_is_pruned(tmp_path):
    """TPE with seed 6 draws lr 1e-2, 1e-2, then 1 (its first trials are random draws: the order depends only on
    the seed and the number of choices). 1e-2 is the tiny U-Net's good rate for a full fine-tune (held-out loss
    1.09 -> 0.58 at step 2, where 1e-4 hardly moves it); at 1, 100x that, its held-out loss at step 2 is in the
    hundreds (or not finite), far above the median of the two trials before: Optuna's MedianPruner stops it there,
    the others complete."""
    r = subprocess.run([sys.executable, "-m", "runner", "-m", "hydra/sweeper=optuna", f"hydra.sweep.dir={tmp_path}",
                        "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=6", "optimizer.lr=choice(1e-2,1)",
                        "train.steps=4", "val.every=2", "data.val_fraction=0.25", "sweep.objective=val_loss",
                        "train.progress=false", "train.max_weight_growth=0"],  # see the grid test: the pruner acts
                       check=False, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    study = _study(tmp_path)
    assert [(t.params["optimizer.lr"], t.state.name) for t in study.trials] == [
        (1e-2, "COMPLETE"), (1e-2, "COMPLETE"), (1, "PRUNED")]
    summary = json.loads(next(tmp_path.glob("2_*/job_summary.json")).read_text())
    assert summary["status"] == "pruned" and summary["steps_done"] == 2
    assert "sweep: 3 jobs, 2 ok, 1 pruned, 0 not ok" in r.stdout


def test_a_killed_sweep_process_run_again_continues_its_study(tmp_path):
    """The sweep process is SIGKILLed while trial 1 runs; the same command again fails that trial (its job
    ``killed`` in the table, not a failure of the sweep), runs the missing trial with a new draw (the seeded
    sampler does not repeat the first run's), and exits 0."""
    cmd = [sys.executable, "-m", "runner", "-m", "hydra/sweeper=optuna", f"hydra.sweep.dir={tmp_path}", *TINY,
           "hydra.sweeper.n_trials=2", "optimizer.lr=tag(log,interval(1e-5,1e-3))", "hydra.sweeper.pruner=null"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while not list(tmp_path.glob("1_*")) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)  # trial 1's job has started (its folder is there); trial 0 is done
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert [t.state.name for t in _study(tmp_path).trials] == ["COMPLETE", "RUNNING"]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    study = _study(tmp_path)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert study.trials[1].user_attrs["runner_killed"] is True
    assert "1 of 2 trials done, 1 to run" in r.stdout
    first, resumed = [t.params["optimizer.lr"] for t in study.trials[:2]], [t.params["optimizer.lr"] for t in study.trials[2:]]
    assert not set(first) & set(resumed)  # reseeded: not the first run's draws again
    with open(tmp_path / "sweep_summary.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [(row["job"], row["status"]) for row in rows] == [("0", "ok"), ("1", "killed"), ("2", "ok")]
    assert "sweep: 3 jobs, 2 ok, 0 pruned, 1 killed and replaced, 0 not ok" in r.stdout


def test_a_rank_sweep_with_auto_fit_reports_the_rank_that_cannot_fit_and_runs_the_other(tmp_path):
    """budget_gb=0.136 (139.3 MiB): the tiny LoRA's fit search finds a plan for rank 4 (136.5 MiB at its smallest)
    and none for rank 64 (141.7 MiB at its smallest). Rank 64 goes first: it is does_not_fit, and rank 4 still
    trains its step."""
    r = subprocess.run([sys.executable, "-m", "runner", "-m", "train.auto_fit=true", "budget_gb=0.136", "train.steps=1",
                        "model.train=lora", "model.lora_rank=64,4", "train.progress=false", f"hydra.sweep.dir={tmp_path}"],
                       check=False, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(tmp_path / "sweep_summary.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [(row["overrides"].split()[-2], row["status"], row["steps_done"]) for row in rows] == [
        ("model.lora_rank=64", "does_not_fit", "0"), ("model.lora_rank=4", "ok", "1")]
    assert "No configuration fits budget" in rows[0]["error"] and "The smallest:" in rows[0]["error"]
    assert not list(tmp_path.glob("0_*/checkpoints")) and list(tmp_path.glob("1_*/checkpoints"))  # 64 never ran
    assert "sweep: 2 jobs, 1 ok, 0 pruned, 1 do not fit, 0 not ok" in r.stdout
