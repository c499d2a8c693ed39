"""Predicted against measured s/step on this CPU: does the step-time model rank configurations right?

    python bench/step_time_cpu.py [--rounds 3] [--steps 6] [--no-write]

The planner predicts a ``train.device=cpu`` step from a calibration of this CPU (runner/plan/
calibrate.py). Over the tiny-model configurations below (checkpointing on and off, batch 1-8,
64-256 px, LoRA or full, offload on and off) this script

1. measures the calibration once per round and caches the median of the rounds' rates (the
   planner reads the cache), so the rates and the runs see the same machine;
2. runs each configuration as a user does (``python -m runner ... train.steps=N``, a process
   each), in interleaved rounds (configuration 1..n, then again), so that a change in the
   machine's load hits every configuration alike; a configuration's measured s/step is the
   median over its rounds of the median step time of steps 2..N (step 1 warms up);
3. predicts each with ``mode=plan train.device=cpu`` and reports the Spearman rank correlation of
   predicted and measured s/step, with the table, in docs/benchmarks.md.

The 1-minute load average is recorded per round; on a shared machine the absolute times move
with it, the ranks much less.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from docs_section import replace_section  # bench/ is on sys.path as the script's folder

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SECTION = "## Step-time model against measured CPU steps (bench/step_time_cpu.py)"
BEGIN, END = "<!-- bench/step_time_cpu.py begin -->", "<!-- bench/step_time_cpu.py end -->"
COMMON = ["train.device=cpu", "train.progress=false", "export.enabled=false", "train.preflight=false",
          "data.demo_size=16", "train.max_grad_norm=1.0"]
THREADS = 1
CONFIGS: dict[str, list[str]] = {
    "full, batch 1, 64 px": ["train.batch_size=1", "data.resolution=64"],
    "full, batch 2, 64 px": ["train.batch_size=2", "data.resolution=64"],
    "full, batch 4, 64 px, checkpointing": ["train.batch_size=4", "data.resolution=64", "checkpoint=blocks"],
    "full, batch 8, 64 px": ["train.batch_size=8", "data.resolution=64"],
    "full, batch 2, 128 px": ["train.batch_size=2", "data.resolution=128"],
    "full, batch 2, 128 px, checkpointing": ["train.batch_size=2", "data.resolution=128", "checkpoint=blocks"],
    "full, batch 1, 256 px": ["train.batch_size=1", "data.resolution=256"],
    "LoRA, batch 2, 64 px": ["model.train=lora", "train.batch_size=2", "data.resolution=64"],
    "LoRA, batch 4, 128 px, checkpointing": ["model.train=lora", "train.batch_size=4", "data.resolution=128",
                                             "checkpoint=blocks"],
    "LoRA, batch 2, 256 px": ["model.train=lora", "train.batch_size=2", "data.resolution=256"],
    "full, batch 2, 64 px, offload=park": ["train.batch_size=2", "data.resolution=64", "offload=park"],
    "LoRA, batch 4, 128 px, offload=park, checkpointing": ["model.train=lora", "train.batch_size=4",
                                                           "data.resolution=128", "offload=park", "checkpoint=blocks"],
    "full, batch 4, 128 px, offload=optimizer": ["train.batch_size=4", "data.resolution=128", "offload=optimizer"],
    "LoRA, batch 8, 64 px, offload=park": ["model.train=lora", "train.batch_size=8", "data.resolution=64",
                                           "offload=park"],
}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties get their average rank). Written out: scipy is not a dependency."""
    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def measure_run(overrides: list[str], steps: int, cache: Path) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "runner", *COMMON, *overrides, f"train.steps={steps}", f"output_dir={out}"]
        env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONUNBUFFERED": "1"}
        if THREADS:
            env["OMP_NUM_THREADS"] = str(THREADS)  # torch's intra-op threads in the run
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(overrides)} failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median(r["s_per_step"] for r in rows[1:])


