"""Every shipped preset's plan, byte for byte, in one JSON file: the before/after check of a refactor.

    python bench/plan_snapshot.py OUT.json [--sizes full,tiny] [--targets cuda,cpu] [--presets a,b]
    python bench/plan_snapshot.py --compare BEFORE.json AFTER.json

A restructuring must leave the presets' planned bytes exactly as they were (DEVELOPERS.md). This
script plans each preset with ``mode=plan`` (a subprocess each, as a user runs it) and keeps the
fields that carry bytes: the device peak and its phase, the category split, the per-phase peaks,
host peak/steady/pinned, optimizer state and the sampling pass. ``--compare`` prints every field
that differs and exits 1 if any does. It writes nothing to docs/: it is a check, not a benchmark.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("peak_bytes", "peak_phase", "margin_bytes", "by_category", "phases", "host_peak_bytes",
          "host_peak_phase", "host_steady_bytes", "host_pinned_bytes", "optimizer_state_bytes", "sampling")


def presets() -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "preset").glob("*.yaml"))


def plan_once(preset: str, size: str, target: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "runner", f"+preset={preset}", "mode=plan", f"model.size={size}",
               f"output_dir={tmp}"] + (["train.device=cpu"] if target == "cpu" else [])
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        path = Path(tmp) / "plan.json"
        if not path.exists():
            return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
        plan = json.loads(path.read_text())
    return {k: plan.get(k) for k in FIELDS}


def snapshot(args: argparse.Namespace) -> None:
    chosen = args.presets.split(",") if args.presets else presets()
    out: dict[str, dict] = {}
    for preset in chosen:
        for size in args.sizes.split(","):
            for target in args.targets.split(","):
                if size == "full" and target == "cpu":
                    continue  # a full-size CPU step is not a preset's target
                key = f"{preset}/{size}/{target}"
                out[key] = plan_once(preset, size, target)
                print(key, out[key].get("peak_bytes", out[key].get("error")), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


def compare(before_path: str, after_path: str) -> int:
    before, after = json.loads(Path(before_path).read_text()), json.loads(Path(after_path).read_text())
    differences = 0
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if a is None or b is None:
            print(f"{key}: only in {'after' if a is None else 'before'}")
            continue
        for field in sorted(set(a) | set(b)):
            if a.get(field) != b.get(field):
                differences += 1
                print(f"{key} {field}: {a.get(field)!r} -> {b.get(field)!r}")
    print(f"{differences} field(s) differ across {len(set(before) & set(after))} plan(s)")
    return 1 if differences else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--sizes", default="full,tiny")
    parser.add_argument("--targets", default="cuda,cpu")
    parser.add_argument("--presets", default="")
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if not args.out:
        parser.error("give OUT.json, or --compare BEFORE AFTER")
    snapshot(args)


if __name__ == "__main__":
    main()
