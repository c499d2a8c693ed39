"""The full-size plan of each model family's preset, and of the alternatives its comments cite.

    python bench/family_plans.py [--presets sd15_8gb,sd35_24gb,chroma_16gb,flux_kontext_24gb,z_image_16gb,lumina2_16gb,flux2_24gb] [--no-write]

Plans, with the planner's command line exactly as a user runs it (a subprocess each, CPU only),

    python -m runner +preset=<name> mode=plan model.size=full [<override> ...]

each family preset at its stated target (model.size=full: the family's native resolution, the
default batch of 2), and the variants its comments compare it with (another quantization, no
checkpointing, the family's other variant). It writes this script's section of
docs/benchmarks.md: per preset the peak and its phase, what is needed with the kernel
workspaces, the budget and whether it fits, the breakdown by category and by module at the peak,
the per-phase peaks, host RAM (peak, during training, pinned), then one row per variant. The
figures are bytes the planner counts, so they do not depend on the machine's load; the wall time
of each command is listed for reference with the load average.
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
SECTION = "## Model families: full-size plans of their presets (bench/family_plans.py)"
BEGIN, END = "<!-- bench/family_plans.py begin -->", "<!-- bench/family_plans.py end -->"
GiB = 2**30
# preset -> the overrides its comments compare it with (each planned on top of the preset)
VARIANTS: dict[str, list[list[str]]] = {
    "sd15_8gb": [["checkpoint=none"], ["trainer.variant=sd21"], ["model.train_dtype=float32"], ["optimizer=adamw"]],
    "sd35_24gb": [["quantization=fp8"], ["quantization=nf4"], ["checkpoint=none"], ["trainer.variant=medium"]],
    "chroma_16gb": [["quantization=none"], ["checkpoint=none"]],
    "flux_kontext_24gb": [["trainer=flux", "data.references=0"], ["checkpoint=none"]],  # without the reference
    "z_image_16gb": [["quantization=none"], ["checkpoint=none"]],
    "lumina2_16gb": [["checkpoint=none"]],
    "flux2_24gb": [["offload.stream.device_budget_gb=null", "offload.stream.device_fraction=0.1"],
                   ["offload.stream.device_budget_gb=null", "offload.stream.device_fraction=0.2"],
                   ["offload.stream.prefetch=2"], ["offload.stream.prefetch=0"],
                   ["offload.stream.device_budget_gb=null", "offload.stream.device_fraction=0.25"],
                   ["quantization=[nf4]"], ["quantization=[nf4]", "offload=[park]", "~offload.stream"]],
    "flux2_klein_16gb": [["quantization=[nf4]"], ["checkpoint=none"], ["trainer.variant=klein-9b"],
                         ["trainer.variant=klein-9b", "quantization=[nf4]"]],
    "qwen_image_edit_24gb": [["trainer=qwen_image", "data.references=0"], ["train.grad_accum=1"]],  # without the reference
}


def command(preset: str, extra: list[str]) -> list[str]:
    return ["python -m runner", f"+preset={preset}", "mode=plan", "model.size=full", *extra]


def plan(preset: str, extra: list[str]) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "runner", *command(preset, extra)[1:], f"output_dir={tmp}"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wall = time.perf_counter() - t0
        if proc.returncode not in (0, 3):  # 3: planned, does not fit
            raise SystemExit(f"{' '.join(command(preset, extra))} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads((Path(tmp) / "plan.json").read_text()), wall


def gib(n: int | float) -> str:
    return f"{n / GiB:.2f}"


def describe(preset: str, p: dict, wall: float) -> list[str]:
    budget = f"{p['budget_bytes'] / GiB:g} GiB" if p["budget_bytes"] is not None else "-"
    run = p["run"]
    lines = [
        f"### `{preset}`",
        "",
        f"`{' '.join(command(preset, []))}` ({wall:.0f} s): {run['trainer']} ({run['model_train']}), "
        f"{run['resolution']} px, batch {run['batch_size']} ({run['micro_batches']} x {run['micro_batch_size']}), "
        f"{run['precision_text']}; {run['plugins']}; optimizer {run['optimizer']}.",
        "",
        f"- device peak **{gib(p['peak_bytes'])} GiB** in {p['peak_phase']}; needed with kernel workspaces "
        f"{gib(p['required_bytes'])} GiB; budget {budget}: {'fits' if p['fits'] else '**does not fit**'}",
        "- by phase (steady state): " + ", ".join(f"{k} {gib(v)}" for k, v in p["phases"].items()) + " GiB",
        f"- host RAM: peak {gib(p['host_peak_bytes'])} GiB (in {p['host_peak_phase']}), during training "
        f"{gib(p['host_steady_bytes'])} GiB, pinned {gib(p['host_pinned_bytes'])} GiB",
        "",
        "| at the peak (GiB) | " + " | ".join(c for c, v in p["by_category"].items() if v) + " | total |",
        "|---|" + "---|" * (sum(1 for v in p["by_category"].values() if v) + 1),
    ]
    cats = [c for c, v in p["by_category"].items() if v]
    for module, per in sorted(p["by_module"].items(), key=lambda kv: -sum(kv[1].values())):
        lines.append(f"| {module} | " + " | ".join(gib(per.get(c, 0)) for c in cats) + f" | {gib(sum(per.values()))} |")
    lines.append("| all | " + " | ".join(gib(p["by_category"][c]) for c in cats) + f" | {gib(p['peak_bytes'])} |")
    return lines


def section(rows: list[tuple[str, dict, float, list[tuple[list[str], dict, float]]]], load: float) -> str:
    lines = [
        BEGIN, SECTION, "",
        f"Command (CPU only, {os.cpu_count()} cores, 1-minute load average {load:.2f} at the start, "
        f"{time.strftime('%Y-%m-%d')}): `python bench/family_plans.py`. Each plan is the planner's own command, "
        "shown with it; bytes are what the planner counts for a CUDA GPU (they do not depend on this machine), "
        "the seconds are wall time on this machine.", "",
    ]
    for preset, p, wall, variants in rows:
        lines += describe(preset, p, wall)
        lines += ["", "Compared with (each on top of the preset):", "",
                  "| override | peak (phase) | needed | fits | host RAM peak |", "|---|---|---|---|---|",
                  f"| (the preset) | {gib(p['peak_bytes'])} GiB ({p['peak_phase']}) | {gib(p['required_bytes'])} GiB | "
                  f"{'yes' if p['fits'] else 'no'} | {gib(p['host_peak_bytes'])} GiB |"]
        for extra, v, _ in variants:
            lines.append(f"| `{' '.join(extra)}` | {gib(v['peak_bytes'])} GiB ({v['peak_phase']}) | "
                         f"{gib(v['required_bytes'])} GiB | {'yes' if v['fits'] else '**no**'} | "
                         f"{gib(v['host_peak_bytes'])} GiB |")
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(VARIANTS), help="comma-separated family presets")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing docs/benchmarks.md")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    rows = []
    for preset in args.presets.split(","):
        p, wall = plan(preset, [])
        print(f"{preset}: {gib(p['peak_bytes'])} GiB ({p['peak_phase']}), fits={p['fits']}", flush=True)
        variants = []
        for extra in VARIANTS.get(preset, []):
            v, w = plan(preset, extra)
            print(f"  {' '.join(extra)}: {gib(v['peak_bytes'])} GiB, fits={v['fits']}", flush=True)
            variants.append((extra, v, w))
        rows.append((preset, p, wall, variants))
    text = section(rows, load)
    if args.no_write:
        print(text)
    else:
        replace_section(text, BEGIN, END, DOC)
        print(f"wrote '{SECTION}' in {DOC}")


if __name__ == "__main__":
    main()
