"""Streamed offload against no offload and the peers' offloading, on one GPU, in one run.

Models (random weights, bf16, built from the published configs in runner/families/*/architecture.py):

* ``sdxl``: the SDXL U-Net (2.6 B parameters), **full fine-tune** (bf16 weights, AdamW), 1024 px;
* ``flux``: the Flux transformer (11.9 B parameters), **LoRA** rank 16 on the attention
  projections over a frozen bf16 base, 1024 px (a full fine-tune of it does not fit an 80 GB card).

Both train with activation checkpointing of every block (plugins/checkpoint.py), batch 1.

Variants, each timed over the same steps (forward + backward + optimizer step):

* ``none``: everything on the GPU;
* ``stream b=F``: ``offload=stream`` (plugins/stream/) with ``device_budget`` = F x the model's
  weight bytes, for several F, prefetch 1 (and 2 where asked);
* ``group_offload``: diffusers ``apply_group_offloading(offload_type="block_level",
  num_blocks_per_group=1, use_stream=True)``;
* ``cpu_offload``: accelerate ``cpu_offload`` (``AlignDevicesHook``).

For each variant: the step time and its forward+backward and optimizer parts, the CUDA peak
(``torch.cuda.max_memory_allocated``), whether it trains (the trained parameters' gradients of
the first step against the ``none`` run's; peers that raise or never deliver gradients are
reported as such, then timed forward+backward or forward only where that still runs), and for
``stream`` the bytes copied per step and the bandwidth its copies achieved (CUDA events on the
copy stream) next to the card's pinned host-to-device bandwidth (a 1 GiB pinned copy).

Target: ``stream`` at <= 1.1x the ``none`` step time while the budget leaves enough resident
compute between streamed blocks to hide the copies (the bench shows where that stops holding).

Run on the GPU machine (see docs/benchmarks.md for the wheels the machine lacks):

    python bench/offload_bench.py                  # both models; writes its section of docs/benchmarks.md
    python bench/offload_bench.py --models flux --budgets 0.6,0.4
    python bench/offload_bench.py --quick          # small models, a sanity run; no docs unless --write-docs
    python bench/offload_bench.py --tiny --device cpu    # the harness itself, on a CPU (no timings worth keeping)

Everything importable without CUDA; nothing is downloaded.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from a checkout without installing the package
    sys.path.insert(0, str(ROOT))

from docs_section import replace_section  # noqa: E402  (bench/ is on sys.path as the script's folder)
from offload_bench_models import (  # noqa: E402
    Case,
    blocks_of,
    fresh_model,
    make_inputs,
    nbytes,
    random_weights,
)

GiB = 2**30
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- offload_bench:begin -->"
END = "<!-- offload_bench:end -->"


@dataclass
class Result:
    variant: str
    trains: str = ""
    step_s: float = math.nan
    fwd_bwd_s: float = math.nan
    optimizer_s: float = math.nan
    peak_gib: float = math.nan
    weights_gib: float = math.nan  # model weights on the device at rest (after placement)
    planned_gib: float = math.nan  # stream: resident + window
    streamed_gib: float = math.nan  # stream: weights kept on the host
    h2d_gib_per_step: float = math.nan
    copy_gbps: float = math.nan  # stream: bandwidth its host-to-device copies achieved
    copy_share: float = math.nan  # stream: time the copy stream was busy / forward+backward time
    waited: float = math.nan  # stream: loads per step that were still in flight when needed
    grad_rel_err: float = math.nan
    error: str = ""


# ---- measuring ----------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_bandwidth(device: torch.device, size: int = GiB, reps: int = 5) -> tuple[float, float]:
    """(host->device, device->host) GB/s of one large copy from/to page-locked memory."""
    if device.type != "cuda":
        return math.nan, math.nan
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    out = []
    for src, dst in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        sync(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        out.append(size * reps / (start.elapsed_time(end) / 1000) / 1e9)
    del host, dev
    return out[0], out[1]


def loss_of(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    out = model(**inputs)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.float().pow(2).mean()


def sample_grads(params: list[tuple[str, nn.Parameter]], k: int = 48) -> dict[str, torch.Tensor]:
    """Gradients of up to k trained parameters spread over the model, as float32 host copies."""
    step = max(1, len(params) // k)
    return {n: p.grad.detach().float().cpu() for n, p in params[::step] if p.grad is not None}


def grad_error(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    if not ref or ref.keys() != got.keys():
        return math.inf
    num = sum(float((got[n] - ref[n]).norm()) ** 2 for n in ref)
    den = sum(float(ref[n].norm()) ** 2 for n in ref) or 1.0
    return math.sqrt(num / den)


def timed_steps(model: nn.Module, inputs: dict[str, Any], params: list[nn.Parameter], opt: Any,
                device: torch.device, warmup: int, steps: int, on_step: Callable[[], None] | None = None) -> Result:
    r = Result("")
    fb, op = [], []
    for i in range(warmup + steps):
        if i == warmup:
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if on_step is not None:
                on_step()
        sync(device)
        t0 = time.perf_counter()
        loss_of(model, inputs).backward()
        sync(device)
        t1 = time.perf_counter()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            for p in params:
                p.grad = None
        sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            fb.append(t1 - t0)
            op.append(t2 - t1)
    r.fwd_bwd_s = sum(fb) / len(fb)
    r.optimizer_s = sum(op) / len(op)
    r.step_s = r.fwd_bwd_s + r.optimizer_s
    if device.type == "cuda":
        r.peak_gib = torch.cuda.max_memory_allocated(device) / GiB
    return r


def device_weight_gib(model: nn.Module, device: torch.device) -> float:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]
               if t.device.type == device.type) / GiB


# ---- variants -----------------------------------------------------------------------------------
def run_variant(name: str, case: Case, weights: dict[str, torch.Tensor], device: torch.device, args: Any,
                ref: dict[str, torch.Tensor] | None, budget: float | None = None, prefetch: int = 1) -> tuple[Result, dict]:
    """Set up one variant, check its first step's gradients against ``ref``, time it."""
    from runner.plugins.checkpoint import apply_activation_checkpointing

    model = fresh_model(case, weights)
    inputs = make_inputs(case, device)
    blocks = blocks_of(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    handle = None
    result = Result(name)
    grads: dict[str, torch.Tensor] = {}
    try:
        if name == "none":
            model.to(device)
        elif name.startswith("stream"):
            from runner.plugins.stream import apply_stream_offload

            handle = apply_stream_offload(model, blocks, int(budget * nbytes(model)), prefetch, device, "cpu", name=case.family)
            result.planned_gib = handle.plan.device_weight_bytes / GiB
            result.streamed_gib = handle.host_bytes() / GiB
        elif name == "group_offload":
            from diffusers.hooks import apply_group_offloading

            apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=device.type == "cuda",
                                   non_blocking=True)
        elif name == "cpu_offload":
            from accelerate import cpu_offload

            cpu_offload(model, execution_device=device)
        if args.checkpoint:
            apply_activation_checkpointing(blocks)
        result.weights_gib = device_weight_gib(model, device)
        opt = torch.optim.AdamW(params, lr=1e-5, foreach=False)
        # first step: the gradients, for correctness
        try:
            loss_of(model, inputs).backward()
            sync(device)
            grads = sample_grads(named)
            if ref is not None:
                result.grad_rel_err = grad_error(ref, grads)
            got = sum(1 for p in params if p.grad is not None and p.grad.device.type != "meta")
            if got < len(params):
                result.trains = f"no: {len(params) - got} of {len(params)} trained parameters got no gradient"
            elif ref is not None and not result.grad_rel_err < 2e-2:
                result.trains = f"no: gradients differ (relative error {result.grad_rel_err:.2g})"
            else:
                result.trains = "yes"
            opt.step()
            opt.zero_grad(set_to_none=True)
        except Exception as e:  # a peer that cannot train: say why, then time what still runs
            result.trains = f"no: {type(e).__name__}: {_first_line(e)}"
            for p in params:
                p.grad = None
            opt = None
        on_step = None
        marks: dict[str, int] = {}
        if handle is not None:
            handle.time_copies(True)

            def on_step() -> None:  # the timed steps start: forget the warm-up's copies
                handle.copy_seconds()
                marks.update(h2d=handle.stats.h2d_bytes, waited=handle.stats.waited)
        if result.trains.startswith("yes"):
            timed = timed_steps(model, inputs, params, opt, device, args.warmup, args.steps, on_step)
        else:
            timed = _time_what_runs(model, inputs, params, device, args)
        for k in ("step_s", "fwd_bwd_s", "optimizer_s", "peak_gib"):
            setattr(result, k, getattr(timed, k))
        if handle is not None and result.trains.startswith("yes"):
            copies = handle.copy_seconds()
            result.h2d_gib_per_step = (handle.stats.h2d_bytes - marks["h2d"]) / args.steps / GiB
            result.waited = (handle.stats.waited - marks["waited"]) / args.steps
            secs, moved = copies.get("h2d", (0.0, 0))
            if secs > 0:
                result.copy_gbps = moved / secs / 1e9
                result.copy_share = secs / args.steps / result.fwd_bwd_s
    except torch.OutOfMemoryError as e:
        result.error = f"OOM: {_first_line(e)}"
    except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others' figures
        result.error = f"{type(e).__name__}: {_first_line(e)}"
        if args.verbose:
            traceback.print_exc()
    finally:
        if handle is not None:
            handle.remove()
        del model, inputs, params, named
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result, grads


