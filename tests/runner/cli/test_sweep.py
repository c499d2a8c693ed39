"""Sweeps: a failing job is marked and the sweep goes on; the summary table and CSV list every job."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cli import launch
from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.output import jobs

ROOT = Path(__file__).resolve().parents[3]
ASSETS = ROOT / "tests" / "assets"


def test_multirun_marks_the_oom_job_and_goes_on(tmp_path):
    """One real `python -m runner -m` (one subprocess: ~15 s of imports): three jobs whose trainer
    runs out of memory above 9, 1 and 0 samples per micro-batch: fits, recovers at micro-batch 1,
    gives up (out of memory even at micro-batch 1)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ASSETS), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(
        [sys.executable, "-m", "runner", "-m", "trainer=custom", "trainer._target_=oom_trainer.OOMPixelTrainer",
         "data.resolution=16", "train.batch_size=2", "train.steps=2", "train.progress=false",
         "+trainer.options.oom_above=9,1,0", f"hydra.sweep.dir={tmp_path}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]  # the sweep finished, and says that a job failed
    assert "Traceback" not in r.stderr
    assert "error: Out of memory in step 1 even with micro-batch 1" in r.stderr

    with open(tmp_path / jobs.SWEEP_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(x["job"], x["status"], x["steps_done"], x["micro_batch_size"], x["exit_code"]) for x in rows] == [
        ("0", "ok", "2", "2", "0"), ("1", "ok", "2", "1", "0"), ("2", "oom", "0", "", "3")]
    assert [x["overrides"].split()[-1] for x in rows] == [f"+trainer.options.oom_above={n}" for n in (9, 1, 0)]
    # CPU: the preflight plan's device peak, not the process RSS (kept in its own column). Job 1's trainer
    # runs out of memory above micro-batch 1 in the planner's simulation too, so it starts without a plan
    # and its peak column stays empty rather than showing the RSS.
    planned = rows[0]
    assert float(planned["peak_memory_gb"]) > 0 and planned["peak_memory_gb"] == planned["planned_peak_gb"]
    assert planned["peak_memory_source"] == "planned device peak (preflight plan; CPU run, not measured)"
    assert float(planned["host_rss_peak_gb"]) > float(planned["peak_memory_gb"])
    unplanned = rows[1]
    assert unplanned["peak_memory_gb"] == unplanned["planned_peak_gb"] == unplanned["peak_memory_source"] == ""
    assert float(unplanned["host_rss_peak_gb"]) > 0
    assert "starting without a plan" in (Path(unplanned["dir"]) / "__main__.log").read_text()
    for x in rows[:2]:
        assert float(x["final_loss"]) > 0 and float(x["s_per_step"]) > 0
        assert x["final_loss_steps"] == "1"  # the mean of the last 10% of 2 steps: the last one
        assert (Path(x["dir"]) / "checkpoints" / "step-00000002").is_dir()
        assert (Path(x["dir"]) / "loss.png").is_file()  # every job that trained
    assert (tmp_path / "sweep.png").is_file()
    assert "micro-batch 1" in rows[2]["error"] and "no checkpoint" in rows[2]["error"]

    table = r.stdout[r.stdout.index("sweep: 3 jobs"):]
    assert "sweep: 3 jobs, 2 ok, 0 pruned, 1 not ok" in table
    assert "common overrides: trainer=custom" in table
    lines = table.splitlines()
    job_lines = [ln for ln in lines if ln[:1].isdigit()]
    assert [ln.split()[:3] for ln in job_lines] == [["0", "ok", "+trainer.options.oom_above=9"],
                                                    ["1", "ok", "+trainer.options.oom_above=1"],
                                                    ["2", "oom", "+trainer.options.oom_above=0"]]


# ---- run_job and the collection, in process ----------------------------------------------------------
@pytest.fixture
def in_sweep(monkeypatch):
    monkeypatch.setattr(launch, "_hydra_job", lambda: (True, 4, ["train.steps=1", "data.path=/x"]))


def _raise(error: BaseException):
    def task(cfg):
        raise error
    return task


def test_a_failing_job_in_a_sweep_returns_and_is_recorded(tmp_path, in_sweep, capsys):
    cfg = compose_config([f"output_dir={tmp_path}"])
    assert launch.run_job(_raise(UserError("data.path='/x' does not exist.")), cfg) is None
    summary = json.loads((tmp_path / jobs.JOB_SUMMARY).read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == 2 and summary["job"] == 4
    assert summary["overrides"] == ["train.steps=1", "data.path=/x"] and "does not exist" in summary["error"]
    assert "error: data.path='/x' does not exist." in capsys.readouterr().err
    # A bug in a job: recorded with its type, logged with its traceback, the sweep goes on.
    assert launch.run_job(_raise(KeyError("oops")), cfg) is None
    assert json.loads((tmp_path / jobs.JOB_SUMMARY).read_text())["error"] == "KeyError: 'oops'"
    # An interrupt (run() exits 128 + signal) stops the sweep.
    with pytest.raises(SystemExit):
        launch.run_job(_raise(SystemExit(130)), cfg)
    assert json.loads((tmp_path / jobs.JOB_SUMMARY).read_text())["status"] == "interrupted"


def test_a_single_run_still_exits_nonzero_and_keeps_a_bugs_traceback(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "_hydra_job", lambda: (False, None, []))
    cfg = compose_config([f"output_dir={tmp_path}"])
    with pytest.raises(SystemExit) as e:
        launch.run_job(_raise(UserError("bad value")), cfg)
    assert e.value.code == 2
    with pytest.raises(KeyError):
        launch.run_job(_raise(KeyError("oops")), cfg)
    assert json.loads((tmp_path / jobs.JOB_SUMMARY).read_text())["status"] == "failed"


def test_collect_lists_a_job_killed_without_a_summary(tmp_path):
    ok = tmp_path / "0_a=1"
    ok.mkdir()
    (ok / jobs.JOB_SUMMARY).write_text(json.dumps({"job": 0, "status": "ok", "overrides": ["a=1"], "steps_done": 2,
                                                    "final_loss": 0.5, "s_per_step": 0.1, "dir": str(ok)}))
    killed = tmp_path / "1_a=2"
    (killed / ".hydra").mkdir(parents=True)
    (killed / ".hydra" / "overrides.yaml").write_text("- a=2\n")
    (tmp_path / "not_a_job").mkdir()
    rows = jobs.collect(tmp_path)
    assert [(r["job"], r["status"], r["overrides"]) for r in rows] == [(0, "ok", ["a=1"]), (1, "unknown", ["a=2"])]
    jobs.write_csv(rows, tmp_path / "s.csv")
    assert (tmp_path / "s.csv").read_text().splitlines()[0] == ",".join(jobs.COLUMNS)
    table = jobs.format_table(rows)
    assert "unknown" in table and "no job_summary.json" in table
