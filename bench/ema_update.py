"""One EMA update on the CPU: runner/ema/average.py against diffusers' EMAModel and torch's AveragedModel.

    python bench/ema_update.py [--params 100e6] [--repeats 3] [--no-write]

Why: runner/ema/average.py writes its own update (a chunked ``torch._foreach_lerp_``) instead of using a
library's; this measures what that choice costs or saves where ``ema.device=cpu`` runs it, on the
host. The parameters are real tensor shapes of the full-size SDXL U-Net (built on ``meta``), the
first ones up to ``--params`` elements, materialised on the CPU in float32. Per implementation:
the median wall time of an update over ``--repeats`` runs, and the temporary bytes it allocates
on top of the weights and the average (the live-bytes tracker's peak during the update minus the
level before it). Timings depend on the machine's load (recorded); bytes do not.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from docs_section import replace_section  # bench/ is on sys.path as the script's folder

from runner.ema.average import EMA
from runner.memory.live_bytes import LiveBytesTracker

SECTION = "## One EMA update on the CPU: ours against diffusers and torch (bench/ema_update.py)"
BEGIN, END = "<!-- bench/ema_update.py begin -->", "<!-- bench/ema_update.py end -->"
MiB = 2**20


def sdxl_shapes(limit: float) -> list[torch.Size]:
    from diffusers import UNet2DConditionModel

    from runner.families.sdxl.architecture import sdxl_configs

    with torch.device("meta"):
        unet = UNet2DConditionModel(**sdxl_configs("full")["unet"])
    shapes, total = [], 0
    for p in unet.parameters():
        if total >= limit:
            break
        shapes.append(p.shape)
        total += p.numel()
    return shapes


def measure(name: str, setup, update, repeats: int, existing) -> dict:
    """Median time of ``repeats`` untracked updates; then one update under the live-bytes tracker
    for its temporaries. ``existing(state)``: every tensor that lives before the update (weights,
    the average), so that an in-place op on one of them is not counted as a new allocation."""
    times = []
    for _ in range(repeats):
        state = setup()
        t0 = time.perf_counter()
        update(state)
        times.append(time.perf_counter() - t0)
        del state
    state = setup()
    tracker = LiveBytesTracker(count_inputs=False)
    tracker.track(existing(state), "weights")
    with tracker:
        base = tracker.current_bytes("cpu")
        update(state)
        extra = tracker.peak_bytes("cpu") - base
    return {"name": name, "seconds": statistics.median(times), "extra_bytes": extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    shapes = sdxl_shapes(args.params)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    n = sum(p.numel() for p in params)
    bf16 = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in params]
    decay = 0.999

    from diffusers.training_utils import EMAModel
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    module = torch.nn.ParameterList(params)
    weights = [*params, *bf16]
    rows = [
        measure("runner/ema/average.py (chunked foreach lerp), float32 weights",
                lambda: EMA(named, decay=decay, warmup=False, on_host=True), lambda e: e.average(1 - decay), args.repeats,
                lambda e: [*weights, *e.shadow]),
        measure("runner/ema/average.py, bfloat16 weights into a float32 average",
                lambda: EMA([(f"p{i}", p) for i, p in enumerate(bf16)], decay=decay, warmup=False, on_host=True),
                lambda e: e.average(1 - decay), args.repeats, lambda e: [*weights, *e.shadow]),
        measure("one lerp_ per tensor, float32",
                lambda: [p.detach().clone() for p in params],
                lambda s: [a.lerp_(p, 1 - decay) for a, p in zip(s, params)], args.repeats, lambda s: [*weights, *s]),
        measure("diffusers EMAModel(foreach=True).step",
                lambda: EMAModel(params, decay=decay, use_ema_warmup=False, foreach=True), lambda e: e.step(params),
                args.repeats, lambda e: [*weights, *e.shadow_params]),
        measure("diffusers EMAModel(foreach=False).step",
                lambda: EMAModel(params, decay=decay, use_ema_warmup=False, foreach=False), lambda e: e.step(params),
                args.repeats, lambda e: [*weights, *e.shadow_params]),
        measure("torch AveragedModel(get_ema_multi_avg_fn).update_parameters",
                lambda: AveragedModel(module, multi_avg_fn=get_ema_multi_avg_fn(decay)),
                lambda a: a.update_parameters(module), args.repeats,
                lambda a: [*weights, *a.parameters(), *a.buffers()]),
    ]
    for r in rows:
        print(f"{r['name']}: {r['seconds']:.3f} s, temporaries {r['extra_bytes'] / MiB:.1f} MiB", flush=True)
    lines = [
        BEGIN, SECTION, "",
        f"Command: `python bench/ema_update.py --params {args.params:g} --repeats {args.repeats}` "
        f"({time.strftime('%Y-%m-%d')}, CPU, {os.cpu_count()} cores, torch {torch.__version__}, 1-minute load average "
        f"{load:.2f} at the start). {len(shapes)} tensors with the shapes of the first parameters of the full-size SDXL "
        f"U-Net, {n / 1e6:.0f} M elements ({n * 4 / MiB:.0f} MiB in float32); median of {args.repeats} updates. "
        "Temporaries: bytes allocated during the update above the weights and the average (live-bytes tracker).",
        "",
        "| implementation | one update (s) | temporaries |",
        "|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | {r['seconds']:.3f} | {r['extra_bytes'] / MiB:.1f} MiB |")
    lines += ["", "diffusers' foreach step allocates a temporary as large as every averaged parameter "
              "(`torch._foreach_sub(shadow, params)`); runner/ema/average.py bounds its temporaries to one chunk (64 MiB of "
              "the average, or one tensor when larger), which is what lets the device copy stay within the plan.", END]
    text = "\n".join(lines)
    if args.no_write:
        print(text)
    else:
        replace_section(text, BEGIN, END)
        print(f"wrote '{SECTION}'")


if __name__ == "__main__":
    main()
