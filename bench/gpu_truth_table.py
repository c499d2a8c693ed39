"""The markdown of bench/gpu_truth.py: one row per run, the three comparisons, and what is missing.

Rendered from the row records alone (rows.jsonl) and the run's meta.json, so the same section can
be written on the GPU machine or, from the files that came back, here (``--render``).
"""
from __future__ import annotations

from typing import Any

BEGIN, END = "<!-- bench/gpu_truth.py begin -->", "<!-- bench/gpu_truth.py end -->"
MEASURED_SOURCES = ("cuda max allocated", "tracked live tensors")  # job_summary peak sources that are measurements


def _f(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def _is_measured(rec: dict[str, Any]) -> bool:
    return rec.get("alloc_peak_gb") is not None or str(rec.get("peak_source") or "").startswith(MEASURED_SOURCES)


def device_peak(rec: dict[str, Any]) -> tuple[float | None, str]:
    """The row's device peak and a short word on what it is: CUDA's max allocated, or (CPU) the
    figure runner/output/jobs.py reports instead, which on a CPU run is the plan's, not a measurement."""
    if rec.get("alloc_peak_gb") is not None:
        return rec["alloc_peak_gb"], "cuda"
    src = str(rec.get("peak_source") or "")
    return rec.get("peak_gb"), ("tracked" if src.startswith("tracked") else "plan, CPU" if src else "")


def status_cell(rec: dict[str, Any]) -> str:
    err = (rec.get("error") or "").replace("|", "\\|")
    return rec["status"] if rec["status"] in ("ok",) or not err else f"{rec['status']}: {err[:160]}"


def row_line(rec: dict[str, Any]) -> str:
    if rec["status"] in ("skipped", "missing"):
        return f"| `{rec['row']}` | {' '.join(rec['settings']) or '-'} | {status_cell(rec)} |" + " |" * 11
    peak, what = device_peak(rec)
    measured = _is_measured(rec)
    peak_text = f"{_f(peak, '.3f')}" + (f" ({what})" if what and what != "cuda" else "")
    predicted = _f(rec.get("predicted_s"), ".3g") if rec.get("predicted_ok", True) else "n/a"
    speed = _ratio(rec.get("s_per_step"), rec.get("predicted_s")) if predicted != "n/a" else "-"
    get = rec.get
    cells = [f"`{rec['row']}`", " ".join(rec["settings"]) or "-", status_cell(rec), peak_text,
             _f(get("reserved_peak_gb"), ".3f"),
             f"{_f(get('plan_peak_gb'), '.3f')} / {_f(get('plan_required_gb'), '.3f')}",
             _ratio(peak, get("plan_peak_gb")) if measured else "-",
             _ratio(get("reserved_peak_gb"), get("plan_required_gb")),
             step_cell(rec), predicted, speed, mfu_cell(rec), str(get("micro_batches") or "-"), _f(get("wall_s"), ".0f")]
    return "| " + " | ".join(cells) + " |"


def step_cell(rec: dict[str, Any]) -> str:
    """Mean s/step of the timed steps, with their spread ((max - min) / median) when the row kept it."""
    mean, spread = rec.get("s_per_step"), rec.get("spread")
    if mean is None or spread is None:
        return _f(mean, ".3g")
    return f"{mean:.3g} ({rec.get('timed_steps')} steps, spread {spread:.0%})"


def mfu_cell(rec: dict[str, Any]) -> str:
    """Measured MFU: the plan's model FLOPs over (measured s/step x the card's peak), from the plan's MFU."""
    mfu, pred, meas = rec.get("plan_mfu"), rec.get("predicted_s"), rec.get("s_per_step")
    if not (mfu and pred and meas) or not rec.get("predicted_ok", True):
        return "-"
    return f"{mfu * pred / meas:.1%}"


TABLE_HEAD = [
    "| row | settings beyond the preset | status | device peak GiB (max allocated) | max reserved GiB "
    "| planned peak / required GiB | allocated ÷ planned peak | reserved ÷ required | s/step (mean of steps 2..) "
    "| predicted s/step | measured ÷ predicted | MFU (measured) | micro-batch per step | wall s |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def _saving(base: dict[str, Any] | None, var: dict[str, Any], key: str) -> str:
    a, b = (None if base is None else base.get(key)), var.get(key)
    if a is None or b is None:
        return "-"
    return f"{a:.3f} -> {b:.3f} ({a - b:.3f} saved)"


def _versus(name: str | None, base: dict[str, Any] | None, rec: dict[str, Any]) -> str:
    """A variant against its baseline row: peaks measured and planned, and s/step."""
    ok = base is not None and base.get("status") == "ok"
    state = "" if ok else f" (its row is {(base or {}).get('status', 'missing')})"
    base_s = _f(base.get("s_per_step") if base else None, ".3g")
    return (f"Against `{name}`{state}: device peak GiB {_saving(base, rec, 'alloc_peak_gb')}, max reserved GiB "
            f"{_saving(base, rec, 'reserved_peak_gb')}, planned peak GiB {_saving(base, rec, 'plan_peak_gb')}; "
            f"s/step {base_s} -> {_f(rec.get('s_per_step'), '.3g')}.")


def comparison_lines(recs: dict[str, dict[str, Any]], rows: list[Any]) -> list[str]:
    """One line per extra row: what it compares, the measured and planned figures side by side."""
    out = []
    for row in rows:
        rec = recs.get(row.name)
        if row.kind == "preset" or rec is None:
            continue
        head = f"- `{row.name}` ({rec['status']}): {row.why}"
        if rec["status"] in ("skipped", "missing"):
            out.append(head)
            continue
        if row.kind in ("stream", "fused", "compile"):
            out.append(head + " " + _versus(row.baseline, recs.get(row.baseline or ""), rec))
        elif row.kind == "oom":
            def g(key: str) -> str:
                return _f(rec.get(key), ".3f")
            out.append(f"{head} Planned need at micro-batch {rec.get('batch')}: {g('plan_required_gb')} GiB, at "
                       f"micro-batch {rec.get('half_batch')}: {g('half_required_gb')} GiB; cap {g('cap_gb')} GiB. "
                       f"Micro-batch per step {rec.get('micro_batches')}, OOM retries per step "
                       f"{rec.get('oom_retries')}, max reserved {g('reserved_peak_gb')} GiB.")
    return out


def header_lines(meta: dict[str, Any]) -> list[str]:
    dry = meta["mode"] == "dry-run"
    title = {"dry-run": "### GPU truth: CPU dry run (model.size=tiny; no figure here is a GPU's)",
             "plan-only": "### GPU truth: the GPU rows' plans only (nothing ran)"}.get(
        meta["mode"], f"### GPU truth: every preset measured on {meta['device']}")
    lines = [title, "", f"Command: `{meta['command']}` ({meta['date']}); {meta['device_line']}.",
             f"Every row is `python -m runner +preset=<preset> {' '.join(meta['common'])} <settings> "
             f"{' '.join(meta['run_only'])}`, each in its own process, {meta.get('order_rule', 'longest')} "
             "predicted step first. Its plan is "
             "`mode=plan` with the same overrides, made for every row before the runs (in parallel), so the runs "
             "skip their identical preflight.",
             f"Budget {meta['budget_s']:.0f} s, used {_f(meta.get('used_s'), '.0f')} s (plans: "
             f"{_f(meta.get('prepass_s'), '.0f')} s)."]
    for more in meta.get("more", []):
        lines.append(f"Then, on the same card, for rows the first command's budget missed: `{more['command']}` "
                     f"({more['date']}; budget {more['budget_s']:.0f} s, used {_f(more.get('used_s'), '.0f')} s); "
                     "a row it finished replaces the first command's.")
    if meta.get("save_blocked"):
        lines.append("The runner's final checkpoint save is blocked (a file named `checkpoints` in the run's folder): "
                     "the runner ends with io_error after its steps, and such a row is ok (`runner_status` in "
                     "rows.jsonl keeps what the runner said).")
    if dry:
        lines.append("On a CPU the device peak is not measured: runner/output/jobs.py reports the preflight plan's "
                     "peak there (`peak_memory_source`), marked `(plan, CPU)`; its ratio is left out.")
    else:
        lines.append("CUDA peaks are the process's whole run (model placement and the encoder-cache pre-pass "
                     "included: the runner never resets them), the plan's is the training step's; reserved is what "
                     "the cap (set_per_process_memory_fraction) limits. s/step: mean of steps 2 to the last (step 1 warms "
                     "up), with their spread where the row kept it; MFU: the plan's model FLOPs (recompute "
                     "excluded) over measured s/step x the card's bf16 peak.")
    return lines


def section(meta: dict[str, Any], recs: list[dict[str, Any]], rows: list[Any]) -> str:
    """The whole generated section of docs/benchmarks.md, between its markers."""
    by_name = {r["row"]: r for r in recs}
    ordered = [by_name[n] for n in meta.get("order", []) if n in by_name]
    ordered += [r for r in recs if r not in ordered]
    missing = [r["row"] for r in ordered if r["status"] == "missing"]
    lines = [BEGIN, *header_lines(meta), "", *TABLE_HEAD, *(row_line(r) for r in ordered), ""]
    comps = comparison_lines(by_name, rows)
    if comps:
        lines += ["Comparisons:", "", *comps, ""]
    if missing:
        lines.append(f"Missing (the budget was spent before they finished): {', '.join(missing)}.")
    elif not meta.get("complete", False):
        lines.append("The run has not finished: rows still to come are not listed.")
    lines.append(END)
    return "\n".join(lines)
