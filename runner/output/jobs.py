"""How each job ended, and a summary of a ``-m`` sweep.

Every job (a single run too) writes ``job_summary.json`` in its directory, atomically and as
strict JSON (a NaN loss is ``null``): its overrides, status (``ok``; ``pruned``: stopped early by the sweep,
runner/sweep/watch.py; ``does_not_fit``: train.auto_fit found no setting within budget_gb, exit 3, nothing ran;
``killed``: an Optuna trial a killed sweep left unfinished, written by the resumed sweep (:func:`mark_killed`);
``failed``: bad input, exit 2;
``oom``: exit 3; ``nonfinite``: NaN/inf loss or gradients, exit 4; ``io_error``: a full, read-only
or vanished folder, exit 5; ``interrupted``: 128 + the signal), steps done, final loss, s/step, peak memory and
final micro-batch size, read back from its metrics.jsonl. After a sweep, the
:class:`~runner.cli.launch.SweepSummary` Hydra callback (configured under ``hydra.callbacks`` in
conf/config.yaml) collects them into ``sweep_summary.csv`` in the sweep directory and prints a table.

Columns that summarise: ``final_loss`` is the mean loss of the last 10% of the job's steps (at
least one; ``final_loss_steps`` says how many), since a single step's loss is one batch's noise.
``peak_memory_gb`` is device memory: on CUDA the run's peak allocated bytes (``memory_peak_gb``); on
``train.device=cuda_sim`` the simulated card's peak live tensor bytes (what a plan's peak counts);
on CPU the memory profile's tracked peak when the job was profiled, else the preflight plan's
device peak, never the process RSS (which counts the interpreter and every library, and in a
sweep run in one process what earlier jobs left behind). ``peak_memory_source`` says which figure
it is; ``planned_peak_gb`` (the plan, on any device) and ``host_rss_peak_gb`` sit beside it.
``host_syncs_per_step`` and ``card_ops_per_step`` (``train.device=cuda_sim`` only, else null): what the host did
per optimizer step on the simulated card (runner/memory/cuda_sim.py), the mean over the steps after the
first (which creates the optimizer state), as ``s_per_step`` is.
``clip_score`` / ``dino_score`` and the base model's ``base_clip_score`` / ``base_dino_score`` come from the
job's scores.json (``val.scores``, runner/val/scores.py); ``score_weights`` says whether they were random test weights.
``sweep.png`` plots every job's loss and its planned and measured peak (runner/output/plots.py).
"""
from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.errors import UserError

log = logging.getLogger("runner")


JOB_SUMMARY = "job_summary.json"


SWEEP_CSV = "sweep_summary.csv"


STATUSES = ("ok", "pruned", "does_not_fit", "killed", "oom", "failed", "interrupted", "nonfinite", "io_error")


# val.scores (runner/val/scores.py): the last samples' scores and the base model's (step 0) beside them
SCORE_COLUMNS = ("clip_score", "base_clip_score", "dino_score", "base_dino_score", "score_weights")


COLUMNS = ("job", "status", "overrides", "steps_done", "final_loss", "final_loss_steps", "val_loss", *SCORE_COLUMNS,
           "s_per_step", "peak_memory_gb",
           "peak_memory_source", "planned_peak_gb", "host_rss_peak_gb", "micro_batch_size", "nonfinite_skips", "exit_code",
           "error", "dir")


FINAL_LOSS_SHARE = 0.1  # final_loss: the mean loss of the last 10% of steps


def final_loss(losses: list[Any]) -> tuple[float | None, int]:
    """The mean of the finite losses among the last 10% of steps (at least one step), and how many
    steps that is. One step's loss is one batch's: noise, not where the run ended."""
    k = max(1, int(len(losses) * FINAL_LOSS_SHARE))
    tail = [v for v in losses[-k:] if isinstance(v, (int, float)) and math.isfinite(v)]
    return (sum(tail) / len(tail) if tail else None), k


