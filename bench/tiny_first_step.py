"""How long each preset's tiny run takes to reach its first step on this CPU, as a user types it.

    python bench/tiny_first_step.py [--presets a,b] [--no-write]

Runs ``python -m runner +preset=<name> train.steps=1`` for every preset in conf/preset/ (the tiny model of its
family, the built-in demo data at the tiny model's sizes, the CPU) in a fresh output folder and times, from the
process start: the first step's log line (``step 1/1``), and the whole command. The preflight's own figures come
from the run's plan.json. Writes its section of docs/benchmarks.md (bench/docs_section.py). The target is step 1
within 60 s for every preset (issue 43); the figures move with the machine's load, recorded beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from docs_section import replace_section  # noqa: E402

BEGIN, END = "<!-- bench/tiny_first_step.py begin -->", "<!-- bench/tiny_first_step.py end -->"
TARGET_S = 60.0


def presets() -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "preset").glob("*.yaml"))


def run_once(preset: str) -> dict:
    """One tiny run; the seconds to its first step's line and to its exit."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": str(Path(tmp) / "cache")}
        command = [sys.executable, "-m", "runner", f"+preset={preset}", "train.steps=1", f"output_dir={out}"]
        t0 = time.perf_counter()
        first = None
        with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as proc:
            tail: list[str] = []
            for line in proc.stdout:
                tail = (tail + [line])[-40:]
                if first is None and " step 1/1 " in line:
                    first = time.perf_counter() - t0
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"+preset={preset} train.steps=1 failed ({proc.returncode}):\n{''.join(tail)}")
        plan = json.loads((out / "plan.json").read_text())
    timings = plan["notes"].get("timings_s", {})
    return {"preset": preset, "first_step_s": first, "wall_s": wall, "plan_s": plan["seconds"],
            "import_s": timings.get("model classes import", 0.0)}


def section(rows: list[dict], load: float) -> str:
    over = [r["preset"] for r in rows if r["first_step_s"] is None or r["first_step_s"] > TARGET_S]
    lines = [BEGIN, "## Every preset's tiny run to its first step (bench/tiny_first_step.py)", "",
             f"Command (CPU only, {os.cpu_count()} cores, 1-minute load average {load:.2f} at the start, "
             f"{time.strftime('%Y-%m-%d')}): `python bench/tiny_first_step.py`; each row is "
             "`python -m runner +preset=<name> train.steps=1` (tiny model, built-in demo data, CPU), timed from the "
             "process start. *preflight* is the plan's own time and the model-class import before it (paid once by "
             "the run, for its build too).", "",
             "| preset | step 1 at (s) | whole run (s) | preflight: plan + import (s) |", "|---|---|---|---|"]
    for r in rows:
        first = "-" if r["first_step_s"] is None else f"{r['first_step_s']:.1f}"
        lines.append(f"| `{r['preset']}` | {first} | {r['wall_s']:.1f} | {r['plan_s']:.1f} + {r['import_s']:.1f} |")
    lines += ["", f"Every preset reached step 1 within {TARGET_S:.0f} s." if not over
              else f"Over {TARGET_S:.0f} s: {', '.join(over)}.", END]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", help="comma-separated presets (default: every preset)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    rows = []
    for preset in args.presets.split(",") if args.presets else presets():
        rows.append(run_once(preset))
        r = rows[-1]
        print(f"{preset}: step 1 at {r['first_step_s']} s, whole run {r['wall_s']:.1f} s", flush=True)
    text = section(rows, load)
    print(text)
    if not args.no_write:
        replace_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
