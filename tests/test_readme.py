"""The README's "Using it" block, command by command, so the README cannot drift from the runner.

Each command runs as written except where it names what this machine has not got: a model folder
(``model.path=``) and a data folder (``data.path=``) are dropped (the tiny default's built-in
data), ``model.size=full`` becomes ``tiny``, and a training command trains 2 steps on the CPU. The
queries (``--help``, ``--version``, ``--cfg job``, ``mode=plugins``) run unchanged. A command the
README adds that this parser does not understand fails the test rather than being skipped.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUERIES = ("--help", "--version", "--cfg", "mode=plugins", "mode=plan")
DROPPED = ("model.path=", "data.path=")
TRAINING = ["train.device=cpu", "train.progress=false", "data.demo_size=4", "train.steps=2"]


def using_it() -> list[str]:
    """The commands of the README's "Using it" code block, comments stripped."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^## Using it\n+```bash\n(.*?)^```", text, re.S | re.M)
    assert block, "README.md has no '## Using it' bash block"
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def runnable(command: str) -> list[str]:
    """The command's arguments as this machine can run them (module docstring)."""
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "runner"], f"not a runner command: {command}"
    args = [a for a in args[3:] if not a.startswith(DROPPED)]
    args = ["model.size=tiny" if a == "model.size=full" else a for a in args]
    if any(a.startswith(QUERIES) for a in args):
        return args
    return [a for a in args if not a.startswith("train.steps=")] + TRAINING


def test_the_block_is_what_the_readme_shows():
    """The parser finds the block's every command (a README edit that hid them would pass vacuously)."""
    commands = using_it()
    assert len(commands) >= 10 and all(c.startswith("python -m runner") for c in commands), commands


@pytest.mark.slow
@pytest.mark.parametrize("command", using_it())
def test_every_using_it_command_runs_on_the_tiny_default(command, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "runner", *runnable(command)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{command}\n-> {runnable(command)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stdout + r.stderr