def peak_memory(out: Path, rows: list[dict[str, Any]]) -> tuple[float | None, str | None]:
    """The job's peak device memory in GiB and where it comes from.

    CUDA: the allocator's peak allocated bytes (``memory_peak_gb``). A CPU run has no device
    allocator, and its process RSS counts the interpreter and every library, so it is not the
    figure to compare with a GPU job or a plan: the tracked peak of the memory profile when the run
    was profiled, else the preflight plan's device peak, else nothing (``host_rss_peak_gb`` keeps
    the RSS in its own column)."""
    from runner.output.plots import GIB, planned_peak_bytes, tracked_peaks

    cuda_peaks = [r["memory_peak_gb"] for r in rows if r.get("memory_peak_gb") is not None]
    if cuda_peaks and any(r.get("memory_source") == "cuda_sim" for r in rows):
        return max(cuda_peaks), "cuda_sim: live tensor bytes on the simulated card (train.device=cuda_sim)"
    if cuda_peaks:
        return max(cuda_peaks), "cuda max allocated"
    tracked = tracked_peaks(out)
    if tracked:
        return max(tracked.values()) / GIB, f"tracked live tensors (memory profile, steps {min(tracked)}-{max(tracked)})"
    planned = planned_peak_bytes(out)
    if planned is not None:
        return planned / GIB, "planned device peak (preflight plan; CPU run, not measured)"
    return None, None


def summarize_metrics(out: Path) -> dict[str, Any]:
    """Steps done, final loss (mean of the last 10% of steps), s/step (first step excluded: warm-up),
    peak memory (see :func:`peak_memory`), planned peak, host RSS peak, last micro-batch."""
    from runner.output.plots import GIB, planned_peak_bytes
    from runner.output.report import read_metrics

    path = out / "metrics.jsonl"
    rows = read_metrics(path) if path.is_file() else []
    planned = planned_peak_bytes(out)
    planned_gb = None if planned is None else planned / GIB
    if not rows:
        return {"steps_done": 0, "final_loss": None, "final_loss_steps": 0, "val_loss": None, "s_per_step": None, "peak_memory_gb": None,
                "peak_memory_source": None, "planned_peak_gb": planned_gb, "host_rss_peak_gb": None,
                "micro_batch_size": None, "nonfinite_skips": None, "host_syncs_per_step": None, "card_ops_per_step": None}
    times = [r["s_per_step"] for r in rows]
    tail = times[1:] or times
    loss, k = final_loss([r.get("loss") for r in rows])
    peak, source = peak_memory(out, rows)
    rss = [r["host_rss_gb"] for r in rows if r.get("host_rss_gb") is not None]
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]  # the last held-out loss
    return {"steps_done": rows[-1]["step"], "final_loss": loss, "final_loss_steps": k, "val_loss": val[-1] if val else None,
            "s_per_step": sum(tail) / len(tail),
            "peak_memory_gb": peak, "peak_memory_source": source, "planned_peak_gb": planned_gb,
            "host_rss_peak_gb": max(rss) if rss else None, "micro_batch_size": rows[-1].get("micro_batch_size"),
            "nonfinite_skips": rows[-1].get("nonfinite_skips"), **per_step_counts(rows)}


def read_scores(out: Path) -> dict[str, Any]:
    """The SCORE_COLUMNS of the run's scores.json (``val.scores``), all None when it has none.
    ``score_weights``: ``given`` (val.score_models.* folders) or which scores came from random test weights."""
    from runner.val.config import SCORES_JSON

    path = out / SCORES_JSON
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    row: dict[str, Any] = {c: data.get(c) for c in SCORE_COLUMNS[:-1]}
    random = data.get("random_weights")
    row["score_weights"] = None if not data else (f"random: {'+'.join(random)} (plumbing only)" if random else "given")
    return row


