"""Card ops and host syncs per step: the plan's count against the simulated card's (issue 41).

    python bench/card_ops.py [--preset sdxl_24gb] [--steps 3] [EXTRA=OVERRIDE ...]

Runs the preset at model.size=tiny on ``train.device=cuda_sim`` with fused backward off/on and clipping
on/off (each a subprocess, as a user runs it); each run's job_summary.json has what the simulated card
counted (``card_ops_per_step``, ``host_syncs_per_step``: the mean after step 1) and its plan.json what the
preflight plan counted for the same step (``step_time``), with the predicted s/step for the planned card.
Extra overrides (``train.compile=true``, ``optimizer=adamw``) are added to every run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = (("false", "1.0"), ("false", "0"), ("true", "1.0"), ("true", "0"))


def run_one(preset: str, steps: int, fused: str, clip: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        env = dict(os.environ, XDG_CACHE_HOME=str(Path(tmp) / "cache"), OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-m", "runner", f"+preset={preset}", "train.device=cuda_sim",
                            f"train.steps={steps}", "train.progress=false", "sample.every=0", "export.enabled=false",
                            f"optimizer.fused_backward={fused}", f"train.max_grad_norm={clip}", f"output_dir={out}", *extra],
                           cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        try:
            s = json.loads((out / "job_summary.json").read_text())
            st = json.loads((out / "plan.json").read_text())["step_time"]
        except OSError:
            return {"fused": fused, "clip": clip, "error": (r.stderr or r.stdout).strip().splitlines()[-1:]}
        losses = [json.loads(line).get("loss") for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"fused": fused, "clip": clip, "sim_card_ops": s["card_ops_per_step"], "plan_card_ops": st["card_ops_per_step"],
            "sim_syncs": s["host_syncs_per_step"], "plan_syncs": st["host_syncs_per_step"],
            "ratio": st["card_ops_per_step"] / s["card_ops_per_step"], "planned_s": st["seconds"], "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="sdxl_24gb")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cases", default="", help="fused:clip pairs, e.g. false:1.0,true:0 (default: all four)")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    cases = [tuple(c.split(":")) for c in a.cases.split(",")] if a.cases else CASES
    print("| fused backward | max_grad_norm | cuda_sim card ops/step | planned | planned ÷ cuda_sim | host syncs (sim / plan) "
          "| planned s/step (reference card) |")
    print("|---|---|---|---|---|---|---|")
    for fused, clip in cases:
        r = run_one(a.preset, a.steps, fused, clip, a.extra)
        if "error" in r:
            print(f"| {fused} | {clip} | error: {r['error']} | | | | |")
            continue
        print(f"| {fused} | {clip} | {r['sim_card_ops']:,.0f} | {r['plan_card_ops']:,} | {r['ratio']:.4f} | "
              f"{r['sim_syncs']:g} / {r['plan_syncs']} | {r['planned_s']:.3f} |", flush=True)
        print(f"<!-- losses {r['losses']} -->", file=sys.stderr)


if __name__ == "__main__":
    main()
