"""How fast the planner answers, and what it predicts for every shipped preset at full size.

    python bench/plan_speed.py [--repeats 2] [--no-write]

Runs the planner's command line, exactly as a user would, for every preset in conf/preset/ at
the presets' stated full-size targets (1024 px, the default batch of 2)::

    python -m runner +preset=<name> mode=plan model.size=full

and records, per preset: the command's wall time (process start to exit: Python and library
imports, Hydra, building the models on meta, the simulated step), the planner's own time
(``seconds`` and its split in plan.json), the predicted peak and whether it fits the preset's
budget. The figures go into this script's section of docs/benchmarks.md (other sections are
left as they are). No GPU is needed: the planner runs on the CPU.

Timings depend on what else runs on the machine; the 1-minute load average at the start is
recorded beside them.
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

from docs_section import replace_section  # bench/ is on sys.path as the script's folder

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Planner: time to plan and predicted peaks (bench/plan_speed.py)"
BEGIN, END = "<!-- bench/plan_speed.py begin -->", "<!-- bench/plan_speed.py end -->"
FULL_SIZE = ["model.size=full"]  # 1024 px (data.resolution follows model.size), the default batch of 2
GiB = 2**30


def presets() -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "preset").glob("*.yaml"))


def command(preset: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "runner", f"+preset={preset}", "mode=plan", *FULL_SIZE, f"output_dir={out}"]


def shown(preset: str) -> str:
    return " ".join(["python -m runner", f"+preset={preset}", "mode=plan", *FULL_SIZE])


def run_once(preset: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan"
        t0 = time.perf_counter()
        proc = subprocess.run(command(preset, out), cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wall = time.perf_counter() - t0
        if proc.returncode not in (0, 3):  # 3: planned, does not fit
            raise SystemExit(f"{shown(preset)} failed with status {proc.returncode}:\n{proc.stderr[-3000:]}")
        plan = json.loads((out / "plan.json").read_text())
    return {"wall_s": wall, "exit": proc.returncode, "plan": plan}


def measure(repeats: int) -> list[dict]:
    rows = []
    for preset in presets():
        runs = [run_once(preset) for _ in range(repeats)]
        plan = runs[-1]["plan"]
        assert all(r["plan"]["peak_bytes"] == plan["peak_bytes"] for r in runs), "the plan is not deterministic"
        rows.append({
            "preset": preset,
            "command": shown(preset),
            "wall_s": [round(r["wall_s"], 1) for r in runs],
            "plan_s": [round(r["plan"]["seconds"], 1) for r in runs],
            "timings": plan["notes"].get("timings_s", {}),
            "exit": runs[-1]["exit"],
            "plan": plan,
        })
        print(f"{preset}: wall {rows[-1]['wall_s']} s, planner {rows[-1]['plan_s']} s, "
              f"peak {plan['peak_bytes'] / GiB:.2f} GiB, fits={plan['fits']}", flush=True)
    return rows


def section(rows: list[dict], load: float, repeats: int) -> str:
    lines = [
        BEGIN,
        SECTION,
        "",
        f"Command (CPU only, {os.cpu_count()} cores, 1-minute load average {load:.2f} at the start; "
        f"{repeats} run(s) per preset, {time.strftime('%Y-%m-%d')}): `python bench/plan_speed.py --repeats {repeats}`.",
        "Each preset is planned with its own command, shown in the table: at `model.size=full` the plan is of the",
        "presets' stated targets, 1024 px (data.resolution's default at full size) and the default batch of 2.",
        "*wall* is the whole command (interpreter, imports of torch/diffusers/transformers, Hydra, the plan);",
        "*planner* is `plan_step` alone (in plan.json),",
        "of which *build* includes importing the model classes.",
        "",
        "| preset | wall (s) | planner (s) | build / setup / fwd+bwd / optimizer (s) | predicted peak | needed (+ workspaces) | budget | fits | host RAM peak / during training |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, t = r["plan"], r["timings"]
        split = " / ".join(f"{t.get(k, 0):.1f}" for k in ("build", "setup", "forward+backward", "optimizer"))
        budget = f"{p['budget_bytes'] / GiB:g} GiB" if p["budget_bytes"] is not None else "-"
        lines.append(
            f"| `{r['preset']}` | {', '.join(map(str, r['wall_s']))} | {', '.join(map(str, r['plan_s']))} | {split} | "
            f"{p['peak_bytes'] / GiB:.2f} GiB ({p['peak_phase']}) | {p['required_bytes'] / GiB:.2f} GiB | {budget} | "
            f"{'yes' if p['fits'] else '**no**'} | {p['host_peak_bytes'] / GiB:.2f} / {p['host_steady_bytes'] / GiB:.2f} GiB |"
        )
    lines += ["", "Breakdown at the peak (GiB), from each plan.json:", ""]
    for r in rows:
        p = r["plan"]
        cats = ", ".join(f"{c} {v / GiB:.2f}" for c, v in p["by_category"].items() if v)
        lines.append(f"- `{r['preset']}` ({p['run']['plugins']}; optimizer {p['run']['optimizer']}): {cats}")
        for s in p["suggestions"][:3]:
            bound = "up to " if s.get("upper_bound") else ""
            lines.append(f"  - suggestion (estimate): `{s['override']}` saves {bound}{s['saves_bytes'] / GiB:.2f} GiB")
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="runs per preset (timings of each are listed)")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing docs/benchmarks.md")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    text = section(measure(args.repeats), load, args.repeats)
    if args.no_write:
        print(text)
    else:
        replace_section(text, BEGIN, END, DOC)
        print(f"wrote '{SECTION}' in {DOC}")


if __name__ == "__main__":
    main()
