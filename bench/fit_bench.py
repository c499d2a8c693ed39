"""mode=fit at full size: SDXL full fine-tune and Flux LoRA at 24, 16 and 12 GiB, 1024 px.

    python bench/fit_bench.py [--budgets 24,16,12] [--no-write]

Runs the command a user runs, one process each (imports and interpreter exit included)::

    python -m runner +preset=sdxl_24gb mode=fit model.size=full budget_gb=16
    python -m runner +preset=flux_24gb mode=fit model.size=full budget_gb=12

(``model.size=full`` plans 1024 px, the default batch of 2; no ``device.name``: the step time is
for the reference card, an RTX 4090, and the budget is exactly the one given). Each row records
the whole command's wall time, how many full plans it made, the chosen configuration, the peak
its confirming plan found and the predicted s/step, or that nothing fits and the closest. The
figures go into this script's section of docs/benchmarks.md. The 1-minute load average is
recorded beside them: on a shared machine the times are not the machine's.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from docs_section import replace_section  # bench/ is on sys.path as the script's folder

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## mode=fit: the fastest settings that fit, at full size (bench/fit_bench.py)"
BEGIN, END = "<!-- bench/fit_bench.py begin -->", "<!-- bench/fit_bench.py end -->"
CASES = {"SDXL full fine-tune": "sdxl_24gb", "Flux LoRA": "flux_24gb"}
GiB = 2**30


def args_for(preset: str, budget: float) -> list[str]:
    return [f"+preset={preset}", "mode=fit", "model.size=full", f"budget_gb={budget:g}"]


def run_once(preset: str, budget: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fit"
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "runner", *args_for(preset, budget), f"output_dir={out}"], cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wall = time.perf_counter() - t0
        if proc.returncode not in (0, 3) or not (out / "fit.json").is_file():
            raise SystemExit(f"fit {preset} {budget} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        record = json.loads((out / "fit.json").read_text())
        table = proc.stdout[proc.stdout.find("fit: budget"):]
    return {"preset": preset, "budget": budget, "wall_s": wall, "load": load, "exit": proc.returncode,
            "record": record, "table": table}


def _changes(row: dict) -> str:
    base, knobs = row["base"]["knobs"], row["knobs"]
    out = []
    for k, v in knobs.items():
        if v != base[k] and not (k == "every_n" and knobs["checkpoint"] != "every_n"):
            out.append(f"{k}: {base[k]} -> {v}")
    return "; ".join(out) or "none"


def section(rows: list[dict]) -> str:
    loads = [r["load"] for r in rows]
    lines = [
        BEGIN, SECTION, "",
        f"Command: `python bench/fit_bench.py` ({time.strftime('%Y-%m-%d')}, CPU only, {os.cpu_count()} cores, "
        f"1-minute load average {min(loads):.1f}-{max(loads):.1f} while it ran: the machine was shared, so the wall "
        "times are upper bounds). Each row is one command, for example "
        f"`python -m runner {shlex.join(args_for('sdxl_24gb', 16))}`; *wall* is the whole command (imports, the "
        "full plans, interpreter exit). The step time is predicted for the reference card (RTX 4090: no "
        "`device.name`, so the budget is exactly `budget_gb`). Only result-preserving settings (no `fit.allow`).",
        "",
        "| case | budget | wall (s) | full plans | chosen (planned peak, predicted s/step) | changed from the preset |",
        "|---|---|---|---|---|---|",
    ]
    for case, preset in CASES.items():
        for r in [r for r in rows if r["preset"] == preset]:
            rec = r["record"]
            if rec["winner"]:
                w = rec["winner"]
                chosen = (f"{w['settings']} ({w['required_bytes'] / GiB:.2f} GiB, {w['seconds_per_step']:.3g} s/step)")
                changed = _changes({"base": rec["base"], "knobs": w["knobs"]})
            else:
                c = rec["closest"]
                chosen = (f"**nothing fits**; closest: {c['settings']} at {c['required_bytes'] / GiB:.2f} GiB, "
                          f"{(c['required_bytes'] - rec['budget_bytes'] + rec['headroom_bytes']) / GiB:.2f} GiB over")
                changed = "-"
            lines.append(f"| {case} | {r['budget']:g} GiB | {r['wall_s']:.0f} | {rec['plans']} | {chosen} | {changed} |")
    lines += ["", "The preset's own configuration, planned, for comparison:", ""]
    seen = set()
    for r in rows:
        if r["preset"] in seen:
            continue
        seen.add(r["preset"])
        b = r["record"]["base"]
        lines.append(f"- `{r['preset']}`: {b['settings']}: {b['required_bytes'] / GiB:.2f} GiB, "
                     f"{b['seconds_per_step']:.3g} s/step predicted")
    lines += ["", "What mode=fit printed for each (the top candidates and why the others lose):", ""]
    for r in rows:
        lines += [f"`{shlex.join(args_for(r['preset'], r['budget']))}`:", "", "```", r["table"].strip(), "```", ""]
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="24,16,12")
    ap.add_argument("--presets", default=",".join(CASES.values()))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rows = []
    for preset in args.presets.split(","):
        for budget in (float(b) for b in args.budgets.split(",")):
            r = run_once(preset, budget)
            rec = r["record"]
            w = rec["winner"] or rec["closest"]
            print(f"{preset} {budget:g} GiB: {r['wall_s']:.0f} s (load {r['load']:.1f}), {rec['plans']} plans, "
                  f"{'fits' if rec['winner'] else 'NOTHING FITS'}: {w['settings']} {w['required_bytes'] / GiB:.2f} GiB "
                  f"{w['seconds_per_step']:.3g} s/step", flush=True)
            rows.append(r)
    text = section(rows)
    if args.no_write:
        print(text)
    else:
        replace_section(text, BEGIN, END)
        print("wrote", SECTION)


if __name__ == "__main__":
    main()
