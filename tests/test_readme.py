"""The commands of the README and of docs/guide/, so the front door cannot drift from the runner.

Two checks. Every documented runner command composes in-process, as ``python -m runner`` would
compose it (fast tier): ``python -m runner ARGS``, ``torchrun ... -m runner ARGS``, ``accelerate launch
... -m runner ARGS`` and those behind ``VAR=value`` prefixes, from ```bash blocks (a ``\\`` joins lines,
``#`` starts a comment) and from inline `python -m runner ...` spans. ``--help`` must answer with its
text, ``--version`` with the version line; a ``-m`` sweep composes each combination (up to the
pre-check's cap). Documented rules for what does not compose here:

- a command with a placeholder (``...``, ``/abs/``) is parsed by Hydra's override grammar only (a bare
  ``...`` left out, one inside a value read as a word), since what it stands for exists only on the
  user's machine;
- any other shell command (``make``, ``pip``, ``hf``, a script of your own) is skipped: it is not the
  runner's to check (the Makefile's targets are run by CI itself).

Second, the README's "Using it" block runs command by command on the tiny default (slow tier): a model
folder (``model.path=``) and a data folder (``data.path=``) are dropped, ``model.size=full`` becomes
``tiny``, and a training command trains 2 steps on the CPU. The queries (``--help``, ``--version``,
``--cfg job``, ``mode=plugins``, ``mode=plan``, ``mode=fit``) run unchanged.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
QUERIES = ("--help", "--version", "--cfg", "mode=plugins", "mode=plan", "mode=fit")
DROPPED = ("model.path=", "data.path=")
TRAINING = ["train.device=cpu", "train.progress=false", "data.demo_size=4", "train.steps=2"]
PLACEHOLDERS = ("...", "/abs/")
LAUNCHERS = (["torchrun"], ["accelerate", "launch"])
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")


class Command(NamedTuple):
    where: str  # page:line
    text: str


def using_it() -> list[str]:
    """The commands of the README's "Using it" code block, comments stripped."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^## Using it\n+```bash\n(.*?)^```", text, re.S | re.M)
    assert block, "README.md has no '## Using it' bash block"
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def documented_commands(page: Path) -> list[Command]:
    """Every command of a page's ```bash blocks, and its inline runner commands (module docstring)."""
    text, found = page.read_text(), []
    name = page.relative_to(ROOT).as_posix()
    for block in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M):
        first = text.count("\n", 0, block.start(1)) + 1
        for at, line in _logical_lines(block.group(1)):
            if shlex.split(line, comments=True):
                found.append(Command(f"{name}:{first + at}", line.strip()))
    outside = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    for span in re.finditer(r"`([^`]+)`", outside):
        command = " ".join(span.group(1).split())
        if command.startswith(("python -m runner", "torchrun ", "accelerate launch ")):
            found.append(Command(f"{name}:{outside.count(chr(10), 0, span.start()) + 1}", command))
    return found


def _logical_lines(block: str) -> list[tuple[int, str]]:
    """(line index, text) of a shell block's commands, ``\\`` continuations joined."""
    out, start, parts = [], 0, []
    for i, line in enumerate(block.split("\n")):
        if not parts:
            start = i
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        out.append((start, " ".join(parts)))
        parts = []
    return out


ALL = [c for page in PAGES for c in documented_commands(page)]


def runner_args(command: str) -> list[str] | None:
    """The arguments the runner gets from a documented command, or None when it is not the runner's."""
    tokens = shlex.split(command, comments=True)
    while tokens and ENV.match(tokens[0]):
        tokens = tokens[1:]
    if tokens[:3] in (["python", "-m", "runner"], ["python3", "-m", "runner"]):
        return tokens[3:]
    if any(tokens[:len(launcher)] == launcher for launcher in LAUNCHERS):
        at = next((i for i in range(len(tokens) - 1) if tokens[i:i + 2] == ["-m", "runner"]), None)
        assert at is not None, f"a launcher command that does not start the runner: {command}"
        return tokens[at + 2:]
    return None


