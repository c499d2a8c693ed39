"""The simulated step's memory over time, for ``plan.png``: after every op the planner's tracker is
sampled (device bytes by category, host bytes, phase, innermost module), and the samples are thinned
to at most ``LIMIT`` points, each the highest of its stretch, so no peak is lost."""
from __future__ import annotations

from typing import Any, Callable

from runner.memory.live_bytes_views import CATEGORIES
from runner.plan.target import DEVICE, HOST

LIMIT = 600  # points kept: enough for the picture, small in plan.json


class Timeline:
    """An ``op_observer`` of the planner's tracker (runner/memory/live_bytes.py) that records memory per op."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.points: list[tuple[tuple[int, ...], int, str, str | None]] = []

    def observe(self, _func: Any, _args: tuple, _kwargs: dict, _out: Any, phase: str) -> None:
        cats, host = self.tracker.now_by_category(DEVICE.type), self.tracker.now_total(HOST.type)
        self.points.append((tuple(cats.get(c, 0) for c in CATEGORIES), host, phase, self.tracker.innermost_module()))

    def to_dict(self) -> dict[str, Any]:
        """``{"categories": [...], "points": [[op, [bytes per category], host, phase, module], ...]}``."""
        n = len(self.points)
        stride = max(1, -(-n // LIMIT))
        kept = []
        for lo in range(0, n, stride):
            i = max(range(lo, min(lo + stride, n)), key=lambda j: sum(self.points[j][0]))
            cats, host, phase, module = self.points[i]
            kept.append([i, list(cats), max(p[1] for p in self.points[lo:lo + stride]), phase, module])
        return {"categories": list(CATEGORIES), "ops": n, "points": kept}


def chain(*observers: Callable[..., None]) -> Callable[..., None]:
    def observe(*args: Any) -> None:
        for o in observers:
            o(*args)
    return observe
