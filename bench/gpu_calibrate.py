"""Recalibrate the step-time model's host cost per dispatched op from GPU truth rows (issue 33).

Superseded for GPU plans by bench/step_time_fit.py (issue 41: host costs by kind of work, with a
leave-one-out check); a GPU plan made since keeps ``step_time.detail.host`` and is refused here.
What follows is the one-constant refit of issue 33, kept for plans made before.

The GPU step-time model (runner/plan/speed.py) prices each phase as the larger of the GPU work
and the host's dispatch (ops x ``HOST_OP_S``), plus copies. The GPU work comes from datasheet
peaks; the host cost per op was an assumption. This script takes the rows a GPU measured
(bench/gpu_truth.py's rows.jsonl) and the plans of the same rows (``bench/gpu_truth.py
--plan-only --device-name <card> --work <folder>``: <folder>/plans/<row>/plan.json), recomputes
each plan's predicted seconds for other host costs from the per-phase figures the plan keeps
(``step_time.detail``: it checks first that it reproduces the plan's own prediction), and prints
the host cost that minimises the squared log ratio measured / predicted over the rows, with each
row's ratio before and after. Why only the host cost: it is the one assumption the rows can
separate (all but one row are dispatch-bound in the model at the fitted value); the GPU
efficiencies need per-phase GPU timings, which 3 steps of a whole run do not give.

    python bench/gpu_calibrate.py --rows bench/results/gpu_truth_2026-11-27_h200/run1 \\
        bench/results/gpu_truth_2026-11-27_h200/run2 --plans /tmp/plw
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any


def phase_seconds(st: dict[str, Any], host_op_s: float) -> float:
    """The plan's predicted s/step with another host cost per op (the optimizer update's per-op cost
    scales with it: on a GPU target both are HOST_OP_S; a CPU's are measured apart)."""
    d = st["detail"]
    rates, upd, share, window = d["rates"], d["optimizer_update"], d["copies_overlapped_share"], d["first_window_bytes"]
    h2d = rates["h2d_bytes_per_s"]
    update_op_s = rates["update_op_s"] * host_op_s / rates["host_op_s"]
    total = 0.0
    for name, c in d["phases"].items():
        in_upd = name == upd["in"]
        device_s = c["device_s"] + (upd["device_s"] if in_upd else 0.0)
        dispatch = c["ops"] * host_op_s + (upd["device_kernels"] * update_op_s if in_upd else 0.0)
        compute = device_s + dispatch if rates["serial"] else max(device_s, dispatch)
        ovl = (share["h2d"] * c["h2d_bytes"] + share["d2h"] * c["d2h_bytes"]) / h2d
        blocking = ((1 - share["h2d"]) * c["h2d_bytes"] + (1 - share["d2h"]) * c["d2h_bytes"]) / h2d
        t = max(compute, ovl) + blocking + c["host_s"]
        if name == "forward" and ovl and window:
            t += window / h2d
        if name == "optimizer":
            t += upd["host_s"] + upd["host_kernels"] * update_op_s
        total += t
    return total


def load(rows_dirs: list[Path], plans: Path) -> list[tuple[str, float, dict[str, Any]]]:
    """(row, measured s/step, the plan's step_time) of every measured row with a plan."""
    out: dict[str, tuple[str, float, dict[str, Any]]] = {}
    for folder in rows_dirs:
        for line in (folder / "rows.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("status") != "ok" or rec.get("kind") == "oom" or not rec.get("s_per_step"):
                continue  # the OOM row ran a smaller micro-batch than its plan
            plan = plans / "plans" / rec["row"] / "plan.json"
            if plan.is_file():
                out[rec["row"]] = (rec["row"], float(rec["s_per_step"]), json.loads(plan.read_text())["step_time"])
    return list(out.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=Path, nargs="+", required=True, help="gpu_truth output folders (rows.jsonl)")
    ap.add_argument("--plans", type=Path, required=True, help="the --work folder of gpu_truth.py --plan-only")
    args = ap.parse_args()
    rows = load(args.rows, args.plans)
    if not rows:
        raise SystemExit("bench/gpu_calibrate.py: no measured row has a plan in --plans")
    for name, _, st in rows:
        if st["detail"].get("host"):
            raise SystemExit(f"bench/gpu_calibrate.py: {name}'s plan prices the host by kind of work: use "
                             "bench/step_time_fit.py")
        again = phase_seconds(st, st["detail"]["rates"]["host_op_s"])
        if not math.isclose(again, st["seconds"], rel_tol=1e-4):
            raise SystemExit(f"bench/gpu_calibrate.py: {name}: recomputed {again:.6g} s, the plan says "
                             f"{st['seconds']:.6g} s: this script no longer matches runner/plan/speed.py")
    grid = [i * 0.5e-6 for i in range(2, 201)]

    def loss(h: float) -> float:
        return sum(math.log(m / phase_seconds(st, h)) ** 2 for _, m, st in rows)

    best = min(grid, key=loss)
    old = rows[0][2]["detail"]["rates"]["host_op_s"]
    print(f"host cost per dispatched op: {old * 1e6:g} us -> {best * 1e6:g} us (least squares of log ratios, "
          f"{len(rows)} rows)\n")
    print("| row | measured s/step | predicted before | measured ÷ predicted | predicted after | measured ÷ predicted |")
    print("|---|---|---|---|---|---|")
    for name, m, st in rows:
        a, b = phase_seconds(st, old), phase_seconds(st, best)
        print(f"| `{name}` | {m:.3g} | {a:.3g} | {m / a:.2f} | {b:.3g} | {m / b:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