def test_the_pages_show_commands():
    """The parsers find the commands (a markup change that hid them would pass vacuously)."""
    commands = using_it()
    assert len(commands) >= 10 and all(c.startswith("python -m runner") for c in commands), commands
    runner = [c for c in ALL if runner_args(c.text) is not None]
    assert len(runner) >= 40, len(runner)
    assert {c.where.split(":")[0] for c in runner} >= {"README.md", "docs/guide/multi-gpu.md",
                                                        "docs/guide/will-it-fit.md", "docs/guide/own-trainer.md"}
    assert any(c.text.startswith("torchrun") for c in runner) and any("-m " in c.text for c in runner)


def test_what_is_skipped_is_what_the_rule_says():
    """Only other programs' commands are skipped: a misspelled runner command would not hide here."""
    skipped = [c for c in ALL if runner_args(c.text) is None]
    assert all(shlex.split(c.text, comments=True)[0] in ("make", "pip", "hf") for c in skipped), skipped


@pytest.mark.parametrize("command", [c for c in ALL if runner_args(c.text) is not None], ids=lambda c: c.where)
def test_every_documented_command_composes(command, monkeypatch):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from runner.cli.compose import compose_config, expand_sweeps, hydra_args
    from runner.cli.help import format_help
    from runner.cli.version import version_line

    args = runner_args(command.text)
    if "--version" in args:  # the runner answers it before Hydra's parser, as runner/cli/launch.py does
        assert version_line().strip()
        args = [a for a in args if a != "--version"]
    monkeypatch.setattr(sys, "argv", ["runner", *args])
    parsed, unknown = hydra_args()
    assert not unknown, f"{command.where}: arguments the runner does not take: {unknown}"
    overrides = list(parsed.overrides)
    if parsed.config_dir:
        overrides.append(f"hydra.searchpath=[file://{Path(parsed.config_dir).resolve()}]")
    if any(p in o for o in overrides for p in PLACEHOLDERS):  # a bare "..." stands for more overrides
        OverridesParser.create().parse_overrides([o.replace("...", "x") for o in overrides if o != "..."])
        return
    if parsed.help:
        assert format_help(overrides), command
        return
    for combo in expand_sweeps(overrides) if parsed.multirun else [overrides]:
        compose_config(combo)


def runnable(command: str) -> list[str]:
    """The command's arguments as this machine can run them (module docstring)."""
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "runner"], f"not a runner command: {command}"
    args = [a for a in args[3:] if not a.startswith(DROPPED)]
    args = ["model.size=tiny" if a == "model.size=full" else a for a in args]
    if any(a.startswith(QUERIES) for a in args):
        return args
    return [a for a in args if not a.startswith("train.steps=")] + TRAINING


@pytest.mark.slow
@pytest.mark.parametrize("command", using_it())
def test_every_using_it_command_runs_on_the_tiny_default(command, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "runner", *runnable(command)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{command}\n-> {runnable(command)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stdout + r.stderr


def test_the_guides_loops_are_the_tested_assets():
    """docs/guide/own-trainer.md shows the plain and the hosted loop that tests/runner/test_hosted.py runs
    and diffs (tests/assets/plain_loop.py, hosted_loop.py): each shown line is the asset's, in order."""
    text = (ROOT / "docs" / "guide" / "own-trainer.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    for asset, marker in (("plain_loop.py", "def main():"), ("hosted_loop.py", "@hosted")):
        shown = [b for b in blocks if marker in b]
        assert len(shown) == 1, (asset, len(shown))
        lines = [ln for ln in shown[0].splitlines() if ln.strip()]
        source = (ROOT / "tests" / "assets" / asset).read_text().splitlines()
        at = 0
        for line in lines:
            assert line in source[at:], f"{asset}: the guide shows {line!r}, which the asset has not (in this order)"
            at = source.index(line, at) + 1
