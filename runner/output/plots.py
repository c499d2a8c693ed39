"""Pictures of a run and of a sweep: ``loss.png`` in every run directory, ``sweep.png`` after ``-m``.

``loss.png`` (written when a job ends, however it ends: runner/cli/launch.py:run_job):

* top: the loss of every step (thin) and its smoothing (an exponential moving average, debiased
  as TensorBoard does, with a span of a tenth of the run), the ``val_loss`` column where rows
  have one, steps whose loss was NaN/inf (skipped updates) marked, and where a resumed run
  continues the run it was resumed from. A resumed run in a new directory plots one curve: the
  rows up to the resumed step come from the earlier run's metrics.jsonl (followed back through
  each run's ``train.resume``);
* bottom: memory. The planned peak of the preflight plan (``plan.json``; a run with
  ``train.preflight=false`` has none and the plot says so) against what metrics.jsonl measured:
  on CUDA the allocator's allocated and reserved bytes at each step end and the running peak; on
  CPU there is no device allocator, so the device figures are the plan's and, for profiled
  steps (``profile.enabled``), the peak live tensor bytes the tracker counted, and the process
  RSS is drawn on its own right-hand axis, labelled as what it is (everything the process holds).

``sweep.png`` (runner/cli/launch.py:SweepSummary, in the sweep directory): every job's loss curve on
one plot, and per job a bar of its planned peak beside its measured one (CUDA peak allocated, or
the tracked peak of a profiled CPU run; a CPU job with neither shows its host RSS, hatched and
labelled, since that is not a device figure).

matplotlib's Agg canvas is used directly (no pyplot, no global backend): headless, no display;
one figure per run (measured: 1.8 s to draw loss.png of 25 steps, plus 3.5 s to import matplotlib,
on 2 cores at load average 11; an idle machine takes a fraction of that). A plot must never end a
run: every failure is one warning line (:func:`safely`).
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from runner.output.report import read_metrics

log = logging.getLogger("runner")

LOSS_PNG = "loss.png"
SWEEP_PNG = "sweep.png"
PLAN_JSON = "plan.json"  # runner/plan/__init__.py:PLAN_FILE (not imported: the planner imports torch)
TIMELINE_JSON = "memory_timeline.json"  # runner/memory/profile.py:TIMELINE_JSON
GIB, MIB = 2**30, 2**20


def safely(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or None after one warning: a picture is never worth a failed run."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - any failure of matplotlib or a file is only a missing picture
        log.warning("could not write %s (%s: %s); the run's results are unaffected", what, type(e).__name__,
                    (str(e).splitlines() or [""])[0])
        return None


# ---- the numbers ---------------------------------------------------------------------------------
def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def smooth(values: Sequence[float | None], span: int) -> list[float | None]:
    """Debiased exponential moving average (TensorBoard's smoothing) with ``alpha = 2 / (span + 1)``;
    ``None``/NaN values are skipped (their position gets the average so far)."""
    alpha = 2.0 / (max(1, span) + 1)
    avg, weight, out = 0.0, 0.0, []
    for v in values:
        if finite(v):
            avg = (1 - alpha) * avg + alpha * float(v)
            weight = (1 - alpha) * weight + alpha
        out.append(avg / weight if weight else None)
    return out


def smoothing_span(n: int) -> int:
    """A tenth of the run, at least 5 steps (but no more than the run), at most 100."""
    return max(1, min(n, max(5, min(100, n // 10))))


def loss_history(out: Path, resume: str | None) -> tuple[list[dict[str, Any]], list[int]]:
    """The rows of ``out/metrics.jsonl``, preceded by those of the runs it was resumed from (up to
    the step it continued from), and the steps where a resumed run took over."""
    rows = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []
    seams: list[int] = []
    seen = {out.resolve()}
    while resume:
        earlier = _run_dir_of(Path(resume))
        if earlier is None or earlier.resolve() in seen:
            break  # resumed into the same folder: its metrics.jsonl already holds every step
        seen.add(earlier.resolve())
        first = rows[0]["step"] if rows else math.inf
        before = [r for r in read_metrics(earlier / "metrics.jsonl") if r.get("step", 0) < first] \
            if (earlier / "metrics.jsonl").is_file() else []
        if not before:
            break
        seams.insert(0, before[-1]["step"])
        rows = before + rows
        resume = _saved_resume(earlier)
    return rows, seams


def _run_dir_of(path: Path) -> Path | None:
    """The run directory of ``train.resume`` (a run dir, its checkpoints/ or a checkpoints/step-N)."""
    for cand in (path, path.parent, path.parent.parent):
        if (cand / "metrics.jsonl").is_file():
            return cand
    return None


def _saved_resume(run_dir: Path) -> str | None:
    """``train.resume`` of an earlier run, from its resolved_config.yaml."""
    path = run_dir / "resolved_config.yaml"
    if not path.is_file():
        return None
    import yaml

    cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return ((cfg.get("train") or {}).get("resume")) or None


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def planned_peak_bytes(out: Path) -> int | None:
    """The preflight plan's device peak (live tensor bytes), or None without a plan."""
    plan = read_json(out / PLAN_JSON)
    return int(plan["peak_bytes"]) if plan and plan.get("peak_bytes") is not None else None


def tracked_peaks(out: Path) -> dict[int, int]:
    """Profiled step -> the highest live tensor bytes the memory profile's tracker saw in it."""
    record = read_json(out / TIMELINE_JSON) or {}
    peaks: dict[int, int] = {}
    for p in record.get("points") or []:
        step, value = p.get("step"), p.get("peak_live_bytes_since_previous", p.get("live_bytes"))
        if isinstance(step, int) and finite(value):
            peaks[step] = max(peaks.get(step, 0), int(value))
    return peaks


def no_plan_reason(cfg: Any) -> str:
    preflight = True
    try:
        preflight = bool(cfg.train.get("preflight", True))
    except AttributeError:
        pass
    if not preflight:
        return "no planned peak: train.preflight=false"
    return "no planned peak: no plan.json (the planner could not simulate this run)"


# ---- drawing ---------------------------------------------------------------------------------------
def new_figure(width: float, height: float, rows: int, cols: int) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(rows * cols)]
    return fig, axes


