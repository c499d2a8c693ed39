"""``sweep_objective.png``: the first objective against each swept key, one panel a key, and with several
objectives the first two against each other with the Pareto front marked.

The swept keys are those whose value differs between the jobs' overrides. A numeric key spanning more
than 100x (a learning rate) gets a log axis; any other value is a category. Jobs without a value of the
objective (failed, not run) are left out; pruned jobs are drawn hollow.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from runner.sweep.config import OBJECTIVES, directions, objectives
from runner.sweep.report import best_rows

SWEEP_OBJECTIVE_PNG = "sweep_objective.png"


def swept_values(rows: list[dict[str, Any]]) -> dict[str, list[str | None]]:
    """key -> each row's value, for the keys whose value is not the same in every row."""
    parsed = [dict(str(o).lstrip("+~").split("=", 1) for o in r.get("overrides") or [] if "=" in str(o)) for r in rows]
    keys = sorted({k for p in parsed for k in p})
    return {k: [p.get(k) for p in parsed] for k in keys if len({p.get(k) for p in parsed}) > 1}


def _number(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def write_objective_plot(rows: list[dict[str, Any]], cfg: Any, path: Path) -> list[str] | None:
    """Write the picture; its panels' titles (swept keys, then ``pareto``), or None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, dirs = objectives(cfg), directions(cfg)
    column = OBJECTIVES[names[0]][0]
    scored = [r for r in rows if isinstance(r.get(column), (int, float))]
    swept = swept_values(scored)
    panels = [*swept, *(["pareto"] if len(names) > 1 else [])]
    if not scored or not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "pareto":
            _pareto(ax, scored, names, dirs)
            continue
        values = swept[key]
        numbers = [_number(v) for v in values]
        numeric = all(n is not None for n in numbers)
        cats = sorted({str(v) for v in values})
        xs = numbers if numeric else [cats.index(str(v)) for v in values]
        for x, r in zip(xs, scored):
            hollow = r.get("status") == "pruned"
            ax.scatter([x], [r[column]], facecolors="none" if hollow else "C0", edgecolors="C0")
        if numeric and min(numbers) > 0 and max(numbers) > 100 * min(numbers):
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(range(len(cats)), cats, rotation=30)
        ax.set_title(key, fontsize=9)
        ax.set_ylabel(f"{names[0]} ({dirs[0]})")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return panels


def _pareto(ax: Any, rows: list[dict[str, Any]], names: list[str], dirs: list[str]) -> None:
    a, b = OBJECTIVES[names[0]][0], OBJECTIVES[names[1]][0]
    pts = [r for r in rows if isinstance(r.get(b), (int, float))]
    ax.scatter([r[a] for r in pts], [r[b] for r in pts], color="C0", label="jobs")
    front = sorted(best_rows(pts, names[:2], dirs[:2]), key=lambda r: r[a])
    ax.plot([r[a] for r in front], [r[b] for r in front], "o-", color="C3", label="Pareto front")
    ax.set_xlabel(names[0])
    ax.set_ylabel(names[1])
    ax.set_title("pareto", fontsize=9)
    ax.legend(fontsize=7)
