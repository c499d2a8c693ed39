"""How fast the planner answers, and what it predicts for every shipped preset at full size.

    python bench/plan_speed.py [--repeats 2] [--no-write] [--presets a,b]

Runs the planner's command line, exactly as a user would, for every preset in conf/preset/ at
the presets' stated full-size targets (1024 px, the default batch of 2)::

    python -m runner +preset=<name> mode=plan model.size=full

and records, per preset: the command's wall time (process start to exit: Python and library
imports, Hydra, building the models on meta, the simulated step) and its CPU time (user + system:
the honest figure when other jobs share the cores), the planner's own time (``seconds`` and its
split in plan.json), the predicted peak and whether it fits the preset's budget. The figures go
into this script's sections of docs/benchmarks.md (other sections are left as they are): the
summary table of every preset, and one block per preset with its full-size plan (peak and phase,
the breakdown by category and by module, the per-phase peaks, host RAM). ``--presets a,b`` plans
only those and rewrites only their blocks, so whoever adds a preset records its plan without
re-timing everyone else's; the summary table is rewritten by a run over every preset. No GPU is
needed: the planner runs on the CPU.

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
        before = os.times()
        proc = subprocess.run(command(preset, out), cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wall = time.perf_counter() - t0
        after = os.times()
        cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
        if proc.returncode not in (0, 3):  # 3: planned, does not fit
            raise SystemExit(f"{shown(preset)} failed with status {proc.returncode}:\n{proc.stderr[-3000:]}")
        plan = json.loads((out / "plan.json").read_text())
    return {"wall_s": wall, "cpu_s": cpu, "exit": proc.returncode, "plan": plan}


def measure(repeats: int, chosen: list[str] | None = None) -> list[dict]:
    rows = []
    for preset in chosen or presets():
        runs = [run_once(preset) for _ in range(repeats)]
        plan = runs[-1]["plan"]
        assert all(r["plan"]["peak_bytes"] == plan["peak_bytes"] for r in runs), "the plan is not deterministic"
        rows.append({
            "preset": preset,
            "command": shown(preset),
            "wall_s": [round(r["wall_s"], 1) for r in runs],
            "cpu_s": [round(r["cpu_s"], 1) for r in runs],
            "plan_s": [round(r["plan"]["seconds"], 1) for r in runs],
            "timings": plan["notes"].get("timings_s", {}),
            "exit": runs[-1]["exit"],
            "plan": plan,
        })
        print(f"{preset}: wall {rows[-1]['wall_s']} s, cpu {rows[-1]['cpu_s']} s, planner {rows[-1]['plan_s']} s, "
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
        "*import* is the trainer's model classes (diffusers' model packages, transformers' encoders: the process",
        "pays it once, and a training run for its own build); *planner* is the simulation after it (`seconds` in plan.json).",
        "",
        "| preset | wall (s) | import (s) | planner (s) | build / setup / fwd+bwd / optimizer (s) | predicted peak | needed (+ workspaces) | budget | fits | host RAM peak / during training |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, t = r["plan"], r["timings"]
        split = " / ".join(f"{t.get(k, 0):.1f}" for k in ("build", "setup", "forward+backward", "optimizer"))
        budget = f"{p['budget_bytes'] / GiB:g} GiB" if p["budget_bytes"] is not None else "-"
        lines.append(
            f"| `{r['preset']}` | {', '.join(map(str, r['wall_s']))} | {t.get('model classes import', 0):.1f} | "
            f"{', '.join(map(str, r['plan_s']))} | {split} | "
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


# ---- one block per preset: its full-size plan ------------------------------------------------------
PRESETS_SECTION = "## Full-size plans of the presets (bench/plan_speed.py)"
PRESETS_BEGIN, PRESETS_END = "<!-- bench/plan_speed.py presets begin -->", "<!-- bench/plan_speed.py presets end -->"


def block_markers(preset: str) -> tuple[str, str]:
    return f"<!-- plan_speed preset {preset} begin -->", f"<!-- plan_speed preset {preset} end -->"


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def preset_block(r: dict, load: float, repeats: int) -> str:
    """A preset's full-size plan: what the table and plan.json say, in one block."""
    p, begin, end = r["plan"], *block_markers(r["preset"])
    run = p["run"]
    budget = f"{p['budget_bytes'] / GiB:g} GiB" if p["budget_bytes"] is not None else "none"
    lines = [
        begin,
        f"### `{r['preset']}`",
        "",
        f"`{r['command']}` ({time.strftime('%Y-%m-%d')}, 1-minute load average {load:.2f} at the start, {repeats} run(s); "
        f"`python bench/plan_speed.py --presets {r['preset']} --repeats {repeats}`)",
        "",
        f"- run: {run['trainer']} ({run['size']}), {run.get('sample') or str(run['resolution']) + ' px'}, "
        f"batch {run['batch_size']} "
        f"({run['micro_batches']} x micro-batch {run['micro_batch_size']}), {run['precision_text']}; plugins "
        f"{run['plugins']}; optimizer {run['optimizer']}; trained: {run['trained']} ({run['model_train']})",
        f"- **peak {gib(p['peak_bytes'])} GiB in {p['peak_phase']}**, needed with kernel workspaces "
        f"{gib(p['required_bytes'])} GiB, budget {budget}: {'fits' if p['fits'] else '**does not fit**'}",
        "- at the peak, by category (GiB): " + ", ".join(f"{c} {gib(v)}" for c, v in p["by_category"].items() if v),
        "- at the peak, by module (GiB): " + "; ".join(
            f"{m}: " + ", ".join(f"{c} {gib(v)}" for c, v in cats.items()) for m, cats in p["by_module"].items()),
        "- steady-state peak by phase (GiB): " + ", ".join(f"{k} {gib(v)}" for k, v in p["phases"].items()),
        f"- host RAM (tensors): peak {gib(p['host_peak_bytes'])} GiB in {p['host_peak_phase']}, during training "
        f"{gib(p['host_steady_bytes'])} GiB, of which pinned {gib(p['host_pinned_bytes'])} GiB",
        f"- time: wall {', '.join(map(str, r['wall_s']))} s, CPU (user + system) {', '.join(map(str, r['cpu_s']))} s, "
        f"planner {', '.join(map(str, r['plan_s']))} s (build / setup / forward+backward / optimizer: "
        + " / ".join(f"{r['timings'].get(k, 0):.1f}" for k in ("build", "setup", "forward+backward", "optimizer"))
        + " s)",
        end,
    ]
    return "\n".join(lines)


