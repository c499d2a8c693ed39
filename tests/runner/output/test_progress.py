"""runner.output.progress: tqdm on a terminal, a plain log line every log.every steps otherwise; the same
lines always reach the job's log file (Hydra's __main__.log, a FileHandler of the root logger)."""
from __future__ import annotations

import io
import logging

import pytest
from omegaconf import OmegaConf

from runner.output import progress
from runner.output.progress import Progress, build_progress, log_to_files


@pytest.fixture
def handlers(tmp_path):
    """A console (stream) handler and a file handler on the root logger, as Hydra's job logging has."""
    root = logging.getLogger()
    console_buf = io.StringIO()
    console = logging.StreamHandler(console_buf)
    file = logging.FileHandler(tmp_path / "__main__.log")
    old_level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(console)
    root.addHandler(file)
    yield console_buf, tmp_path / "__main__.log", file
    root.removeHandler(console)
    root.removeHandler(file)
    file.close()
    root.setLevel(old_level)


def feed(p: Progress, steps: range) -> None:
    for s in steps:
        p.update(s, 1.0 / s, 1e-4, 0.1, {"rss": "1.00G", "pressure": "low"})


def test_without_a_terminal_a_line_every_n_steps_and_the_first_and_last(handlers):
    console, log_file, _ = handlers
    p = build_progress(OmegaConf.create({"train": {"steps": 25, "progress": True}, "log": {"every": 10}}), initial=0)
    assert p.bar is None  # pytest's stderr is not a terminal
    feed(p, range(1, 26))
    p.close()
    lines = [ln for ln in console.getvalue().splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["1/25", "10/25", "20/25", "25/25"]
    assert "loss 0.1000 (mean of the last 10: " in lines[1] and "rss 1.00G" in lines[1] and "eta " in lines[1]
    assert "\r" not in console.getvalue()
    assert [ln for ln in log_file.read_text().splitlines() if ln.startswith("step ")] == lines


def test_a_resumed_run_prints_its_first_step(handlers):
    console, _, _ = handlers
    p = Progress(total=100, initial=42, every=10, bar=False)
    feed(p, range(43, 51))
    assert [ln.split()[1] for ln in console.getvalue().splitlines()] == ["43/100", "50/100"]


def test_on_a_terminal_the_bar_shows_and_the_lines_go_to_the_file_only(handlers, monkeypatch):
    console, log_file, _ = handlers
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    p = build_progress(OmegaConf.create({"train": {"steps": 4, "progress": True}, "log": {"every": 2}}), initial=0)
    assert p.bar is not None
    feed(p, range(1, 5))
    p.close()
    assert console.getvalue() == ""
    assert [ln.split()[1] for ln in log_file.read_text().splitlines()] == ["1/4", "2/4", "4/4"]
    off = build_progress(OmegaConf.create({"train": {"steps": 4, "progress": False}, "log": {"every": 2}}), initial=0)
    assert off.bar is None  # train.progress=false: no bar; the log lines stay


def test_log_to_files_skips_the_console(handlers):
    console, log_file, _ = handlers
    log_to_files("summary:\nsteps: 3")
    assert console.getvalue() == "" and log_file.read_text() == "summary:\nsteps: 3\n"
