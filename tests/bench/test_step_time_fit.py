"""bench/step_time_fit.py on the committed H200 rows: the JSON it prints, a held-out prediction that
does not see its own row, and the shipped constants being the script's full fit."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import step_time_fit as stf  # noqa: E402

from runner.plan.host import FITTED, H200_FIT  # noqa: E402


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return stf.load_rows()


def test_json_has_one_object_per_committed_row():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "step_time_fit.py"), "--json"], capture_output=True,
                         text=True, check=True, timeout=600).stdout
    objs = [json.loads(line) for line in out.splitlines()]
    assert [o["row"] for o in objs] == [r["row"] for r in stf.load_rows()]
    for o in objs:
        assert set(o) == {"row", "measured_s", "predicted_s", "held_out_ratio"}
        assert o["predicted_s"] > 0 and o["held_out_ratio"] == pytest.approx(o["measured_s"] / o["predicted_s"])


def test_a_held_out_rows_prediction_does_not_see_its_measurement(rows):
    """Leave-one-out: the held-out row's prediction comes from a fit of the others only, so changing its
    measured s/step changes nothing in its prediction (and does change a fit that includes it)."""
    changed = copy.deepcopy(rows)
    changed[0]["measured_s"] *= 3
    assert stf.held_out(changed, 0) == pytest.approx(stf.held_out(rows, 0), rel=1e-9)
    assert stf.predict_row(changed[0], stf.fit(changed)) != pytest.approx(stf.predict_row(rows[0], stf.fit(rows)),
                                                                          rel=1e-3)  # a fit that sees it moves


def test_the_shipped_constants_are_the_full_fit(rows):
    full = stf.fit(rows)
    for f in fields(full):
        want = getattr(full, f.name)
        assert getattr(H200_FIT, f.name) == pytest.approx(want, rel=0.02), f.name
    assert set(FITTED) < {f.name for f in fields(full)}
