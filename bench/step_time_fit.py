"""Fit the GPU step-time model's host constants on measured rows, and judge it on the rows left out.

The model is runner/plan/speed.py's with runner/plan/host.py's costs: per phase the host's time
(kernels, views, engine kernels, copies, the optimizer update by implementation, syncs) against
the card's (datasheet roofline x ``device_scale``), serial where a sync per parameter ends the
overlap, plus the loop's host work per step. The constants named in ``host.FITTED`` are fitted
here: least squares of log(measured / predicted) over the rows, plus ``PRIOR_WEIGHT`` x the squared
log distance of each from its stated prior (``host.PRIOR``), which keeps a constant no row informs
at its prior. The others stay at their priors.

Each row is priced as it ran (``AS_RUN``): the H200 rows of 2026-11-27 ran bitsandbytes 0.50, whose
8-bit AdamW syncs after every parameter, and fused backward read the clip norm on the host per
parameter; the code may since sync less, and a plan of today's code prices today's.

    python bench/step_time_fit.py                # the full-fit and leave-one-out tables
    python bench/step_time_fit.py --json         # one object per row: row, measured_s, predicted_s, held_out_ratio
    python bench/step_time_fit.py --extract --plans /tmp/plw   # rebuild the rows file from fresh plans

The rows file (``ROWS``) holds each measured row with its plan's per-phase figures
(``step_time.detail``), made on the CPU by ``python bench/gpu_truth.py --plan-only --device-name h200
--work /tmp/plw --only <rows>``; the OOM row is planned at the micro-batch it ran (``__half``).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runner.plan.host import FITTED, H200_FIT, PRIOR, HostCosts, StepShape  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gpu_truth_2026-11-27_h200"
ROWS = RESULTS / "step_time_rows.json"
PRIOR_WEIGHT = 0.02
# What each measured row ran (row -> the plan that describes it, and its host shape beyond the plan's ops).
AS_RUN: dict[str, dict[str, Any]] = {
    "sd15_8gb": {"plan": "sd15_8gb", "micro_batches": 1, "update_syncs_per_param": 1,
                 "ran": "bitsandbytes 0.50 AdamW8bit: sync_gpu after each parameter"},
    "sd15_8gb__oom_recovery": {"plan": "sd15_8gb__oom_recovery__half", "micro_batches": 2, "update_syncs_per_param": 1,
                               "ran": "steps 2-3 at micro-batch 4 of 8 (the plan at that micro-batch); bitsandbytes syncs"},
    "sdxl_24gb": {"plan": "sdxl_24gb", "micro_batches": 1, "update_syncs_per_param": 1,
                  "ran": "bitsandbytes 0.50 AdamW8bit: sync_gpu after each parameter"},
    "sdxl_24gb__fused_backward": {"plan": "sdxl_24gb__fused_backward", "micro_batches": 1, "update_syncs_per_param": 1,
                                  "hook_syncs_per_param": 1, "hook_step_calls_per_param": 1,
                                  "ran": "fused backward, clipping on: float(norm) and bitsandbytes' sync per parameter"},
    "sd35_24gb": {"plan": "sd35_24gb", "micro_batches": 1, "update_syncs_per_param": 0,
                  "ran": "LoRA, torch AdamW foreach=False: no sync per parameter"},
    "sd35_24gb__stream": {"plan": "sd35_24gb__stream", "micro_batches": 1, "update_syncs_per_param": 0,
                          "ran": "as sd35_24gb, with offload=[park,stream] (pinned copies on a side stream)"},
}


@functools.lru_cache(maxsize=1)
def _h200() -> Any:
    from runner.devices import device_spec
    from runner.plan.speed import gpu_target

    return gpu_target(device_spec({"name": "h200"}))


def _target(costs: HostCosts) -> Any:
    return replace(_h200(), host_costs=costs)


def predict_row(rec: dict[str, Any], costs: HostCosts) -> float:
    """The row's s/step under ``costs``: runner/plan/speed.py's predict on the plan's recorded figures."""
    from runner.plan.speed import predict

    counter, trained, transfers, shape = _inputs(rec)
    st = predict(counter, _target(costs), micro_batches=1, simulated_micro=1, transfers=transfers,
                 optimizer=shape.optimizer, trained=trained, fused=shape.fused, shape=shape)
    return st.seconds


_INPUTS: dict[int, tuple[dict[str, Any], tuple]] = {}