def per_step_counts(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """``host_syncs_per_step`` and ``card_ops_per_step``: the mean of the metrics' per-step counts over the
    steps after the first (the first creates the optimizer state); None where the run counted none."""
    out: dict[str, float | None] = {}
    for column in ("host_syncs", "card_ops"):
        counts = [r[column] for r in rows if r.get(column) is not None]
        tail = counts[1:] or counts
        out[f"{column}_per_step"] = sum(tail) / len(tail) if tail else None
    return out


def plot_job(cfg: DictConfig) -> None:
    """``loss.png`` in the job's directory when it trained (runner/output/plots.py); never raises."""
    from runner.output.config import output_dir
    from runner.output.plots import LOSS_PNG, safely, write_loss_plot

    if str(cfg.get("mode", "train")) != "train":
        return
    try:
        out = output_dir(cfg)
    except UserError:
        return
    safely(LOSS_PNG, lambda: write_loss_plot(out, cfg))


def write_job_summary(cfg: DictConfig, status: str, error: str | None, exit_code: int, num: int | None,
                      overrides: list[str], wall_s: float) -> dict[str, Any] | None:
    """Write the job's job_summary.json (rank 0); the summary, or None where there is no output folder."""
    from runner.output.config import output_dir
    from runner.distributed.launch import process_world

    if process_world().rank != 0:  # several processes: rank 0 writes the run's files (runner/distributed/launch.py)
        return None
    try:
        out = output_dir(cfg)
    except UserError:  # no output directory (not under Hydra, none configured): nothing to write into
        return None
    from runner.output.report import json_text, write_text_atomic

    out.mkdir(parents=True, exist_ok=True)
    summary = {"job": num, "status": status, "overrides": overrides, **summarize_metrics(out), **read_scores(out),
               "exit_code": exit_code, "error": error, "dir": str(out), "wall_s": round(wall_s, 3)}
    path = out / JOB_SUMMARY
    write_text_atomic(path, json_text(summary, indent=2) + "\n")  # valid JSON even for a NaN loss, never torn
    return summary


# ---- the sweep ---------------------------------------------------------------------------------
def job_dirs(sweep_dir: Path, num: int) -> list[Path]:
    """The folders of job ``num`` in the sweep (named ``<num>`` or ``<num>_<swept values>``)."""
    return [d for d in sweep_dir.iterdir() if d.is_dir() and d.name.split("_", 1)[0] == str(num)]


def mark_killed(sweep_dir: Path, num: int) -> None:
    """Job ``num`` ran when its sweep was killed: its job_summary.json says ``killed`` (with the steps it did),
    so the resumed sweep's table shows it, and it does not count as a failure of the sweep that replaced it."""
    from omegaconf import OmegaConf

    from runner.output.report import json_text, write_text_atomic

    for d in job_dirs(sweep_dir, num):
        if (d / JOB_SUMMARY).is_file() or not (d / ".hydra" / "overrides.yaml").is_file():
            continue
        summary = {"job": num, "status": "killed", "overrides": list(OmegaConf.load(d / ".hydra" / "overrides.yaml")),
                   **summarize_metrics(d), **read_scores(d), "exit_code": None,
                   "error": "the sweep was killed while this job ran; the resumed sweep marked its trial failed and ran "
                            "another in its place", "dir": str(d), "wall_s": None}
        write_text_atomic(d / JOB_SUMMARY, json_text(summary, indent=2) + "\n")


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory of the sweep (a directory with Hydra's ``.hydra/``), by job number.

    A job that wrote no job_summary.json (killed from outside, e.g. by the kernel's OOM killer)
    is listed with status ``unknown``.
    """
    rows = []
    for d in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        summary = d / JOB_SUMMARY
        if summary.is_file():
            rows.append(json.loads(summary.read_text()))
        elif (d / ".hydra" / "overrides.yaml").is_file():
            from omegaconf import OmegaConf

            overrides = list(OmegaConf.load(d / ".hydra" / "overrides.yaml"))
            prefix = d.name.split("_", 1)[0]
            rows.append({"job": int(prefix) if prefix.isdigit() else None, "status": "unknown", "overrides": overrides,
                         "error": "no job_summary.json: the job was killed or crashed hard", "dir": str(d)})
    rows.sort(key=lambda r: (r.get("job") is None, r.get("job") or 0, r.get("dir", "")))
    return rows


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, "overrides": " ".join(r.get("overrides") or [])})


def _fmt(value: Any, spec: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec) if spec else str(value)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The sweep as a text table; overrides shared by every job are listed once above it."""
    lists = [r.get("overrides") or [] for r in rows]
    common = [o for o in lists[0] if all(o in other for other in lists[1:])] if len(lists) > 1 else []
    scored = [n for n in ("clip", "dino") if any(r.get(f"{n}_score") is not None for r in rows)]  # val.scores
    header = ("job", "status", "overrides", "steps", "loss (last 10%)", "val_loss", *(f"{n} (base)" for n in scored),
              "s/step", "peak GiB", "planned GiB", "micro", "error")
    body = []
    for r, overrides in zip(rows, lists):
        error = (r.get("error") or "").replace("\n", " ")
        own = " ".join(o for o in overrides if o not in common) or "-"
        body.append((_fmt(r.get("job")), r.get("status", "?"), own,
                     _fmt(r.get("steps_done")), _fmt(r.get("final_loss"), ".4f"), _fmt(r.get("val_loss"), ".4f"),
                     *(f"{_fmt(r.get(f'{n}_score'), '.4f')} ({_fmt(r.get(f'base_{n}_score'), '.4f')})" for n in scored),
                     _fmt(r.get("s_per_step"), ".3f"),
                     _fmt(r.get("peak_memory_gb"), ".2f"), _fmt(r.get("planned_peak_gb"), ".2f"),
                     _fmt(r.get("micro_batch_size")),
                     error[:70] + ("..." if len(error) > 70 else "")))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = [f"common overrides: {' '.join(common)}"] if common else []
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(line.rstrip() for line in lines)
