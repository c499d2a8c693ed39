"""fit.png (runner/fit/picture.py) from a fit record of the shape fit.json has."""
from __future__ import annotations

from runner.fit.picture import draw_fit


def _row(peak: int, s: float, confirmed: bool) -> dict:
    return {"settings": f"peak {peak}", "required_bytes": peak, "planned_peak_bytes": peak if confirmed else None,
            "seconds_per_step": s, "confirmed": confirmed}


def test_every_candidate_is_drawn_with_the_budget_and_the_winner(tmp_path):
    rows = [_row(5 * 2**30, 1.0, True), _row(9 * 2**30, 0.7, False), _row(13 * 2**30, 0.5, True)]
    record = {"budget_bytes": 12 * 2**30, "headroom_bytes": 0, "device": "a card", "candidates": rows,
              "winner": rows[0]}
    path = draw_fit(record, tmp_path)
    assert path == tmp_path / "fit.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_candidate_no_picture(tmp_path):
    assert draw_fit({"budget_bytes": 1, "candidates": [], "winner": None}, tmp_path) is None
    assert not (tmp_path / "fit.png").exists()