def _time_what_runs(model: nn.Module, inputs: dict[str, Any], params: list[nn.Parameter], device: torch.device,
                    args: Any) -> Result:
    """Forward+backward without an optimizer if that runs, else forward only under no_grad."""
    try:
        return timed_steps(model, inputs, params, None, device, 1, args.steps)
    except Exception:
        r = Result("")
        with torch.no_grad():
            times = []
            for i in range(1 + args.steps):
                sync(device)
                t0 = time.perf_counter()
                loss_of(model, inputs)
                sync(device)
                if i:
                    times.append(time.perf_counter() - t0)
        r.fwd_bwd_s = sum(times) / len(times)
        r.step_s = r.fwd_bwd_s
        if device.type == "cuda":
            r.peak_gib = torch.cuda.max_memory_allocated(device) / GiB
        r.optimizer_s = math.nan
        return r


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:160]


def bench_case(case: Case, device: torch.device, args: Any) -> list[Result]:
    print(f"\n== {case.label}", flush=True)
    t = time.perf_counter()
    weights = random_weights(case, device)
    print(f"   random weights: {sum(v.numel() * v.element_size() for v in weights.values()) / GiB:.2f} GiB "
          f"in {time.perf_counter() - t:.0f} s", flush=True)
    results = []
    base, ref = run_variant("none", case, weights, device, args, None)
    base.trains = base.trains or "reference"
    results.append(base)
    print("  ", _row(base, base), flush=True)
    variants: list[tuple[str, float | None, int]] = [(f"stream b={f:g}", f, 1) for f in args.budgets]
    variants += [(f"stream b={f:g} prefetch 2", f, 2) for f in args.prefetch2]
    if not args.no_peers:
        variants += [("group_offload", None, 1), ("cpu_offload", None, 1)]
    for name, budget, prefetch in variants:
        r, _ = run_variant(name, case, weights, device, args, ref, budget, prefetch)
        results.append(r)
        print("  ", _row(r, base), flush=True)
    del weights
    gc.collect()
    return results


