"""Fused backward's planned effect on a full-size preset: the peak with and without it.

    python bench/fused_backward.py [--preset sdxl_24gb] [--no-write]

Plans ``+preset=<preset> model.size=full train.max_grad_norm=0`` (clipping off, so fused backward
gives the normal step's result; the preset's batch of 2, 1024 px) twice, without and with
``optimizer.fused_backward=true``, and records the peak, its phase, the breakdown by category and
the predicted step time in docs/benchmarks.md. No GPU is needed: these are the planner's figures.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from docs_section import replace_section  # bench/ is on sys.path as the script's folder

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Fused backward: planned effect at full size (bench/fused_backward.py)"
BEGIN, END = "<!-- bench/fused_backward.py begin -->", "<!-- bench/fused_backward.py end -->"
GiB = 2**30


def plan(args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "runner", *args, "mode=plan", f"output_dir={tmp}"], cwd=ROOT,
                              capture_output=True, text=True)
        path = Path(tmp) / "plan.json"
        if not path.is_file():
            raise SystemExit(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(path.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="sdxl_24gb")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    base = [f"+preset={args.preset}", "model.size=full", "train.max_grad_norm=0"]
    rows = [("normal step", base), ("optimizer.fused_backward=true", [*base, "optimizer.fused_backward=true"])]
    plans = [(name, a, plan(a)) for name, a in rows]
    cats = ("weights", "gradients", "optimizer_state", "activations", "temporaries")
    lines = [BEGIN, SECTION, "",
             f"Command: `python bench/fused_backward.py --preset {args.preset}` ({time.strftime('%Y-%m-%d')}); each row is "
             f"`python -m runner {' '.join(base)} mode=plan` plus its setting (clipping off: fused backward then gives "
             "the normal step's weights bit for bit, tests/runner/optim/test_fused.py). Step times for the reference card "
             "(RTX 4090).", "",
             "| | planned peak (phase) | " + " | ".join(cats) + " | predicted s/step |",
             "|---|---|" + "---|" * len(cats) + "---|"]
    for name, _, p in plans:
        lines.append(f"| {name} | {p['peak_bytes'] / GiB:.2f} GiB ({p['peak_phase']}) | "
                     + " | ".join(f"{p['by_category'].get(c, 0) / GiB:.2f}" for c in cats)
                     + f" | {p['step_time']['seconds']:.3g} |")
    (_, _, normal), (_, _, fused) = plans
    saved = normal["peak_bytes"] - fused["peak_bytes"]
    lines += ["", f"Fused backward lowers the planned peak by {saved / GiB:.2f} GiB, "
              f"{saved / max(normal['by_category'].get('gradients', 0), 1):.0%} of the {normal['by_category'].get('gradients', 0) / GiB:.2f} GiB "
              "of gradients alive at the normal step's peak (what is left: the largest gradients alive at once "
              "in backward, and the peak moving to where activations are).", END]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        replace_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
