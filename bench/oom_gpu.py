"""A real CUDA out-of-memory, recovered: the runner splits the micro-batch and the result matches.

    python bench/oom_gpu.py                        # tiny SDXL at 512 px, batch 16, 3 steps
    python bench/oom_gpu.py --resolution 256 --batch 8 -- model.train=lora
    python bench/oom_gpu.py --write                # also replace this script's section of docs/benchmarks.md

Needs a CUDA device (any size): the card is made small with ``allocator.cap_to_budget=true``
(``torch.cuda.set_per_process_memory_fraction``), so nothing is faked. Cases, each a full run of
the runner in this process:

1. ``micro=B``  no cap, micro-batch = batch: its peak reserved bytes R_B;
2. ``micro=B/4`` no cap: its peak reserved bytes R_B/4;
3. ``capped``   micro-batch = batch under a cap halfway between R_B/4 and R_B: the first step
   runs out of memory, the runner halves the micro-batch until the step fits and keeps it;
4. ``same micro from start`` no cap, micro-batch = what case 3 ended with: case 3 must match it
   (bit for bit where the kernels are deterministic; we ask for deterministic algorithms);
5. ``give up``  micro-batch 1 under a cap between its resident bytes (weights, optimizer state)
   and its peak: the run must stop with OutOfMemoryGiveUp (exit status 3 on the command line).

Prints one markdown section: the peaks, the cap, per-step micro-batch sizes, the OOM counters
from ``torch.cuda.memory_stats`` and the parameter differences.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from docs_section import replace_section  # noqa: E402  (bench/ is on sys.path as the script's folder)

MARK_BEGIN = "<!-- bench/oom_gpu.py begin -->"
MARK_END = "<!-- bench/oom_gpu.py end -->"
GIB = 2**30


def fresh_device() -> None:
    """Between cases: no cap, nothing cached, peaks from zero. Before the first case CUDA is left
    uninitialised, so the allocator plugin's settings (expandable segments) still take effect."""
    import torch

    gc.collect()
    if not torch.cuda.is_initialized():
        return
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run_case(out: Path, overrides: list[str]) -> dict:
    import torch

    from runner.__main__ import task
    from runner.cli.compose import compose_config
    from runner.guards.oom import OutOfMemoryGiveUp
    from runner.output.report import read_metrics

    fresh_device()
    error = None
    try:
        task(compose_config([f"output_dir={out}", "train.progress=false", "train.device=cuda", *overrides]))
    except OutOfMemoryGiveUp as e:
        error = e
    torch.cuda.synchronize()
    rows = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []
    stats = torch.cuda.memory_stats()
    return {"rows": rows, "error": error, "peak_reserved": torch.cuda.max_memory_reserved(),
            "peak_allocated": torch.cuda.max_memory_allocated(), "num_ooms": stats.get("num_ooms", 0),
            "num_alloc_retries": stats.get("num_alloc_retries", 0), "out": out}


def final_params(case: dict):
    from safetensors.torch import load_file

    ckpt = case["out"] / "checkpoints"
    return load_file(str(ckpt / (ckpt / "latest").read_text().strip() / "trainable.safetensors"))