def byte_unit(top_bytes: float) -> tuple[float, str]:
    return (GIB, "GiB") if top_bytes >= GIB else (MIB, "MiB")


def _draw_loss(ax: Any, rows: list[dict[str, Any]], seams: list[int]) -> None:
    steps = [r["step"] for r in rows]
    losses = [r.get("loss") for r in rows]
    span = smoothing_span(len(rows))
    ax.plot(steps, [v if finite(v) else math.nan for v in losses], color="tab:blue", alpha=0.35, linewidth=0.8,
            label="loss per step")
    ax.plot(steps, [v if v is not None else math.nan for v in smooth(losses, span)], color="tab:blue", linewidth=1.8,
            label=f"smoothed (EMA, span {span} steps)")
    val = [(r["step"], r["val_loss"]) for r in rows if finite(r.get("val_loss"))]
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", color="tab:orange", markersize=3, linewidth=1.2,
                label="validation loss (val_loss)")
    bad = [s for s, v in zip(steps, losses) if not finite(v)]
    if bad:
        ax.plot(bad, [0] * len(bad), "x", color="red", transform=ax.get_xaxis_transform(), clip_on=False,
                label=f"non-finite loss ({len(bad)} steps)")
    for seam in seams:
        ax.axvline(seam + 0.5, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"resumed after step {seam}", (seam + 0.5, 0.98), xycoords=("data", "axes fraction"),
                    fontsize=7, ha="left", va="top", color="grey")
    ax.set_ylabel("loss")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")


