"""What an EMA of the trained weights costs, planned: the SDXL full fine-tune preset at full size.

    python bench/plan_ema.py [--preset sdxl_24gb] [--no-write]

Plans ``python -m runner +preset=<preset> mode=plan model.size=full`` (1024 px, batch 2) as a user
runs it, without EMA and with ``ema.enabled=true`` at ``ema.device=device`` (float32 and bfloat16
copies) and ``ema.device=cpu``, and records from each plan.json the EMA copy's bytes on the device
and on the host, the device peak and whether it fits the preset's budget, the host RAM during
training and the peak of one EMA update (its temporaries included). Bytes are exact counts of
the simulated tensors, so they do not depend on the machine; the 1-minute load average is recorded
for the timings beside them. The figures go into this script's section of docs/benchmarks.md.
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
SECTION = "## EMA of the trained weights: planned bytes on the device and on the host (bench/plan_ema.py)"
BEGIN, END = "<!-- bench/plan_ema.py begin -->", "<!-- bench/plan_ema.py end -->"
GiB = 2**30
CASES = [
    ("no EMA", []),
    ("ema.device=device (float32)", ["ema.enabled=true"]),
    ("ema.device=device ema.dtype=bfloat16", ["ema.enabled=true", "ema.dtype=bfloat16"]),
    ("ema.device=cpu (float32)", ["ema.enabled=true", "ema.device=cpu"]),
]


def command(preset: str, extra: list[str]) -> list[str]:
    return ["python", "-m", "runner", f"+preset={preset}", "mode=plan", "model.size=full", *extra]


def plan_once(preset: str, extra: list[str]) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, *command(preset, extra)[1:], f"output_dir={tmp}"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode not in (0, 3):  # 3: planned, does not fit
            raise SystemExit(f"{' '.join(command(preset, extra))} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads((Path(tmp) / "plan.json").read_text()), wall


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def exact(n: int) -> str:
    return f"{gib(n)} ({n:,} B)" if n else gib(n)


def section(preset: str, rows: list[tuple[str, list[str], dict, float]], load: float) -> str:
    lines = [
        BEGIN, SECTION, "",
        f"Command: `python bench/plan_ema.py --preset {preset}` ({time.strftime('%Y-%m-%d')}, CPU only, "
        f"{os.cpu_count()} cores, 1-minute load average {load:.2f} at the start). Each row is the plan of the command "
        "shown (1024 px, batch 2, bf16 trained weights); bytes are exact counts of the simulated step, not timings.",
        "",
        "| command | EMA on the device | EMA on the host | device peak (phase) | needed (+ workspaces) | fits "
        f"| host RAM during training | one EMA update's peak (device) | plan wall time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for _, extra, p, wall in rows:
        e = p.get("ema") or {}
        update = p["phases"].get("ema update")
        lines.append(
            f"| `{' '.join(command(preset, extra))}` | {exact(e.get('device_bytes', 0))} | {exact(e.get('host_bytes', 0))} | "
            f"{gib(p['peak_bytes'])} ({p['peak_phase']}) | {gib(p['required_bytes'])} | "
            f"{'yes' if p['fits'] else '**no**'} | {gib(p['host_steady_bytes'])} | "
            f"{gib(update) if update is not None else '-'} | {wall:.0f} s |")
    e = next(p["ema"] for _, _, p, _ in rows if p.get("ema"))
    lines += [
        "",
        f"The copy covers the {e['parameters']:,} trained parameters ({e['tensors']} tensors) of the U-Net: "
        f"{gib(e['parameters'] * 4)} in float32, {gib(e['parameters'] * 2)} in bfloat16. On the device it is live "
        "through the whole step (it is in the backward peak); `ema.device=cpu` keeps the device peak of the run "
        "without EMA and adds the copy to host RAM (each update then stages the weights on the host chunk by chunk: "
        "64 MiB of the copy at a time, or one tensor when it is larger).",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="sdxl_24gb")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing docs/benchmarks.md")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    rows = []
    for name, extra in CASES:
        plan, wall = plan_once(args.preset, extra)
        rows.append((name, extra, plan, wall))
        e = plan.get("ema") or {}
        print(f"{name}: EMA device {gib(e.get('device_bytes', 0))}, host {gib(e.get('host_bytes', 0))}; "
              f"peak {gib(plan['peak_bytes'])}, fits={plan['fits']}", flush=True)
    text = section(args.preset, rows, load)
    if args.no_write:
        print(text)
    else:
        replace_section(text, BEGIN, END, DOC)
        print(f"wrote '{SECTION}' in {DOC}")


if __name__ == "__main__":
    main()
