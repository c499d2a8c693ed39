"""Run ``python -m runner`` in this process and check that a bad input fails cleanly.

In-process because the corpus has dozens of cases and a fresh interpreter costs seconds each;
the entry point is the same (``runner.__main__.main`` with ``sys.argv``), Hydra included. A
failure is clean when the exit status is non-zero, nothing printed a traceback, and the message
names the problem.
"""
from __future__ import annotations

import io
import os
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def run_main(args: list[str], cwd: Path | None = None) -> Result:
    """``python -m runner *args`` in this process: its exit status and what it printed."""
    from hydra.core.global_hydra import GlobalHydra

    import runner.__main__ as entry

    argv, here = sys.argv, os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    code = 0
    sys.argv = ["runner", *args]
    try:
        if cwd is not None:
            os.chdir(cwd)
        with redirect_stdout(out), redirect_stderr(err):
            try:
                entry.main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # escaped the entry point: what the user would see as a traceback
                traceback.print_exc(file=err)
                code = 1
    finally:
        sys.argv = argv
        os.chdir(here)
        GlobalHydra.instance().clear()
    return Result(code, out.getvalue(), err.getvalue())


def assert_clean_failure(result: Result, *needles: str) -> None:
    """Non-zero exit, no traceback, and every needle in the message."""
    assert result.code != 0, result.text[-3000:]
    assert "Traceback" not in result.text, result.text[-3000:]
    for needle in needles:
        assert needle in result.err, (needle, result.err[-3000:])
