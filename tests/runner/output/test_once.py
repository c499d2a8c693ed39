"""Each warning once per job (runner/output/once.py), and a preset's budget yielding to device.name."""
from __future__ import annotations

import logging

from bad_input import run_main

from runner.output.once import WarnOnce


def _record(level: int, text: str, **extra) -> logging.LogRecord:
    record = logging.LogRecord("runner", level, __file__, 1, text, None, None)
    record.__dict__.update(extra)
    return record


def test_a_warning_passes_once_and_other_records_always(monkeypatch):
    import runner.output.once as once

    monkeypatch.setattr(once, "_job", lambda: "job0")
    f = WarnOnce()
    assert f.filter(_record(logging.WARNING, "w")) and not f.filter(_record(logging.WARNING, "w"))
    assert f.filter(_record(logging.INFO, "i")) and f.filter(_record(logging.INFO, "i"))
    assert f.filter(_record(logging.INFO, "o", once=True)) and not f.filter(_record(logging.INFO, "o", once=True))
    assert f.filter(_record(logging.WARNING, "w2"))


def test_a_sweeps_next_job_says_its_warnings_again(monkeypatch):
    import runner.output.once as once

    f = WarnOnce()
    monkeypatch.setattr(once, "_job", lambda: None)  # the entry point's check, before the first job
    assert f.filter(_record(logging.WARNING, "w")) and not f.filter(_record(logging.INFO, "i", once=True))  # held
    monkeypatch.setattr(once, "_job", lambda: "job0")  # the first job: what the entry said counts as said
    assert not f.filter(_record(logging.WARNING, "w")) and not f.held  # the held line went out with the job's logging
    monkeypatch.setattr(once, "_job", lambda: "job1")
    assert f.filter(_record(logging.WARNING, "w")) and not f.filter(_record(logging.WARNING, "w"))


def _plan(tmp_path, caplog, *args: str) -> str:
    """Everything the plan said: the entry point's check (before Hydra's logging: caplog here, the console in a
    shell), the console and the job's log."""
    caplog.set_level(logging.INFO, logger="runner")
    out = run_main(["+preset=sdxl_24gb", "mode=plan", "device.name=rtx3060_12gb", f"output_dir={tmp_path / 'o'}",
                    f"hydra.run.dir={tmp_path / 'h'}", *args])
    assert out.code == 0, out.text[-2000:]
    return caplog.text + out.text + (tmp_path / "h" / "__main__.log").read_text()


def test_the_presets_budget_yields_to_the_named_card_without_a_warning(tmp_path, caplog):
    text = _plan(tmp_path, caplog)
    assert "budget_gb=24 (the preset's) yields to device.name=rtx3060_12gb" in text
    assert "is more than" not in text


def test_a_typed_budget_over_the_card_is_warned_about_once(tmp_path, caplog):
    text = _plan(tmp_path, caplog, "budget_gb=24")
    assert text.count("budget_gb=24 is more than") == 1 and "yields" not in text


def test_a_line_held_before_a_later_job_is_logged_with_it(monkeypatch, caplog):
    import runner.output.once as once

    f = WarnOnce()
    monkeypatch.setattr(once, "_job", lambda: "job0")
    assert f.filter(_record(logging.WARNING, "w"))
    monkeypatch.setattr(once, "_job", lambda: None)  # the next command's check, in the same process (tests, a sweep)
    assert not f.filter(_record(logging.INFO, "held for job1", once=True))
    assert f.filter(_record(logging.WARNING, "said before job1"))
    monkeypatch.setattr(once, "_job", lambda: "job1")
    caplog.set_level(logging.INFO, logger="runner")
    assert f.filter(_record(logging.INFO, "anything"))  # job1's first line releases what was held for it
    assert "held for job1" in caplog.text and not f.held
    assert f.filter(_record(logging.WARNING, "w")) and not f.filter(_record(logging.WARNING, "said before job1"))
