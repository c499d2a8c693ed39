"""How long the command line takes to answer when nothing is to be trained: ``--help``, ``--version``,
``mode=plugins``, ``--cfg job`` and config errors (the target is <= 2 s on a 2-core machine).

    python bench/cli_latency.py [--repeats 5]

Each case is a fresh ``python -m runner ...`` subprocess in an empty temporary folder (as a user
types it; Python's start-up included), timed wall-clock, ``--repeats`` times; the table gives the
median and the fastest run, the exit status, whether any heavy module (torch, diffusers,
transformers, accelerate, bitsandbytes) was imported (from a ``-X importtime`` run of the same
command) and whether a folder was created. The 1-minute load average before and after is
recorded: on a shared machine the figures move with it. Also timed, for scale: ``import torch``
alone. Writes its section of docs/benchmarks.md (bench/docs_section.py).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from docs_section import replace_section  # noqa: E402

MARK_BEGIN, MARK_END = "<!-- bench/cli_latency.py begin -->", "<!-- bench/cli_latency.py end -->"
HEAVY = ("torch", "diffusers", "transformers", "accelerate", "bitsandbytes")
CASES = [
    ("--help", ["--help"]),
    ("--version", ["--version"]),
    ("mode=plugins", ["mode=plugins"]),
    ("--cfg job (a preset)", ["+preset=constrained", "--cfg", "job"]),
    ("misspelled key", ["train.stepz=3"]),
    ("bad value", ["train.steps=0"]),
    ("bad plugin setting", ["checkpoint=blocks", "checkpoint.blocks.mode=every_n", "checkpoint.blocks.every_n=0"]),
    ("unknown plugin", ["offload=strem"]),
    ("missing data.path", ["data.path=/no/such/folder"]),
    ("bad job in a sweep (-m)", ["-m", "train.steps=1,0"]),
]


def run_once(args: list[str], cwd: Path, importtime: bool = False) -> tuple[float, subprocess.CompletedProcess]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "runner", *args]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return time.perf_counter() - t0, r


def heavy_imported(stderr: str) -> list[str]:
    """Top-level heavy packages in a ``-X importtime`` log."""
    found = set()
    for line in stderr.splitlines():
        if line.startswith("import time:"):
            name = line.rsplit("|", 1)[-1].strip()
            if name in HEAVY:
                found.add(name)
    return sorted(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="cli-latency-") as tmp:
        for label, case in CASES:
            cwd = Path(tmp) / label.replace(" ", "_").replace("/", "_")
            cwd.mkdir()
            times, rc = [], None
            for _ in range(args.repeats):
                seconds, r = run_once(case, cwd)
                times.append(seconds)
                rc = r.returncode
            _, traced = run_once(case, cwd, importtime=True)
            created = sorted(p.name for p in cwd.iterdir())
            rows.append((label, " ".join(case), rc, statistics.median(times), min(times), heavy_imported(traced.stderr),
                         created))
            print(f"{label:28} rc={rc} median {statistics.median(times):.2f} s  min {min(times):.2f} s  "
                  f"heavy={heavy_imported(traced.stderr) or '-'} created={created or '-'}", flush=True)
        torch_times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import torch"], check=True, capture_output=True)
            torch_times.append(time.perf_counter() - t0)
    load_after = os.getloadavg()[0]

    command = "python bench/cli_latency.py " + " ".join(sys.argv[1:])
    lines = [
        MARK_BEGIN,
        "## Command line: help, version, listing and config errors (bench/cli_latency.py)",
        "",
        f"Command: `{command.strip()}` on {platform.machine()}, {os.cpu_count()} CPU cores shared with other work, "
        f"Python {platform.python_version()}; 1-minute load average {load_before:.2f} before, {load_after:.2f} after. "
        f"Each case is a fresh `python -m runner ...` in an empty folder, {args.repeats} times (Python's start-up "
        "included); heavy = which of torch, diffusers, transformers, accelerate, bitsandbytes a `-X importtime` run "
        "of the same command imported; created = what appeared in the folder. The target is <= 2 s on an idle "
        "2-core machine; a loaded one scales every figure.",
        "",
        "| case | arguments | exit | median s | min s | heavy imports | created |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, case, rc, med, low, heavy, created in rows:
        lines.append(f"| {label} | `{case}` | {rc} | {med:.2f} | {low:.2f} | {', '.join(heavy) or 'none'} | "
                     f"{', '.join(created) or 'nothing'} |")
    lines += [
        "",
        f"For scale, `python -c 'import torch'` alone: median {statistics.median(torch_times):.2f} s, min "
        f"{min(torch_times):.2f} s. Errors that depend on the machine (a CUDA-only option where `train.device=auto` "
        "finds no GPU) and the data folder's contents are checked after torch is imported, still before anything is "
        "built, planned or created (runner/checks.py).",
        MARK_END,
    ]
    replace_section("\n".join(lines), MARK_BEGIN, MARK_END)
    print(f"load average {load_before:.2f} -> {load_after:.2f}; section written to docs/benchmarks.md")


if __name__ == "__main__":
    main()
