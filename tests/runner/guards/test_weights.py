"""A step whose update blows the weights up stops the run as non-finite (``train.max_weight_growth``,
runner/guards/weights.py): nothing is saved, and the stop names the last checkpoint whose weights are
sane, or says there is none. Resuming as advised trains."""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.cli.launch import run_job
from runner.checks import validate
from runner.errors import UserError
from runner.guards.weights import WeightGuard, WeightsBlewUp, weight_rms

pytestmark = pytest.mark.usefixtures("one_thread")

ASSETS = Path(__file__).resolve().parents[2] / "assets"
DIT = ["trainer=custom", "trainer._target_=dit_trainer.ClassConditionalDiT", "train.device=cpu",
       "train.progress=false", "train.preflight=false", "sample.every=0", "export.enabled=false"]


def job(out: Path, *overrides: str) -> int:
    sys.path.insert(0, str(ASSETS))
    try:
        run_job(task, compose_config([f"output_dir={out}", *DIT, *overrides]))
        return 0
    except SystemExit as e:
        return int(e.code)
    finally:
        sys.path.remove(str(ASSETS))


def advised(err: str) -> str | None:
    found = re.search(r"train\.resume=(\S+?)\.?(\s|$)", err)
    return found.group(1) if found else None


def test_lr_1e30_stops_at_the_step_that_blew_up_and_advises_no_blown_checkpoint(tmp_path, capsys):
    code = job(tmp_path, "optimizer.lr=1e30", "train.steps=4", "train.save_every=1")
    err = capsys.readouterr().err
    assert code == 4, err
    assert "step 1" in err and "train.max_weight_growth=10" in err and "Traceback" not in err
    assert "No checkpoint with sane weights" in err and advised(err) is None
    assert not list((tmp_path / "checkpoints").glob("step-*"))  # the blown weights were not saved
    assert json.loads((tmp_path / "job_summary.json").read_text())["status"] == "nonfinite"


def test_the_stop_names_the_last_sane_checkpoint_and_resuming_as_advised_trains(tmp_path, capsys):
    assert job(tmp_path / "a", "train.steps=2") == 0
    good = tmp_path / "a" / "checkpoints" / "step-00000002"
    code = job(tmp_path / "b", f"train.resume={good}", "optimizer.lr=1e30", "train.steps=4", "train.save_every=1")
    err = capsys.readouterr().err
    assert code == 4 and "step 3" in err, err
    assert advised(err) == str(good)  # the checkpoint it resumed from: the last one that passed
    assert not list((tmp_path / "b" / "checkpoints").glob("step-*"))
    assert job(tmp_path / "c", f"train.resume={advised(err)}", "optimizer.lr=1e-4", "train.steps=4") == 0
    rows = [json.loads(line) for line in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 4] and all(math.isfinite(r["loss"]) for r in rows)
    assert all(0 < r["weight_rms"] < 1 for r in rows)  # logged each step


def test_the_growth_is_measured_from_a_floor_and_off_at_zero():
    w = torch.nn.Parameter(torch.zeros(100))  # zero-initialised weights (an adapter's) may grow from nothing
    guard = WeightGuard(10.0, [w], torch.device("cpu"))
    guard.start(None, 0)
    with torch.no_grad():
        w.add_(0.05)  # RMS 0.05 <= 10 x the floor 0.01
        guard.check(1)
        w.mul_(5)  # 5-fold: ordinary enough
        guard.check(2)
        w.mul_(11)
    with pytest.raises(WeightsBlewUp, match="step 3"):
        guard.check(3)
    assert float(weight_rms([w], torch.device("cpu"))) == pytest.approx(0.05 * 55)
    off = WeightGuard(0, [w], torch.device("cpu"))
    off.start(None, 0)
    with torch.no_grad():
        w.mul_(1e30)
    off.check(1)  # no check, no read


@pytest.mark.parametrize("value", ["0.5", "1", "-2"])
def test_a_growth_that_would_stop_every_run_is_refused_before_step_1(value):
    with pytest.raises(UserError, match=f"train.max_weight_growth={value}"):
        validate(compose_config([*DIT, f"train.max_weight_growth={value}"]))
