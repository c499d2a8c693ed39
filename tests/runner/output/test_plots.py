"""runner.output.plots: loss.png of a run and sweep.png of a sweep, from the files a run writes.

Pictures are checked as files (a PNG of the expected size); the numbers drawn come from plain
functions checked by value: the smoothing, the history of a resumed run, the planned and the
tracked peaks. A failure to plot is one warning, never an error.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from PIL import Image

from runner.output import jobs, plots
from runner.output.plots import (
    GIB,
    loss_history,
    no_plan_reason,
    planned_peak_bytes,
    smooth,
    smoothing_span,
    tracked_peaks,
    write_loss_plot,
    write_sweep_plot,
)


def write_rows(out: Path, rows: list[dict], resume: str | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "resolved_config.yaml").write_text(OmegaConf.to_yaml({"train": {"resume": resume, "preflight": True}}))


def cpu_row(step: int, loss: float | None, **extra) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-4, "s_per_step": 0.5, "mem_allocated_gb": None,
            "mem_reserved_gb": None, "memory_peak_gb": None, "host_rss_gb": 1.0 + step / 100, **extra}


def cuda_row(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-4, "s_per_step": 0.5, "mem_allocated_gb": 3.0 + step / 10,
            "mem_reserved_gb": 4.0, "memory_peak_gb": 5.0, "host_rss_gb": 2.0}


def png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as im:
        im.verify()
        return im.size


def test_smoothing_is_a_debiased_ema_that_skips_missing_values():
    assert smooth([1.0, None, 3.0], span=1) == [1.0, 1.0, 3.0]
    out = smooth([1.0, 3.0, float("nan")], span=3)  # alpha 0.5
    assert out[0] == 1.0 and math.isclose(out[1], (0.25 * 1 + 0.5 * 3) / 0.75) and out[2] == out[1]
    assert smooth([None], span=5) == [None]
    assert [smoothing_span(n) for n in (1, 3, 25, 100, 5000)] == [1, 3, 5, 10, 100]


def test_a_resumed_run_is_one_curve_through_each_runs_resume(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    write_rows(a, [cpu_row(s, 1.0) for s in range(1, 6)])  # a got to step 5, its checkpoint of step 3 was resumed
    write_rows(b, [cpu_row(s, 2.0) for s in range(4, 8)], resume=str(a / "checkpoints" / "step-00000003"))
    write_rows(c, [cpu_row(s, 3.0) for s in range(8, 10)], resume=str(b))
    rows, seams = loss_history(c, str(b))
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0), (6, 2.0),
                                                       (7, 2.0), (8, 3.0), (9, 3.0)]
    assert seams == [3, 7]
    # resumed into its own folder: metrics.jsonl already holds every step once
    assert loss_history(a, str(a)) == ([cpu_row(s, 1.0) for s in range(1, 6)], [])


def test_planned_and_tracked_peaks_come_from_the_runs_files(tmp_path):
    assert planned_peak_bytes(tmp_path) is None and tracked_peaks(tmp_path) == {}
    (tmp_path / "plan.json").write_text(json.dumps({"peak_bytes": 3 * GIB, "required_bytes": 3 * GIB + 1}))
    (tmp_path / "memory_timeline.json").write_text(json.dumps({"points": [
        {"step": 2, "point": "step_start", "peak_live_bytes_since_previous": 10},
        {"step": 2, "point": "after_backward", "peak_live_bytes_since_previous": 30},
        {"step": 3, "point": "after_backward", "peak_live_bytes_since_previous": 20}]}))
    assert planned_peak_bytes(tmp_path) == 3 * GIB
    assert tracked_peaks(tmp_path) == {2: 30, 3: 20}
    assert "train.preflight=false" in no_plan_reason(OmegaConf.create({"train": {"preflight": False}}))
    assert "could not simulate" in no_plan_reason(OmegaConf.create({"train": {"preflight": True}}))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_loss_png_of_a_cpu_and_a_cuda_run(tmp_path, device):
    rows = ([cpu_row(s, 1.0 / s if s != 4 else None, **({"val_loss": 0.5} if s % 5 == 0 else {})) for s in range(1, 21)]
            if device == "cpu" else [cuda_row(s, 1.0 / s) for s in range(1, 21)])
    write_rows(tmp_path, rows)
    (tmp_path / "plan.json").write_text(json.dumps({"peak_bytes": 2 * GIB}))
    cfg = OmegaConf.create({"train": {"resume": None, "preflight": True}, "budget_gb": 24, "preset": "sdxl_24gb"})
    path = write_loss_plot(tmp_path, cfg)
    assert path == tmp_path / "loss.png" and png_size(path) == (900, 700)
    mtime = path.stat().st_mtime_ns
    assert write_loss_plot(tmp_path, cfg) == path and path.stat().st_mtime_ns == mtime  # up to date: not redrawn


def test_no_metrics_no_picture_and_a_failing_plot_is_a_warning(tmp_path, monkeypatch, caplog):
    assert write_loss_plot(tmp_path) is None and not (tmp_path / "loss.png").exists()
    write_rows(tmp_path, [cpu_row(1, 0.5)])

    def broken(*a, **k):
        raise RuntimeError("no backend")

    monkeypatch.setattr(plots, "new_figure", broken)
    cfg = OmegaConf.create({"mode": "train", "output_dir": str(tmp_path), "train": {"preflight": True, "resume": None}})
    with caplog.at_level(logging.WARNING, logger="runner"):
        jobs.plot_job(cfg)  # the hook run_job calls, however a job ended: must not raise
    assert "could not write loss.png (RuntimeError: no backend)" in caplog.text
    assert not (tmp_path / "loss.png").exists()


def test_sweep_png_and_the_summary_columns(tmp_path):
    rows = []
    for job, (device, loss) in enumerate([("cpu", 0.9), ("cuda", 0.5), ("cpu", 0.7)]):
        d = tmp_path / f"{job}_x={job}"
        make = cpu_row if device == "cpu" else cuda_row
        write_rows(d, [make(s, loss + 1 / s) for s in range(1, 21)])
        if job < 2:
            (d / "plan.json").write_text(json.dumps({"peak_bytes": (job + 1) * GIB}))
        summary = {"job": job, "status": "ok", "overrides": [f"x={job}", "train.steps=20"], "dir": str(d),
                   **jobs.summarize_metrics(d)}
        (d / jobs.JOB_SUMMARY).write_text(json.dumps(summary))
        rows.append(summary)
    cpu_planned, cuda_job, cpu_unplanned = rows
    assert math.isclose(cpu_planned["final_loss"], 0.9 + (1 / 19 + 1 / 20) / 2) and cpu_planned["final_loss_steps"] == 2
    assert cpu_planned["peak_memory_gb"] == 1.0 and cpu_planned["peak_memory_source"].startswith("planned device peak")
    assert cpu_planned["host_rss_peak_gb"] == 1.2 and cpu_planned["planned_peak_gb"] == 1.0
    assert (cuda_job["peak_memory_gb"], cuda_job["peak_memory_source"], cuda_job["planned_peak_gb"]) == (
        5.0, "cuda max allocated", 2.0)
    assert cpu_unplanned["peak_memory_gb"] is None and cpu_unplanned["peak_memory_source"] is None
    path = write_sweep_plot(jobs.collect(tmp_path), tmp_path / "sweep.png")
    assert png_size(path) == (1300, 550)


def test_final_loss_is_the_mean_of_the_last_tenth_with_at_least_one_step():
    assert jobs.final_loss([1.0, 2.0, 3.0]) == (3.0, 1)
    assert jobs.final_loss([float(i) for i in range(1, 101)]) == (sum(range(91, 101)) / 10, 10)
    assert jobs.final_loss([1.0] * 18 + [None, 4.0]) == (4.0, 2)  # a non-finite step is left out
    assert jobs.final_loss([None]) == (None, 1)


def test_the_summary_of_a_profiled_cpu_run_is_its_tracked_peak(tmp_path):
    write_rows(tmp_path, [cpu_row(s, 1.0) for s in range(1, 4)])
    (tmp_path / "plan.json").write_text(json.dumps({"peak_bytes": GIB}))
    (tmp_path / "memory_timeline.json").write_text(json.dumps({"points": [
        {"step": 1, "point": "after_backward", "peak_live_bytes_since_previous": GIB // 2},
        {"step": 2, "point": "after_backward", "peak_live_bytes_since_previous": GIB // 4}]}))
    s = jobs.summarize_metrics(tmp_path)
    assert s["peak_memory_gb"] == 0.5 and s["peak_memory_source"] == "tracked live tensors (memory profile, steps 1-2)"
    assert s["planned_peak_gb"] == 1.0
    os.remove(tmp_path / "metrics.jsonl")
    assert jobs.summarize_metrics(tmp_path)["steps_done"] == 0