# ---- report -------------------------------------------------------------------------------------
def _fmt(x: float, spec: str = ".2f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _row(r: Result, base: Result) -> str:
    rel = r.step_s / base.step_s if base.step_s and not math.isnan(base.step_s) else math.nan
    rel_fb = r.fwd_bwd_s / base.fwd_bwd_s if base.fwd_bwd_s and not math.isnan(base.fwd_bwd_s) else math.nan
    trains = r.error or r.trains
    return (f"| {r.variant} | {trains} | {_fmt(r.step_s)} ({_fmt(rel)}x) | {_fmt(r.fwd_bwd_s)} ({_fmt(rel_fb)}x) | "
            f"{_fmt(r.optimizer_s)} | {_fmt(r.peak_gib)} | {_fmt(r.weights_gib)} | {_fmt(r.planned_gib)} | "
            f"{_fmt(r.streamed_gib)} | {_fmt(r.h2d_gib_per_step)} | {_fmt(r.copy_gbps, '.1f')} | "
            f"{_fmt(100 * r.copy_share, '.0f')}% | {_fmt(r.waited, '.1f')} |")


HEADER = ("| variant | trains | step s (x none) | fwd+bwd s (x none) | optimizer s | CUDA peak GiB | weights on GPU GiB "
          "| planned GiB | on host GiB | H2D GiB/step | copy GB/s | copy busy / fwd+bwd | waits/step |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def report(all_results: dict[str, list[Result]], env: dict[str, Any], command: str) -> str:
    lines = [BEGIN, "## Streamed offload (offload=stream) against no offload and the peers", "",
             f"Command (on the GPU machine, {env['date']}): `{command}`", "",
             f"{env['gpu']}, torch {env['torch']}, diffusers {env['diffusers']}, accelerate {env['accelerate']}; "
             f"pinned copy of 1 GiB: host->device {_fmt(env['h2d_gbps'], '.1f')} GB/s, "
             f"device->host {_fmt(env['d2h_gbps'], '.1f')} GB/s. Activation checkpointing of every block "
             f"{'on' if env['checkpoint'] else 'off'}; {env['steps']} timed steps after {env['warmup']} warm-up.", "",
             "*trains*: the first step's gradients of the trained parameters against the `none` run (relative "
             "error < 2e-2: bf16); a peer that raises or delivers no gradients is then timed on what still runs "
             "(forward+backward without its optimizer, or forward only). *planned*: the stream plan's resident + "
             "window bytes (`offload.device_budget_gb` = b x the weight bytes). *copy GB/s*: what the stream's "
             "host->device copies achieved (CUDA events on the copy stream); *copy busy / fwd+bwd*: the copy "
             "stream's busy time over the forward+backward time (above 100% the copies cannot be hidden). "
             "*waits/step*: block loads still in flight when their block was needed.", ""]
    for label, results in all_results.items():
        base = results[0]
        lines += [f"**{label}**", "", HEADER] + [_row(r, base) for r in results] + [""]
    lines += ["Raw results: `" + env["json"] + "`.", END]
    return "\n".join(lines) + "\n"


def environment(device: torch.device, args: Any) -> dict[str, Any]:
    import accelerate
    import diffusers

    h2d, d2h = pinned_bandwidth(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'unknown'})"
    return {"gpu": gpu, "torch": torch.__version__, "diffusers": diffusers.__version__, "accelerate": accelerate.__version__,
            "h2d_gbps": h2d, "d2h_gbps": d2h, "checkpoint": args.checkpoint, "steps": args.steps, "warmup": args.warmup,
            "date": time.strftime("%Y-%m-%d"), "json": str(args.json)}


def parse_args(argv: list[str] | None = None) -> Any:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="sdxl,flux", help="comma list of sdxl, flux")
    p.add_argument("--budgets", default="0.75,0.5,0.3", help="stream budgets as fractions of the weight bytes")
    p.add_argument("--prefetch2", default="0.5", help="budgets also run with prefetch 2 (empty: none)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--no-checkpoint", dest="checkpoint", action="store_false")
    p.add_argument("--no-peers", action="store_true", help="skip diffusers group offloading and accelerate cpu_offload")
    p.add_argument("--quick", action="store_true", help="small model configs at 512 px, 2 steps: a sanity run")
    p.add_argument("--tiny", action="store_true", help="the test-size configs at 64 px: checks this harness on a CPU")
    p.add_argument("--device", default="cuda")
    p.add_argument("--write-docs", dest="write_docs", action="store_true", default=None)
    p.add_argument("--no-docs", dest="write_docs", action="store_false")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "offload_bench.json")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    args.budgets = [float(x) for x in args.budgets.split(",") if x]
    args.prefetch2 = [float(x) for x in args.prefetch2.split(",") if x]
    if args.tiny:
        args.quick = True
        args.resolution = 64
    if args.quick:
        args.resolution = min(args.resolution, 512)
        args.steps, args.warmup = min(args.steps, 2), 1
        args.budgets = args.budgets[:2] if len(args.budgets) > 1 else args.budgets
    if args.write_docs is None:
        args.write_docs = not args.quick and args.device == "cuda"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this bench measures GPU offloading (use --tiny --device cpu to test the harness)")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    env = environment(device, args)
    print(f"{env['gpu']}: pinned host->device {_fmt(env['h2d_gbps'], '.1f')} GB/s, device->host "
          f"{_fmt(env['d2h_gbps'], '.1f')} GB/s", flush=True)
    trains = {"sdxl": "full", "flux": "lora"}
    all_results: dict[str, list[Result]] = {}
    for family in [m for m in args.models.split(",") if m]:
        case = Case(family, trains[family], args.resolution, args.batch, args.quick, args.tiny)
        all_results[case.label] = bench_case(case, device, args)
    args.json.write_text(json.dumps({"env": env, "results": {k: [asdict(r) for r in v] for k, v in all_results.items()}},
                                    indent=2, default=str) + "\n")
    command = "python bench/offload_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    section = report(all_results, env, command.strip())
    print("\n" + section)
    if args.write_docs:
        replace_section(section, BEGIN, END, DOCS)
        print(f"wrote its section of {DOCS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
