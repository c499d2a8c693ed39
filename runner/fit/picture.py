"""``fit.png``: every candidate of ``mode=fit`` as its planned peak against its predicted s/step, with the
budget line and the winner marked, drawn from the ``fit.json`` record (matplotlib's Agg canvas, headless)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from runner.output.plots import byte_unit, new_figure, safely

FIT_PNG = "fit.png"


def _peak(row: dict[str, Any]) -> int:
    return row["planned_peak_bytes"] or row["required_bytes"]


def draw_fit(record: dict[str, Any], out: Path) -> Path | None:
    """Write ``out/fit.png`` from a fit record; None when there is nothing to draw (or drawing failed)."""
    rows = [r for r in record["candidates"] if r and r.get("seconds_per_step") and _peak(r)]
    if not rows:
        return None

    def draw() -> Path:
        budget = record["budget_bytes"] - (record.get("headroom_bytes") or 0)
        scale, unit = byte_unit(max(max(_peak(r) for r in rows), budget))
        fig, (ax,) = new_figure(8, 5, 1, 1)
        for confirmed, marker in ((True, "o"), (False, "x")):
            pts = [r for r in rows if bool(r["confirmed"]) == confirmed]
            if pts:
                ax.scatter([r["seconds_per_step"] for r in pts], [_peak(r) / scale for r in pts], marker=marker,
                           color="tab:blue", label="planned" if confirmed else "estimated")
        ax.axhline(budget / scale, color="tab:red", linestyle="--", label=f"budget {budget / scale:.2f} {unit}")
        win = record.get("winner")
        if win:
            ax.scatter([win["seconds_per_step"]], [_peak(win) / scale], s=160, facecolors="none",
                       edgecolors="tab:green", linewidths=2, label=f"chosen: {win['settings']}"[:90])
        ax.set_xlabel("predicted s/step")
        ax.set_ylabel(f"device peak ({unit})")
        ax.set_title(f"mode=fit: {len(rows)} candidates on {record.get('device') or 'the target'}")
        ax.legend(fontsize=7, loc="best")
        path = out / FIT_PNG
        fig.savefig(path, dpi=100, bbox_inches="tight")
        return path

    return safely(FIT_PNG, draw)