def compare(a: dict, b: dict) -> str:
    import torch

    pa, pb = final_params(a), final_params(b)
    equal = all(torch.equal(pa[k], pb[k]) for k in pa)
    diff = max((pa[k].float() - pb[k].float()).abs().max().item() for k in pa)
    return f"{'bit-identical' if equal else 'not bit-identical'}, max |diff| {diff:.3g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=("tiny", "full"))
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16, help="train.batch_size (a multiple of 4)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="replace this script's section of docs/benchmarks.md")
    ap.add_argument("overrides", nargs="*", help="extra runner overrides (after --)")
    args = ap.parse_args()
    if args.batch % 4:
        ap.error("--batch must be a multiple of 4")
    # Deterministic cuBLAS/cuDNN, so that "same micro-batch from the start" can be bit-identical.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/oom_gpu.py needs a CUDA device (it caps the card with set_per_process_memory_fraction).")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False

    from runner.config import load_all
    load_all()
    b = args.batch
    base = [f"model.size={args.size}", f"data.resolution={args.resolution}", f"train.batch_size={b}",
            f"train.steps={args.steps}", "train.save_every=0", "data.demo_size=32", *args.overrides]
    work = Path(tempfile.mkdtemp(prefix="bench-oom-"))
    lines = []
    try:
        full = run_case(work / "full", [*base, "train.grad_accum=1"])
        quarter = run_case(work / "quarter", [*base, "train.grad_accum=4"])
        cap = (full["peak_reserved"] + quarter["peak_reserved"]) / 2
        capped = run_case(work / "capped", [*base, "train.grad_accum=1", "allocator.cap_to_budget=true",
                                            f"budget_gb={cap / GIB:.4f}"])
        if capped["error"] is not None:
            raise SystemExit(f"the capped run gave up instead of recovering: {capped['error']}")
        micros = [r["micro_batch_size"] for r in capped["rows"]]
        same = run_case(work / "same", [*base, f"train.grad_accum={b // micros[-1]}"])
        one = run_case(work / "one", [*base, f"train.grad_accum={b}"])
        # Halfway between what stays allocated between steps (weights, optimizer state) and the
        # micro-batch-1 peak: the weights still fit on the card, one sample's step does not.
        resident = (one["rows"][-1]["mem_allocated_gb"] or 0.0) * GIB
        give_up_cap = (resident + one["peak_reserved"]) / 2
        give_up = run_case(work / "give_up", [*base, f"train.grad_accum={b}", "allocator.cap_to_budget=true",
                                              f"budget_gb={give_up_cap / GIB:.4f}"])
    finally:
        fresh_device()
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        def row(label: str, case: dict, cap_bytes: float | None) -> str:
            ms = [r["micro_batch_size"] for r in case["rows"]]
            retries = [r.get("oom_retries", 0) for r in case["rows"]]
            status = "gave up (OutOfMemoryGiveUp)" if case["error"] is not None else "completed"
            return (f"| {label} | {'-' if cap_bytes is None else f'{cap_bytes / GIB:.3f}'} | "
                    f"{case['peak_reserved'] / GIB:.3f} | {case['peak_allocated'] / GIB:.3f} | {ms} | {retries} | "
                    f"{case['num_ooms']} | {case['num_alloc_retries']} | {status} |")

        command = "python bench/oom_gpu.py " + " ".join(sys.argv[1:])
        lines = [
            MARK_BEGIN,
            "## OOM recovery on a real CUDA OOM",
            "",
            f"Command: `{command.strip()}` on {torch.cuda.get_device_name()} ({total / GIB:.1f} GiB, torch "
            f"{torch.__version__}); training overrides: `{' '.join(base)}`. The cap is "
            "`allocator.cap_to_budget=true budget_gb=<cap>` (set_per_process_memory_fraction).",
            "",
            "| run | cap GiB | peak reserved GiB | peak allocated GiB | micro-batch per step | OOM retries per step "
            "| cuda num_ooms | cuda num_alloc_retries | status |",
            "|---|---|---|---|---|---|---|---|---|",
            row(f"micro={b}, no cap", full, None),
            row(f"micro={b // 4}, no cap", quarter, None),
            row(f"micro={b}, capped halfway", capped, cap),
            row(f"micro={micros[-1]} from the start, no cap", same, None),
            row("micro=1, no cap", one, None),
            row("micro=1, capped between its resident bytes and its peak", give_up, give_up_cap),
            "",
            f"Final parameters, capped (recovered) vs. micro={micros[-1]} from the start: {compare(capped, same)}; "
            f"vs. micro={b} (un-split): {compare(capped, full)}.",
            "",
            f"Give-up message: {str(give_up['error']).splitlines()[0][:300] if give_up['error'] else '(none)'}",
        ]
        if micros[-1] == b:
            lines += ["", "NOTE: the capped run never ran out of memory (the cap was not tight enough); "
                          "the comparison above says nothing about recovery."]
        if give_up["error"] is None:
            lines += ["", "NOTE: the micro-batch-1 run under its cap did not give up."]
        lines.append(MARK_END)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = "\n".join(lines)
    print(text)
    print(json.dumps({"cap_bytes": cap, "micro_batch_per_step": micros}))
    if args.write:
        replace_section(text, MARK_BEGIN, MARK_END)


if __name__ == "__main__":
    main()
