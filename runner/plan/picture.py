"""``plan.png``: the simulated step's device memory over time, stacked by what holds it, with the
kernel workspaces on top, the budget line and the peak marked with its phase and module; host RAM
beside it. Drawn from plan.json's ``timeline`` (runner/plan/timeline.py) with matplotlib's Agg canvas."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from runner.output.plots import byte_unit, new_figure, safely

PLAN_PNG = "plan.png"
LABELS = {"weights": "weights", "gradients": "gradients", "optimizer_state": "optimizer state",
          "activations": "activations", "temporaries": "temporaries", "other": "other (batch, buffers)"}


def draw_plan(plan: dict[str, Any], out: Path) -> Path | None:
    """Write ``out/plan.png`` from a plan's dict; None when it has no timeline (or drawing failed)."""
    timeline = plan.get("timeline") or {}
    points = timeline.get("points") or []
    if not points:
        return None
    return safely(PLAN_PNG, lambda: _draw(plan, timeline, points, out))


def _draw(plan: dict[str, Any], timeline: dict[str, Any], points: list[list[Any]], out: Path) -> Path:
    cats, margin, budget = timeline["categories"], int(plan.get("margin_bytes") or 0), plan.get("budget_bytes")
    x = [p[0] for p in points]
    totals = [sum(p[1]) for p in points]
    top = max(max(totals) + margin, budget or 0)
    scale, unit = byte_unit(top)
    fig, (ax, host_ax) = new_figure(14, 5, 1, 2)
    layers = [[p[1][i] / scale for p in points] for i in range(len(cats))]
    labels = [LABELS.get(c, c) for c in cats]
    if margin:
        layers.append([margin / scale] * len(points))
        labels.append("kernel workspaces")
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"][:len(cats)]
    ax.stackplot(x, layers, labels=labels, colors=colors + (["lightgrey"] if margin else []), alpha=0.85)
    if budget:
        ax.axhline(budget / scale, color="tab:red", linestyle="--", label=f"budget {budget / scale:.2f} {unit}")
    # The plan's peak (its steady-state phase; the tracker saw it inside an op), at the highest point of that phase
    in_phase = [i for i, p in enumerate(points) if p[3] == plan.get("peak_phase")] or list(range(len(points)))
    peak = max(in_phase, key=lambda i: totals[i])
    height = (int(plan.get("peak_bytes") or totals[peak]) + margin) / scale
    module = points[peak][4] or _largest_holder(plan)
    ax.annotate(f"peak {height:.2f} {unit} (workspaces included)\nin {points[peak][3]};\n{module}",
                xy=(x[peak], height), xytext=(0.02, 0.80), textcoords="axes fraction",
                va="top", fontsize=8, arrowprops={"arrowstyle": "->", "color": "black"})
    _phase_edges(ax, points)
    ax.set_xlabel("op of the simulated step")
    ax.set_ylabel(f"device memory ({unit})")
    run = plan.get("run") or {}
    ax.set_title(f"plan: {run.get('trainer', '')} ({run.get('size', '')}), {timeline.get('ops', len(points))} ops",
                 pad=45)
    ax.legend(fontsize=7, loc="upper right")
    host = [p[2] for p in points]
    hscale, hunit = byte_unit(max(host) or 1)
    host_ax.plot(x, [h / hscale for h in host], color="tab:purple", label="host tensors")
    host_ax.set_ylim(bottom=0)
    host_ax.set_xlabel("op of the simulated step")
    host_ax.set_ylabel(f"host RAM ({hunit})")
    host_ax.set_title(pad=45, label=f"host RAM: peak {plan.get('host_peak_bytes', max(host)) / hscale:.2f} {hunit} "
                      f"({plan.get('host_peak_phase', '')})")
    host_ax.legend(fontsize=7, loc="upper right")
    path = out / PLAN_PNG
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path


def _phase_edges(ax: Any, points: list[list[Any]]) -> None:
    """A dotted line and the phase's name where each phase starts."""
    last, last_x, lift = None, None, 0.0
    span = max(points[-1][0], 1)
    for p in points:
        if p[3] != last:
            ax.axvline(p[0], color="grey", linestyle=":", linewidth=0.8)
            lift = lift + 0.07 if last_x is not None and p[0] - last_x < span * 0.04 else 0.0  # close names: one above
            name = "between phases" if p[3] in (None, "(none)") else p[3]
            ax.text(p[0], 1.01 + lift, name, fontsize=7, rotation=30, ha="left", va="bottom", color="dimgrey",
                    transform=ax.get_xaxis_transform())
            last, last_x = p[3], p[0]


def _largest_holder(plan: dict[str, Any]) -> str:
    """Where no module's forward is running at the peak (backward): the module holding the most bytes."""
    by_module = {m: sum(c.values()) for m, c in (plan.get("by_module") or {}).items()}
    if not by_module:
        return "no module running"
    name = max(by_module, key=lambda m: by_module[m])
    return f"no module running; {name} holds the most"