def _inputs(rec: dict[str, Any]) -> tuple:
    """predict's inputs rebuilt from a row's recorded figures (once per row: the fit asks thousands of times;
    predict changes none of them: its phases are copies, and the transfers move nothing to the host)."""
    got = _INPUTS.get(id(rec))
    if got is not None and got[0] is rec:
        return got[1]
    from runner.context import Transfer
    from runner.plan.cost import CostCounter, PhaseCost
    from runner.plan.speed import Trained

    d, target = rec["detail"], _h200()
    counter = CostCounter(target.device, target.host)
    names = {f.name for f in fields(PhaseCost)}
    counter.phases = {k: PhaseCost(**{f: v for f, v in c.items() if f in names}) for k, c in d["phases"].items()}
    u = d["optimizer_update"]
    trained = Trained(device_elements=u["device_elements"], device_bytes=_param_bytes(rec, "device"),
                      device_params=u["device_params"], host_elements=u["host_elements"],
                      host_bytes=_param_bytes(rec, "host"), host_params=u["host_params"])
    transfers = {k: Transfer(**{**t, "host_step_elements": 0}) for k, t in d["transfers"].items()}
    calls = AS_RUN.get(rec.get("row", ""), {}).get("hook_step_calls_per_param", 0)  # what the row ran (AS_RUN)
    out = (counter, trained, transfers, StepShape(**{**rec["shape"], "hook_step_calls_per_param": calls}))
    _INPUTS[id(rec)] = (rec, out)
    return out


def _param_bytes(rec: dict[str, Any], where: str) -> int:
    """The trained parameters' bytes back from the update's recorded traffic (speed.UPDATE_TRAFFIC's inverse)."""
    from runner.plan.speed import UPDATE_TRAFFIC

    per_byte, const = UPDATE_TRAFFIC.get(rec["shape"]["optimizer"], UPDATE_TRAFFIC["adamw"])
    u = rec["detail"]["optimizer_update"]
    return int(round((u[f"{where}_bytes"] - const * u[f"{where}_elements"]) / per_byte)) if per_byte else 0


def loss(recs: list[dict[str, Any]], costs: HostCosts) -> float:
    fit = sum(math.log(r["measured_s"] / predict_row(r, costs)) ** 2 for r in recs)
    pull = sum(math.log(getattr(costs, f) / getattr(PRIOR, f)) ** 2 for f in FITTED)
    return fit + PRIOR_WEIGHT * pull


