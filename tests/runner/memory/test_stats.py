"""Live memory statistics: pressure levels and their warnings, CPU honesty, metrics columns, CUDA figures."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import psutil
import pytest
import torch

from runner.cli.compose import compose_config
from runner.memory.stats import (
    GIB,
    MemoryMonitor,
    PressureMonitor,
    fragmentation,
    pressure_level,
)
from runner.output.report import read_metrics

ASSETS = Path(__file__).resolve().parents[3] / "tests" / "assets"
COLUMNS = ("memory_in_use_gb", "memory_peak_gb", "host_rss_gb", "mem_allocated_gb", "mem_reserved_gb",
           "mem_peak_reserved_gb", "mem_fragmentation", "cuda_alloc_retries", "cuda_ooms", "mem_budget_gb",
           "mem_budget_used", "mem_pressure")
DEVICE_ONLY = ("memory_peak_gb", "mem_allocated_gb", "mem_reserved_gb", "mem_peak_reserved_gb", "mem_fragmentation",
               "cuda_alloc_retries", "cuda_ooms")


@pytest.mark.parametrize("fraction, level", [(0.0, "low"), (0.5999, "low"), (0.60, "medium"), (0.7499, "medium"),
                                             (0.75, "high"), (0.8999, "high"), (0.90, "critical"), (1.7, "critical")])
def test_pressure_thresholds(fraction, level):
    assert pressure_level(fraction) == level


def test_warns_once_per_level_change(caplog):
    caplog.set_level(logging.INFO, logger="runner")
    monitor = PressureMonitor(budget_bytes=1000, budget_source="budget_gb=test")
    used = [100, 800, 800, 850, 950, 990, 700, 500, 800]  # low high high high critical critical medium low high
    levels = [monitor.update(u, step)[0] for step, u in enumerate(used, 1)]
    assert levels == ["low", "high", "high", "high", "critical", "critical", "medium", "low", "high"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings
    assert warnings[0].startswith("memory pressure high at step 2: ") and "80%" in warnings[0]
    assert warnings[1].startswith("memory pressure critical at step 5")
    assert warnings[2].startswith("memory pressure high at step 9")
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["memory pressure back to medium at step 7 (70% of budget_gb=test)"]


def test_fragmentation():
    assert fragmentation(reserved=100, allocated=60) == pytest.approx(0.4)
    assert fragmentation(reserved=64, allocated=64) == 0.0
    assert fragmentation(reserved=0, allocated=0) is None


def test_cpu_sample_reports_rss_and_no_invented_device_figures():
    monitor = MemoryMonitor(torch.device("cpu"), budget_gb=None)
    before = psutil.Process().memory_info().rss
    row = monitor.sample(step=1)
    after = psutil.Process().memory_info().rss
    assert set(row) == set(COLUMNS)
    assert all(row[k] is None for k in DEVICE_ONLY)
    assert before / GIB <= row["host_rss_gb"] <= after / GIB
    assert row["memory_in_use_gb"] == row["host_rss_gb"]
    # No budget_gb: the budget is the host's RAM.
    assert row["mem_budget_gb"] == pytest.approx(psutil.virtual_memory().total / GIB)
    assert row["mem_budget_used"] == pytest.approx(row["host_rss_gb"] / row["mem_budget_gb"])
    assert MemoryMonitor.postfix(row) == {"rss": f"{row['host_rss_gb']:.2f}G", "pressure": row["mem_pressure"]}


def test_postfix_on_cuda_rows():
    row = {"mem_allocated_gb": 1.5, "mem_reserved_gb": 2.0, "memory_peak_gb": 1.75,
           "mem_fragmentation": 0.25, "mem_pressure": "medium", "host_rss_gb": 3.0}
    assert MemoryMonitor.postfix(row) == {"mem": "1.50/2.00G", "peak": "1.75G", "frag": "25%", "pressure": "medium"}


def test_run_writes_the_columns_and_warns_once(tmp_path, caplog):
    """A 3-step CPU run with a budget far below the process's RSS: critical every step, one warning."""
    from runner.__main__ import task

    caplog.set_level(logging.WARNING, logger="runner")
    sys.path.insert(0, str(ASSETS))
    try:
        task(compose_config(["trainer=custom", "trainer._target_=custom_trainer.PixelDiffusionTrainer",
                            "data.resolution=16", "train.steps=3", "train.progress=false", "budget_gb=0.01",
                            f"output_dir={tmp_path}"]))
    finally:
        sys.path.remove(str(ASSETS))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 3
    for r in rows:
        assert set(COLUMNS) <= set(r)
        assert all(r[k] is None for k in DEVICE_ONLY)  # CPU: no device allocator to report
        assert r["host_rss_gb"] > 0.01 and r["mem_budget_gb"] == pytest.approx(0.01)
        assert r["mem_pressure"] == "critical" and r["mem_budget_used"] > 1
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory pressure")]
    assert len(warnings) == 1 and "critical at step 1" in warnings[0] and "budget_gb=0.01" in warnings[0]


@pytest.mark.gpu
def test_cuda_figures_come_from_the_allocator():
    from runner.guards.oom import is_out_of_memory

    dev = torch.device("cuda")
    torch.cuda.init()
    torch.cuda.reset_peak_memory_stats(dev)
    monitor = MemoryMonitor(dev, budget_gb=None)
    base = torch.cuda.memory_allocated(dev)
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    small = torch.empty(2**20, dtype=torch.uint8, device=dev)
    del big
    row = monitor.sample(step=1)
    assert row["mem_allocated_gb"] == pytest.approx(torch.cuda.memory_allocated(dev) / GIB)
    assert row["mem_reserved_gb"] >= row["mem_allocated_gb"]
    assert row["memory_peak_gb"] >= (base + (256 + 1) * 2**20) / GIB  # big and small were alive together
    assert row["mem_peak_reserved_gb"] >= row["mem_reserved_gb"]
    assert row["mem_fragmentation"] == pytest.approx(
        (row["mem_reserved_gb"] - row["mem_allocated_gb"]) / row["mem_reserved_gb"])
    assert row["mem_budget_gb"] == pytest.approx(torch.cuda.get_device_properties(dev).total_memory / GIB)
    assert row["mem_budget_used"] == pytest.approx(row["mem_reserved_gb"] / row["mem_budget_gb"])
    assert row["cuda_ooms"] == 0
    with pytest.raises(torch.OutOfMemoryError) as e:
        torch.empty(2 * torch.cuda.get_device_properties(dev).total_memory, dtype=torch.uint8, device=dev)
    assert is_out_of_memory(e.value)
    assert monitor.sample(step=2)["cuda_ooms"] == 1  # counted since the monitor started
    del small
