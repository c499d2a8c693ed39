"""The plan's reserved bytes against what a GPU's caching allocator reserved, row by row.

    python bench/reserved_check.py [--runs bench/results/gpu_truth_2026-11-27_h200/run1 ...] [--write]

It re-plans the measured rows of committed ``bench/gpu_truth.py`` runs (``--plan-only`` with the
card those runs used, so each plan has the settings its row ran with) and sets each plan's
reserved figure (runner/plan/allocator.py: the step's allocations replayed through the caching
allocator's model, plus the kernel workspace margin) beside the row's ``max_memory_reserved``.
No GPU is needed: the measurements are the committed files. ``--write`` replaces this script's
section of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_section import replace_section

ROOT = Path(__file__).resolve().parents[1]
RUNS = [ROOT / "bench/results/gpu_truth_2026-11-27_h200/run1", ROOT / "bench/results/gpu_truth_2026-11-27_h200/run2"]
BEGIN, END = "<!-- bench/reserved_check.py begin -->", "<!-- bench/reserved_check.py end -->"
GiB = 2**30


def measured_rows(runs: list[Path]) -> tuple[dict[str, dict], str]:
    rows: dict[str, dict] = {}
    card = ""
    for run in runs:
        meta = json.loads((run / "meta.json").read_text())
        card = card or str(meta.get("device_key") or meta.get("device_name") or "")
        for line in (run / "rows.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row.get("status") == "ok" and row.get("kind") != "oom":  # the OOM row runs under a cap on purpose
                rows[row["row"]] = row
    return rows, card


def plans(names: list[str], card: str, work: Path) -> dict[str, dict]:
    cmd = [sys.executable, str(ROOT / "bench/gpu_truth.py"), "--plan-only", "--only", ",".join(names),
           "--work", str(work), "--out", str(work / "out"), "--jobs", "1"]
    if card:
        cmd += ["--device-name", card]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return {n: json.loads((work / "plans" / n / "plan.json").read_text()) for n in names}


def table(rows: dict[str, dict], planned: dict[str, dict], label: str) -> str:
    lines = [BEGIN, "## Planned reserved bytes against the GPU's (bench/reserved_check.py)", "",
             f"Command: `python bench/reserved_check.py --write` (no GPU: it re-plans the measured rows of the "
             f"committed GPU-truth runs on {label} and reads their `torch.cuda.max_memory_reserved`). The plan's "
             "reserved figure replays the step's device allocations through the caching allocator's model "
             "(runner/memory/caching_allocator.py; expandable segments, as the allocator plugin sets them) and "
             "adds the 128 MiB workspace margin.", "",
             "| row | max allocated GiB | max reserved GiB | planned required GiB | planned reserved GiB | "
             "reserved ÷ required | reserved ÷ planned reserved |", "|---|---|---|---|---|---|---|"]
    for name in sorted(rows):
        row, plan = rows[name], planned[name]
        reserved = row["reserved_peak_gb"]
        req, res = plan["required_bytes"] / GiB, (plan.get("reserved_required_bytes") or 0) / GiB
        lines.append(f"| `{name}` | {row['alloc_peak_gb']:.3f} | {reserved:.3f} | {req:.3f} | {res:.3f} | "
                     f"{reserved / req:.3f} | {reserved / res:.3f} |" if res else f"| `{name}` | - | - | - | - | - | - |")
    lines += ["", "Rows with side streams (`__stream`) reserve more than the model says: a block a copy stream used "
              "is reusable only once that stream's work is done (`record_stream`), which an in-order simulation "
              "cannot see (runner/memory/caching_allocator.py, \"Not modelled\").", END]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", type=Path, default=RUNS, help="committed gpu_truth output folders")
    ap.add_argument("--write", action="store_true", help="replace this script's section of docs/benchmarks.md")
    a = ap.parse_args()
    rows, card = measured_rows(a.runs)
    with tempfile.TemporaryDirectory() as tmp:
        planned = plans(sorted(rows), card, Path(tmp))
    label = json.loads((a.runs[0] / "meta.json").read_text()).get("device", card) or card
    text = table(rows, planned, str(label))
    print(text)
    if a.write:
        replace_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
