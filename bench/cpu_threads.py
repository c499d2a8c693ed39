"""CPU thread policy (issue 27): s/step of the tiny default by torch thread count and OpenMP wait
policy, side by side in one run, on this machine as it is ("idle") and with busy processes added
("loaded": one spinning Python process per core, started before and stopped after each run).

Each configuration is ``python -m runner train.steps=<n> train.cpu_threads=<t>`` in its own process
with ``OMP_WAIT_POLICY`` as given (none: the runner's own, PASSIVE) and ``OMP_NUM_THREADS`` at the
machine's core count; the figure is the runner's own mean s/step over
the steps after the first (job_summary.json), the median of ``--repeats`` runs. The runner's
choice (``auto``) is run the same way with ``train.cpu_threads`` unset: what ``make run`` gets.

    python bench/cpu_threads.py --write     # the table into docs/benchmarks.md
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from docs_section import replace_section  # bench/ is on sys.path as the script's folder

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench/cpu_threads.py begin -->", "<!-- bench/cpu_threads.py end -->"
# (row, train.cpu_threads, OMP_WAIT_POLICY): None = the runner's choice (PASSIVE unless set, runner/hostmem.py).
# ACTIVE stands for libgomp's default too: its spin-then-sleep measured the same here (3.20 vs 3.25 s/step
# with 2 threads at load ~5, before the runner set a policy).
CONFIGS = [("auto (the runner's choice)", None, None), ("1 thread", 1, None), ("2 threads, ACTIVE", 2, "ACTIVE"),
           ("2 threads, PASSIVE", 2, "PASSIVE")]


def _spin() -> None:
    while True:
        pass


def one_run(threads: int | None, policy: str | None, steps: int, work: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1), "PYTHONUNBUFFERED": "1"}
    env.pop("OMP_WAIT_POLICY", None)
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    out = Path(tempfile.mkdtemp(dir=work))
    args = [sys.executable, "-m", "runner", f"train.steps={steps}", "train.progress=false", "train.preflight=false",
            "export.enabled=false", f"output_dir={out}"] + ([f"train.cpu_threads={threads}"] if threads else [])
    subprocess.run(args, cwd=ROOT, env=env, capture_output=True, check=True, timeout=1800)
    return float(json.loads((out / "job_summary.json").read_text())["s_per_step"])


def measure(loaded: bool, steps: int, repeats: int, work: Path) -> dict[str, float]:
    results: dict[str, float] = {}
    for name, threads, policy in CONFIGS:
        times = []
        for _ in range(repeats):
            spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 1)] if loaded else []
            for p in spinners:
                p.start()
            try:
                times.append(one_run(threads, policy, steps, work))
            finally:
                for p in spinners:
                    p.kill()
        results[name] = statistics.median(times)
        print(f"{'loaded' if loaded else 'as is'}: {name}: {results[name]:.3f} s/step", flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        idle = measure(False, args.steps, args.repeats, Path(tmp))
        busy = measure(True, args.steps, args.repeats, Path(tmp))
    lines = [BEGIN, f"Command: `python bench/cpu_threads.py{' --write' if args.write else ''}` "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores, load average "
             f"{load0:.1f} at the start; tiny default, {args.steps} steps, median of {args.repeats}).", "",
             "| torch threads, OMP_WAIT_POLICY | s/step, machine as it was | s/step, + one spinning process per core |",
             "|---|---|---|"]
    lines += [f"| {name} | {idle[name]:.3f} | {busy[name]:.3f} |" for name, _, _ in CONFIGS]
    lines.append(END)
    text = "\n".join(lines)
    print(text)
    if args.write:
        replace_section(text, BEGIN, END, ROOT / "docs" / "benchmarks.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