def calibrate_rounds(rounds: list[dict]) -> dict:
    from runner.plan import calibrate

    keys = ("matmul_fp32_flops", "matmul_bf16_flops", "conv_fp32_flops", "bytes_per_s", "op_s", "update_op_s")
    median = {k: statistics.median(r[k] for r in rounds) for k in keys}
    threads = torch.get_num_threads()
    path = calibrate.cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    cached[calibrate._key(threads)] = {**median, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                                       "rounds": len(rounds)}
    path.write_text(json.dumps(cached, indent=1))
    calibrate._MEASURED.clear()
    return median


def predict_all(cache: Path) -> dict[str, float]:
    from runner.cli.compose import compose_config
    from runner.checks import validate
    from runner.plan import plan_step

    out = {}
    for name, overrides in CONFIGS.items():
        cfg = compose_config([*COMMON, *overrides, "mode=plan"])
        validate(cfg)
        out[name] = plan_step(cfg).seconds_per_step
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads of the runs and the calibration (0: torch's default). 1 by default: on a "
                         "shared 2-core machine two threads stall on each other's barriers (see tests/conftest.py)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    global THREADS
    THREADS = args.threads
    if THREADS:
        torch.set_num_threads(THREADS)
    from runner.plan import calibrate

    cache = Path(tempfile.mkdtemp(prefix="step_time_cpu_"))
    os.environ["XDG_CACHE_HOME"] = str(cache)  # this process's calibration and the runs' encoder caches
    measured: dict[str, list[float]] = {n: [] for n in CONFIGS}
    loads, rates = [], []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        rates.append(calibrate.measure(torch.get_num_threads()))
        for name, overrides in CONFIGS.items():
            measured[name].append(measure_run(overrides, args.steps, cache))
            print(f"round {r + 1}: {name}: {measured[name][-1]:.3f} s/step", flush=True)
    loads.append(os.getloadavg()[0])
    median = calibrate_rounds(rates)
    predicted = predict_all(cache)
    names = list(CONFIGS)
    meas = [statistics.median(measured[n]) for n in names]
    pred = [predicted[n] for n in names]
    rho = spearman(pred, meas)
    print(f"Spearman rank correlation predicted vs measured: {rho:.3f}")
    lines = [
        BEGIN, SECTION, "",
        f"Command: `python bench/step_time_cpu.py --rounds {args.rounds} --steps {args.steps} --threads {args.threads}` "
        f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {torch.get_num_threads()} threads; 1-minute load "
        f"average at the start of each round and at the end: {', '.join(f'{x:.1f}' for x in loads)}). "
        "Tiny SDXL-architecture model, `train.device=cpu`; each run is `python -m runner "
        f"{' '.join(COMMON)} <the row's settings> train.steps={args.steps}`; measured = median over the rounds of "
        "the median s/step of steps 2..N; predicted = `mode=plan` with the median calibration of the rounds "
        f"(matmul {median['matmul_fp32_flops'] / 1e9:.1f} GFLOP/s fp32, convolution "
        f"{median['conv_fp32_flops'] / 1e9:.1f} GFLOP/s, memory {median['bytes_per_s'] / 1e9:.1f} GB/s, "
        f"{median['op_s'] * 1e6:.0f} us per dispatched op of a training step, {median['update_op_s'] * 1e6:.0f} us per "
        "optimizer-update op).",
        "",
        f"**Spearman rank correlation, predicted vs measured: {rho:.3f}** over {len(names)} configurations.",
        "",
        "| configuration | predicted s/step | measured s/step (rounds) | measured / predicted |",
        "|---|---|---|---|",
    ]
    for n, p, m in zip(names, pred, meas):
        rounds = ", ".join(f"{x:.3f}" for x in measured[n])
        lines.append(f"| {n} | {p:.3f} | {m:.3f} ({rounds}) | {m / p:.2f} |")
    lines.append(END)
    text = "\n".join(lines)
    if args.no_write:
        print(text)
    else:
        replace_section(text, BEGIN, END)
        print("wrote", SECTION)


if __name__ == "__main__":
    main()
