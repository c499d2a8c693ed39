"""The sweep's verdict under its table: the best job by ``sweep.objective`` (the Pareto front for several
objectives), with the command that re-runs it. Only jobs that ended ``ok`` compete (a pruned job stopped
before its last step)."""
from __future__ import annotations

import math
import shlex
from typing import Any

from runner.sweep.config import OBJECTIVES, directions, objectives


def _values(row: dict[str, Any], names: list[str], dirs: list[str]) -> list[float] | None:
    """The row's objectives, each as a value to minimise; None when one is missing."""
    out = []
    for name, d in zip(names, dirs):
        v = row.get(OBJECTIVES[name][0])
        if not isinstance(v, (int, float)) or math.isnan(v):
            return None
        out.append(float(v) if d == "minimize" else -float(v))
    return out


def best_rows(rows: list[dict[str, Any]], names: list[str], dirs: list[str]) -> list[dict[str, Any]]:
    """The best ``ok`` row (one objective) or the rows no other row beats in every objective (several)."""
    scored = [(r, v) for r in rows if r.get("status") == "ok" for v in [_values(r, names, dirs)] if v is not None]
    if not scored:
        return []
    if len(names) == 1:
        return [min(scored, key=lambda rv: rv[1][0])[0]]

    def dominated(v: list[float]) -> bool:
        return any(all(a <= b for a, b in zip(w, v)) and w != v for _, w in scored)

    return [r for r, v in scored if not dominated(v)]


def command(row: dict[str, Any]) -> str:
    """``python -m runner <the job's overrides>``: one job of the sweep as a single run."""
    return " ".join(["python -m runner", *(shlex.quote(str(o)) for o in row.get("overrides") or [])])


def best_lines(rows: list[dict[str, Any]], cfg: Any) -> list[str]:
    """The lines printed under the sweep's table: the best job(s), their objective values and commands."""
    names, dirs = objectives(cfg), directions(cfg)
    best = best_rows(rows, names, dirs)
    label = ", ".join(f"{n} ({d})" for n, d in zip(names, dirs))
    if not best:
        return [f"best: no job ended ok with a value for {label}"]
    head = f"best by {label}:" if len(names) == 1 else f"Pareto front of {label} ({len(best)} jobs):"
    lines = [head]
    for r in best:
        values = ", ".join(f"{n}={r.get(OBJECTIVES[n][0]):.6g}" for n in names)
        lines.append(f"  job {r.get('job')}: {values}\n    {command(r)}")
    return lines