def _nelder_mead(f: Callable[[list[float]], float], x0: list[float], iters: int = 1200) -> list[float]:
    """Minimise ``f`` from ``x0`` (standard Nelder-Mead, deterministic; no scipy in the runner's environment)."""
    n = len(x0)
    pts = [list(x0)] + [[x + (0.5 if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: vals[i])
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        c = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        xr = [c[j] + (c[j] - pts[-1][j]) for j in range(n)]
        fr = f(xr)
        if fr < vals[0]:
            xe = [c[j] + 2 * (c[j] - pts[-1][j]) for j in range(n)]
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = [c[j] + 0.5 * (pts[-1][j] - c[j]) for j in range(n)]
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [[pts[0][j] + 0.5 * (p[j] - pts[0][j]) for j in range(n)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
        if max(vals) - min(vals) < 1e-10:
            break
    return pts[min(range(n + 1), key=lambda i: vals[i])]


def fit(recs: list[dict[str, Any]]) -> HostCosts:
    """The constants of ``host.FITTED`` that minimise :func:`loss` over ``recs`` (the others at their priors)."""
    def costs_of(x: list[float]) -> HostCosts:
        return replace(PRIOR, **{name: math.exp(v) for name, v in zip(FITTED, x)})

    x = _nelder_mead(lambda x: loss(recs, costs_of(x)), [math.log(getattr(PRIOR, f)) for f in FITTED])
    return costs_of(x)


def load_rows(path: Path = ROWS) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["rows"]


def held_out(recs: list[dict[str, Any]], i: int) -> float:
    """Row ``i``'s prediction from a fit of the other rows only."""
    return predict_row(recs[i], fit(recs[:i] + recs[i + 1:]))


def report(recs: list[dict[str, Any]]) -> tuple[HostCosts, list[dict[str, Any]]]:
    """The full fit, and per row: measured, full-fit prediction, and the prediction of a fit without it."""
    full = fit(recs)
    out = []
    for i, rec in enumerate(recs):
        held = held_out(recs, i)
        fitted = predict_row(rec, full)
        out.append({"row": rec["row"], "measured_s": rec["measured_s"], "predicted_s": held,
                    "held_out_ratio": rec["measured_s"] / held, "full_fit_s": fitted,
                    "full_fit_ratio": rec["measured_s"] / fitted,
                    "shipped_s": predict_row(rec, H200_FIT), "ran": rec["ran"]})
    return full, out


def extract(rows_dirs: list[Path], plans: Path) -> dict[str, Any]:
    """The rows file from gpu_truth outputs (rows.jsonl) and plans made for them (``--plans``)."""
    measured: dict[str, float] = {}
    for folder in rows_dirs:
        for line in (folder / "rows.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("status") == "ok" and rec.get("s_per_step"):
                measured[rec["row"]] = float(rec["s_per_step"])
    rows = []
    for row, how in AS_RUN.items():
        st = json.loads((plans / "plans" / how["plan"] / "plan.json").read_text())["step_time"]
        d = st["detail"]
        keep = {k: d[k] for k in ("phases", "optimizer_update", "transfers", "copies_overlapped_share",
                                  "first_window_bytes")}
        shape = StepShape(optimizer=_optimizer_of(plans / "plans" / how["plan"]), params=d["optimizer_update"]["device_params"],
                          micro_batches=how["micro_batches"], fused=d["optimizer_update"]["in"] == "backward",
                          update_syncs_per_param=how["update_syncs_per_param"],
                          hook_syncs_per_param=how.get("hook_syncs_per_param"),
                          hook_step_calls_per_param=how.get("hook_step_calls_per_param", 0))
        rows.append({"row": row, "plan": how["plan"], "measured_s": measured[row], "ran": how["ran"],
                     "shape": asdict(shape), "flops": st["flops"], "detail": keep})
    return {"device": "h200", "source": [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)
                                         for p in rows_dirs], "rows": rows}


def _optimizer_of(folder: Path) -> str:
    """``optimizer.name`` of the plan's resolved_config.yaml (the runner writes it beside plan.json)."""
    lines = (folder / "resolved_config.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("optimizer:"):
            for inner in lines[i + 1:]:
                if inner.strip().startswith("name:"):
                    return inner.split(":", 1)[1].strip()
    raise SystemExit(f"bench/step_time_fit.py: no optimizer.name in {folder / 'resolved_config.yaml'}")


def table(full: HostCosts, out: list[dict[str, Any]]) -> str:
    lines = ["Constants (full fit; fitted: " + ", ".join(FITTED) + "; the others are priors, runner/plan/host.py):", ""]
    lines += ["| constant | full fit | prior |", "|---|---|---|"]
    for f in fields(HostCosts):
        a, p = getattr(full, f.name), getattr(PRIOR, f.name)
        unit = {"device_scale": lambda v: f"{v:.3g}", "step_s": lambda v: f"{v:.3g} s"}.get(
            f.name, lambda v: f"{v * 1e6:.3g} us")
        lines.append(f"| `{f.name}` | {unit(a)}{'' if f.name in FITTED else ' (prior)'} | {unit(p)} |")
    lines += ["", "| row | what it ran | measured s/step | full fit s/step | measured ÷ full fit | held out: "
              "predicted s/step | held out: measured ÷ predicted |", "|---|---|---|---|---|---|---|"]
    for o in out:
        lines.append(f"| `{o['row']}` | {o['ran']} | {o['measured_s']:.3g} | {o['full_fit_s']:.3g} | "
                     f"{o['full_fit_ratio']:.2f} | {o['predicted_s']:.3g} | {o['held_out_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    ap.add_argument("--rows", type=Path, default=ROWS, help=f"the rows file (default {ROWS.relative_to(ROOT)})")
    ap.add_argument("--extract", action="store_true", help="write --rows from --plans and the measured rows")
    ap.add_argument("--plans", type=Path, help="gpu_truth.py --plan-only's --work folder")
    args = ap.parse_args(argv)
    if args.extract:
        if args.plans is None:
            ap.error("--extract needs --plans")
        data = extract([RESULTS / "run1", RESULTS / "run2"], args.plans)
        args.rows.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.rows} ({len(data['rows'])} rows)")
        return 0
    full, out = report(load_rows(args.rows))
    if args.json:
        for o in out:
            print(json.dumps({k: o[k] for k in ("row", "measured_s", "predicted_s", "held_out_ratio")}))
        return 0
    print(table(full, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
