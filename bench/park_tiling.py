"""Speed and device memory of ``offload=park`` (parking, encoder cache) and ``tiling`` options.

    python bench/park_tiling.py                       # tiny models, whatever device train.device=auto picks
    python bench/park_tiling.py --size full --resolution 1024 --steps 6 -- +preset=constrained
    python bench/park_tiling.py --write               # also replace this section of docs/benchmarks.md

Prints one markdown section (the figures and the command line that produced them). Per-step
time is the mean over steps 2..N (step 1 includes warm-up); device peak is
``torch.cuda.max_memory_allocated`` over the training steps (the cache pre-pass runs before and is
reported separately), "n/a" on CPU, where the live-bytes figures are in the tests instead.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from docs_section import replace_section  # noqa: E402  (bench/ is on sys.path as the script's folder)

MARK_BEGIN = "<!-- bench/park_tiling.py begin -->"
MARK_END = "<!-- bench/park_tiling.py end -->"


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.3f} GiB"


def _reset_peak(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def train_case(tmp: Path, overrides: list[str]) -> dict:
    from accelerate.utils import set_seed

    from runner.parts import build_plugins, build_trainer, make_context
    from runner.cli.compose import compose_config
    from runner.checks import validate
    from runner.loop import train
    from runner.session import make_accelerator

    cfg = compose_config([f"output_dir={tmp}", "train.progress=false", *overrides])
    validate(cfg)
    ctx = make_context(cfg, build_plugins(cfg), tmp)
    ctx.run_phase("configure_process")
    ctx.trainer = build_trainer(cfg)
    set_seed(cfg.train.seed)
    ctx.models = ctx.trainer.build_models("cpu")
    ctx.accelerator = make_accelerator(cfg, ctx.device)
    t0 = time.perf_counter()
    ctx.apply_setup_phases()
    setup_s = time.perf_counter() - t0
    _reset_peak(ctx.device)
    result = train(ctx)
    peak = _peak(ctx.device)
    ctx.run_phase("teardown")
    del ctx
    return {"s_per_step": result.seconds_per_step, "peak": peak, "setup_s": setup_s, "loss": result.losses[-1]}


def vae_case(device: torch.device, size: str, resolution: int, tiles: tuple[int, int] | None) -> dict:
    from diffusers import AutoencoderKL

    from runner.families.common.loading import cast_module
    from runner.families.sdxl.architecture import sdxl_configs
    from runner.plugins.tiling import apply_vae_tiling

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    vae = cast_module(AutoencoderKL.from_config(sdxl_configs(size)["vae"]), dtype).to(device).eval()
    x = torch.rand(1, 3, resolution, resolution, device=device, dtype=dtype) * 2 - 1
    if tiles:
        apply_vae_tiling(vae, *tiles)
    base = _reset_peak(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        vae.encode(x).latent_dist.mean.float().sum().item()
    dt = time.perf_counter() - t0
    peak = _peak(device)
    return {"s": dt, "peak_above": None if peak is None else peak - base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=("tiny", "full"))
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--vae-resolution", type=int, default=1024)
    ap.add_argument("--write", action="store_true", help="replace this script's section of docs/benchmarks.md")
    ap.add_argument("overrides", nargs="*", help="extra runner overrides (after --)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from runner.config import load_all
    load_all()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    base = [f"model.size={args.size}", f"data.resolution={args.resolution}", f"train.steps={args.steps}",
            "data.demo_size=8", *args.overrides]
    work = Path(tempfile.mkdtemp(prefix="bench-park-"))
    rows = []
    try:
        cache = work / "cache"
        cases = [
            ("offload=none", []),
            ("offload=park, no cache", ["offload=park", "offload.cache_latents=false", "offload.cache_text=false"]),
            ("offload=park, cache cold (pre-pass in setup)", ["offload=park", f"offload.cache_dir={cache}"]),
            ("offload=park, cache warm", ["offload=park", f"offload.cache_dir={cache}"]),
        ]
        for i, (label, extra) in enumerate(cases):
            r = train_case(work / f"run{i}", [*base, *extra])
            rows.append(f"| {label} | {r['s_per_step']:.3f} | {_gib(r['peak'])} | {r['setup_s']:.1f} | {r['loss']:.6f} |")
        vae_rows = []
        for tiles in (None, (512, 128), (256, 64)):
            v = vae_case(device, args.size, args.vae_resolution, tiles)
            label = "whole image" if tiles is None else f"tiles {tiles[0]} px, overlap {tiles[1]} px"
            vae_rows.append(f"| {label} | {v['s']:.3f} | {_gib(v['peak_above'])} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    command = "python bench/park_tiling.py " + " ".join(sys.argv[1:])
    text = "\n".join([
        MARK_BEGIN,
        "## offload=park and tiling",
        "",
        f"Command: `{command.strip()}` on {name} (torch {torch.__version__}); training overrides: `{' '.join(base)}`",
        "",
        "| run | s/step | device peak (training steps) | setup s | last loss |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"VAE encode of one {args.vae_resolution} px image, model.size={args.size} VAE "
        f"({'bf16' if device.type == 'cuda' else 'fp32'}):",
        "",
        "| VAE | s | device peak above weights and input |",
        "|---|---|---|",
        *vae_rows,
        MARK_END,
    ])
    print(text)
    if args.write:
        replace_section(text, MARK_BEGIN, MARK_END)


if __name__ == "__main__":
    main()