def write_preset_blocks(rows: list[dict], load: float, repeats: int) -> None:
    """Replace each preset's block in the presets section, creating the section or the block if missing."""
    doc = DOC.read_text()
    if PRESETS_BEGIN not in doc:
        replace_section(f"{PRESETS_BEGIN}\n{PRESETS_SECTION}\n\nEach block is written by the command in it; "
                        f"the figures are the planner's (runner/plan/), for a CUDA device.\n{PRESETS_END}",
                        PRESETS_BEGIN, PRESETS_END, DOC)
        doc = DOC.read_text()
    for r in rows:
        block, (begin, end) = preset_block(r, load, repeats), block_markers(r["preset"])
        if begin in doc and end in doc:
            head, rest = doc.split(begin, 1)
            doc = head + block + rest.split(end, 1)[1]
        else:
            head, tail = doc.split(PRESETS_END, 1)
            doc = head.rstrip("\n") + "\n\n" + block + "\n" + PRESETS_END + tail
    DOC.write_text(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="runs per preset (timings of each are listed)")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing docs/benchmarks.md")
    ap.add_argument("--presets", default="", help="comma-separated presets: plan only these, rewrite only their blocks")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    chosen = [p for p in args.presets.split(",") if p]
    unknown = sorted(set(chosen) - set(presets()))
    if unknown:
        raise SystemExit(f"unknown preset(s) {', '.join(unknown)}; conf/preset has {', '.join(presets())}")
    rows = measure(args.repeats, chosen or None)
    if args.no_write:
        print(section(rows, load, args.repeats) if not chosen else "")
        for r in rows:
            print(preset_block(r, load, args.repeats))
        return
    if not chosen:
        replace_section(section(rows, load, args.repeats), BEGIN, END, DOC)
        print(f"wrote '{SECTION}' in {DOC}")
    write_preset_blocks(rows, load, args.repeats)
    print(f"wrote the full-size plan of {', '.join(r['preset'] for r in rows)} in '{PRESETS_SECTION}' of {DOC}")


if __name__ == "__main__":
    main()