def _draw_memory(ax: Any, rows: list[dict[str, Any]], planned: int | None, tracked: dict[int, int],
                 budget_gb: float | None, no_plan: str) -> None:
    steps = [r["step"] for r in rows]
    cuda = any(r.get("mem_allocated_gb") is not None for r in rows)
    if cuda:
        top = max([planned or 0] + [(r.get(k) or 0) * GIB for r in rows
                                    for k in ("mem_allocated_gb", "mem_reserved_gb", "memory_peak_gb")])
        scale, unit = byte_unit(top)
        col = lambda key: [r[key] * GIB / scale if r.get(key) is not None else math.nan for r in rows]  # noqa: E731
        ax.plot(steps, col("mem_allocated_gb"), color="tab:green", label="CUDA allocated (step end)")
        ax.plot(steps, col("mem_reserved_gb"), color="tab:green", linestyle="--", label="CUDA reserved (step end)")
        ax.plot(steps, col("memory_peak_gb"), color="black", linewidth=1, label="CUDA peak allocated so far")
        device_ax = ax
        ax.set_ylabel(f"CUDA memory, {unit}")
        ax.set_title("memory: CUDA allocator at each step end, and the plan", fontsize=9)
    else:
        top = max([planned or 0] + list(tracked.values()))
        scale, unit = byte_unit(top or 1)
        device_ax = ax
        if tracked:
            ts = sorted(tracked)
            ax.plot(ts, [tracked[s] / scale for s in ts], "o", color="tab:purple", markersize=4,
                    label="tracked peak live tensors (profiled steps)")
        ax.set_ylabel(f"device tensors on CPU, {unit}")
        ax.set_title("memory: a CPU run has no device allocator; device figures are the plan's and the profile's "
                     "(tracked), host RSS on the right", fontsize=8)
        rss = [(r["step"], r["host_rss_gb"]) for r in rows if finite(r.get("host_rss_gb"))]
        if rss:
            right = ax.twinx()
            right.plot([s for s, _ in rss], [v for _, v in rss], color="grey", linestyle="--",
                       label="host RSS (whole process, step end; right axis)")
            right.set_ylabel("host RSS, GiB")
            right.set_ylim(0, max(v for _, v in rss) * 1.3)  # headroom for the legends
            right.legend(fontsize=7, loc="lower right")
    if planned is not None:
        device_ax.axhline(planned / scale, color="tab:red", linewidth=1.2, label=f"planned peak (preflight) {planned / scale:.3g} {unit}")
    else:
        ax.annotate(no_plan, (0.01, 0.95), xycoords="axes fraction", fontsize=8, ha="left", va="top", color="tab:red")
    if budget_gb is not None and budget_gb * GIB <= 4 * max(top, 1):  # a budget far above the run would squash it
        device_ax.axhline(budget_gb * GIB / scale, color="tab:red", linestyle=":", linewidth=1, label=f"budget_gb {budget_gb:g}")
        top = max(top, budget_gb * GIB)
    device_ax.set_ylim(0, (top / scale) * 1.3 if top else 1.0)  # headroom for the legend
    if not cuda and not tracked and planned is None:
        device_ax.set_yticks([])
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=7, loc="upper left")


