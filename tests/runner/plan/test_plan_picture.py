"""plan.png (runner/plan/picture.py) from the planner's timeline of the simulated step (runner/plan/timeline.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from runner.cli.compose import compose_config
from runner.checks import validate
from runner.plan import plan_step
from runner.plan.picture import draw_plan
from runner.plan.timeline import LIMIT

pytestmark = pytest.mark.usefixtures("one_thread")

ASSETS = Path(__file__).resolve().parents[2] / "assets"
DIT = ["trainer=custom", "trainer._target_=dit_trainer.ClassConditionalDiT", "budget_gb=1"]


def test_the_timeline_holds_the_steps_memory_and_plan_png_is_drawn_from_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS))
    cfg = compose_config(DIT)
    validate(cfg)
    plan = plan_step(cfg)
    timeline = plan.timeline
    points = timeline["points"]
    assert 0 < len(points) <= LIMIT and timeline["ops"] >= len(points)
    assert timeline["categories"] == list(plan.by_category)
    highest = max(sum(p[1]) for p in points)
    # Sampled after each op, the highest point is the plan's peak less what lives only inside an op.
    assert 0.8 * plan.peak_bytes <= highest <= plan.peak_bytes
    assert {p[3] for p in points} >= {"setup", "forward", "backward", "optimizer"}
    assert max(p[2] for p in points) <= plan.host_peak_bytes
    path = draw_plan(plan.to_dict(), tmp_path)
    assert path == tmp_path / "plan.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_timeline_no_picture(tmp_path):
    assert draw_plan({"timeline": None}, tmp_path) is None and not (tmp_path / "plan.png").exists()
