"""runner/__main__.py dispatches each mode through its table: every valid ``mode`` has a task, no other."""
from __future__ import annotations

from runner.__main__ import MODE_TASKS
from runner.constants import MODES


def test_every_mode_has_one_task():
    assert sorted(MODE_TASKS) == sorted(MODES)
    assert all(callable(run) for run, _ in MODE_TASKS.values())
    assert [m for m, (_, opens) in MODE_TASKS.items() if not opens] == ["plugins"]  # answered before torch loads