def write_loss_plot(out: Path, cfg: Any = None) -> Path | None:
    """``out/loss.png`` from metrics.jsonl (and plan.json, memory_timeline.json); None without rows.

    Skipped when loss.png is already newer than metrics.jsonl (a hosted run's ``finish()`` and the
    job wrapper both ask for it)."""
    out = Path(out)
    metrics, png = out / "metrics.jsonl", out / LOSS_PNG
    if not metrics.is_file():
        return None
    if png.is_file() and png.stat().st_mtime_ns > metrics.stat().st_mtime_ns:
        return png
    resume = _select(cfg, "train.resume")
    rows, seams = loss_history(out, str(resume) if resume else None)
    rows = [r for r in rows if isinstance(r.get("step"), int)]
    if not rows:
        return None
    fig, (loss_ax, mem_ax) = new_figure(9.0, 7.0, 2, 1)
    _draw_loss(loss_ax, rows, seams)
    budget = _select(cfg, "budget_gb")
    _draw_memory(mem_ax, rows, planned_peak_bytes(out), tracked_peaks(out), None if budget is None else float(budget),
                 no_plan_reason(cfg))
    name = _select(cfg, "preset")
    loss_ax.set_title(f"{out.name}{f'  (preset {name})' if name else ''}: {rows[-1]['step']} steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return png


def _select(cfg: Any, key: str) -> Any:
    if cfg is None:
        return None
    try:
        from omegaconf import OmegaConf

        return OmegaConf.select(cfg, key, default=None)
    except Exception:  # noqa: BLE001 - a plain object without the key
        return None


# ---- sweep ------------------------------------------------------------------------------------------
def _short_label(row: dict[str, Any], common: set[str]) -> str:
    own = [o for o in (row.get("overrides") or []) if o not in common]
    label = " ".join(own) or "(common overrides only)"
    return f"{row.get('job', '?')}: {label[:60]}"


def write_sweep_plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """``sweep.png``: every job's (smoothed) loss curve, and planned vs measured peak per job."""
    if not rows:
        return None
    lists = [r.get("overrides") or [] for r in rows]
    common = {o for o in lists[0] if all(o in other for other in lists[1:])} if len(lists) > 1 else set()
    fig, (loss_ax, bar_ax) = new_figure(13.0, 5.5, 1, 2)
    for row in rows:
        metrics = Path(str(row.get("dir", ""))) / "metrics.jsonl"
        data = [r for r in read_metrics(metrics) if isinstance(r.get("step"), int)] if metrics.is_file() else []
        if not data:
            continue
        losses = [r.get("loss") for r in data]
        line, = loss_ax.plot([r["step"] for r in data], [v if v is not None else math.nan
                                                         for v in smooth(losses, smoothing_span(len(data)))],
                             linewidth=1.5, label=f"{_short_label(row, common)} [{row.get('status', '?')}]")
        loss_ax.plot([r["step"] for r in data], [v if finite(v) else math.nan for v in losses], linewidth=0.6,
                     alpha=0.3, color=line.get_color())
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss (smoothed; raw faint)")
    loss_ax.grid(alpha=0.3)
    if loss_ax.get_legend_handles_labels()[0]:
        loss_ax.legend(fontsize=7)
    loss_ax.set_title("loss per job" + (f"  (common: {' '.join(sorted(common))[:80]})" if common else ""), fontsize=9)
    _draw_peak_bars(bar_ax, rows)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _draw_peak_bars(ax: Any, rows: list[dict[str, Any]]) -> None:
    x = list(range(len(rows)))
    planned = [r.get("planned_peak_gb") for r in rows]
    measured, hatches = [], []
    for r in rows:
        src = str(r.get("peak_memory_source") or "")
        if finite(r.get("peak_memory_gb")) and not src.startswith("planned"):
            measured.append(r["peak_memory_gb"]); hatches.append("")
        elif finite(r.get("host_rss_peak_gb")):
            measured.append(r["host_rss_peak_gb"]); hatches.append("//")
        else:
            measured.append(None); hatches.append("")
    top = max([v for v in planned + measured if finite(v)] or [1.0])
    scale, unit = (1.0, "GiB") if top >= 1 else (1024.0, "MiB")
    w = 0.38
    ax.bar([i - w / 2 for i in x], [v * scale if finite(v) else 0 for v in planned], w, color="tab:red", alpha=0.7,
           label="planned peak (preflight)")
    for i, (v, h) in enumerate(zip(measured, hatches)):
        if finite(v):
            ax.bar(i + w / 2, v * scale, w, color="lightgrey" if h else "tab:green", hatch=h, edgecolor="black",
                   linewidth=0.5)
    for i, (p, m) in enumerate(zip(planned, measured)):
        if not finite(p):
            ax.annotate("no plan", (i - w / 2, 0), ha="center", va="bottom", fontsize=7, rotation=90)
        if not finite(m):
            ax.annotate("not measured", (i + w / 2, 0), ha="center", va="bottom", fontsize=7, rotation=90)
    from matplotlib.patches import Patch

    handles = [Patch(color="tab:red", alpha=0.7, label="planned peak (preflight)"),
               Patch(color="tab:green", label="measured device peak (CUDA max allocated / tracked on CPU)")]
    if any(hatches):
        handles.append(Patch(facecolor="lightgrey", hatch="//", edgecolor="black",
                             label="host RSS (CPU; whole process, not a device peak)"))
    ax.legend(handles=handles, fontsize=7, loc="best")
    ax.set_xticks(x)
    ax.set_xticklabels([str(r.get("job", i)) for i, r in enumerate(rows)])
    ax.set_xlabel("job")
    ax.set_ylabel(f"peak memory, {unit}")
    ax.set_title("planned vs measured peak per job", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
