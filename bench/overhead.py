"""Per-step cost of the runner's managed loop against a plain PyTorch loop doing the same work.

    nice -n 0 python bench/overhead.py [--rounds 16] [--steps 16] [--threads 1] [--fixed-malloc] [--no-write]

A diffusers ``UNet2DModel`` with a DDPM loss (the README's custom trainer, bigger, so that a CPU
step takes ~100-200 ms and 3 % of it is resolvable) is trained in one process by two loops, from
the same initial weights, on the same samples and noise seeds:

* *plain*: a hand-written loop replaying the sample order of a warm-up managed run: ``collate``,
  ``loss``, ``backward``, ``clip_grad_norm_``, ``AdamW.step`` (``foreach=False``, as the runner
  builds it), ``zero_grad(set_to_none=True)``, ``loss.item()``. Nothing else.
* *managed*: ``runner.__main__.run(compose_config(overrides))``, the only runner entry points used,
  with no memory plugin (``allocator=none``, every other kind ``none``) and ``train.device=cpu
  train.preflight=false train.progress=false``: the same work through accelerate (prepared
  optimizer and LR scheduler, ``accelerator.backward``, ``accelerator.clip_grad_norm_``), the
  runner's per-step machinery (sample order and seeds, plugin phases, the OOM-recovery wrapper,
  micro-batch slicing and placement) and, between steps, the memory columns (psutil RSS), the
  metrics.jsonl row and the disabled progress bar. Set-up and the final checkpoint are outside
  every span.

Spans: *step* is what ``s_per_step`` in metrics.jsonl covers (collate to the ``on_step_end``
phase), timed alike in the plain loop. *cycle* is one ``loss()`` call to the next, recorded by the
trainer on both sides: all a step costs, bookkeeping between steps included. *cycle_cpu* is that
interval in process CPU time (``time.process_time``), which other jobs disturb far less. The first
step and cycle of every round (warm-up) are dropped. Minor page faults per cycle are counted too:
glibc returns a free heap top to the OS and the next step faults it in again, at a cost that
depends on what stays allocated between steps; ``--fixed-malloc`` pins glibc's mmap and trim
thresholds (``mallopt``) at start-up to measure without that.

Why alternation: the machine is shared and its load swings by far more than 3 % within minutes.
Plain and managed rounds alternate in one process in ABBA order (plain-managed, managed-plain, ...),
so load, clock and cache state drift over both sides alike and a linear trend cancels; medians drop
the steps another process interrupted. Then one more round per side runs under cProfile, to show
where the managed side's extra CPU time goes.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import ctypes.util
import gc
import io
import json
import logging
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import diffusers
import torch
from cpu_attribution import (  # bench/ is on sys.path as the script's folder
    by_owner,
    markdown,
)
from diffusers import DDPMScheduler, UNet2DModel
from docs_section import replace_section

from runner.data import build_dataset, collate
from runner.trainer import ModelSet, per_sample_rand, per_sample_randn

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Managed-loop overhead against a plain PyTorch loop (bench/overhead.py{})"
MARK = "<!-- bench/overhead.py{} {} -->"  # --fixed-malloc results get their own section
BLOCKS, RESOLUTION, BATCH = (32, 64, 64), 32, 4  # ~115-160 ms of CPU per step on one core here
GOAL_PCT = 3.0
SPANS = ("step", "cycle", "cycle_cpu", "faults")  # see the module docstring; faults: minor page faults per cycle


class TimedUNetTrainer:
    """A managed-mode trainer (runner/trainer.py) whose ``loss`` records when it ran and on what. Both sides
    use it, so both pay the recording; class attributes, as the runner builds its own instance."""

    calls: list[tuple] = []  # (wall clock, process CPU time, minor page faults, indices, seeds) per loss() call
    profiler: cProfile.Profile | None = None  # when set: on from step 2's loss() to the last step's (whole cycles)

    def __init__(self, cfg: Any) -> None:
        self.cfg, self.steps = cfg, cfg.train.steps
        self.scheduler = DDPMScheduler(num_train_timesteps=1000)

    def build_models(self, device: str | torch.device = "cpu") -> ModelSet:
        with torch.device(device):
            unet = UNet2DModel(sample_size=self.cfg.data.resolution, in_channels=3, out_channels=3,
                               block_out_channels=BLOCKS, layers_per_block=1, norm_num_groups=8,
                               down_block_types=("DownBlock2D",) * len(BLOCKS), up_block_types=("UpBlock2D",) * len(BLOCKS))
        return ModelSet({"unet": unet}, trained={"unet"})

    def dataset(self) -> Any:
        ds = build_dataset(self.cfg.data)
        [ds[i] for i in range(len(ds))]  # draw every demo image now, so no timed step pays the one-off drawing
        return ds

    def loss(self, models: ModelSet, batch: dict[str, Any]) -> torch.Tensor:
        seeds, faults = batch["sample_seed"], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.calls.append((time.perf_counter(), time.process_time(), faults, batch["index"].tolist(), seeds.tolist()))
        if self.profiler is not None and len(self.calls) in (2, self.steps):
            self.profiler.enable() if len(self.calls) == 2 else self.profiler.disable()
        x0 = batch["pixel_values"]
        noise = per_sample_randn(seeds, tuple(x0.shape[1:]), x0.device, x0.dtype)
        t = (per_sample_rand(seeds, salt=1, device=x0.device) * 999).long()
        pred = models["unet"](self.scheduler.add_noise(x0, noise, t), t).sample
        return torch.nn.functional.mse_loss(pred.float(), noise.float())

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> dict[str, Any]:
        r = self.cfg.data.resolution
        return {"pixel_values": torch.empty(batch_size, 3, r, r, device=device),
                "sample_seed": torch.zeros(batch_size, dtype=torch.long)}


TARGET = f"{TimedUNetTrainer.__module__}.{TimedUNetTrainer.__qualname__}"  # __main__.X when run as a script


def overrides(steps: int, out: str) -> list[str]:
    return ["trainer=custom", f"trainer._target_={TARGET}", "allocator=none", "quantization=none", "offload=none",
            "checkpoint=none", "tiling=none", f"data.resolution={RESOLUTION}", f"train.batch_size={BATCH}",
            f"train.steps={steps}", "train.device=cpu", "train.preflight=false", "train.progress=false", f"output_dir={out}"]


def cycle_spans(step_seconds: list[float]) -> dict[str, list[float]]:
    """The spans of one round: ``step_seconds`` (all steps) and the loss()-to-loss() intervals of the
    trainer's log, each without its first value (step 1's warm-up)."""
    calls = TimedUNetTrainer.calls
    deltas = [[b[i] - a[i] for a, b in zip(calls, calls[1:])][1:] for i in range(3)]
    return {"step": step_seconds[1:], "cycle": deltas[0], "cycle_cpu": deltas[1], "faults": deltas[2]}


def managed_round(steps: int) -> dict[str, Any]:
    """One ``task(cfg)`` job; per-step figures from its metrics.jsonl and the trainer's log."""
    from runner.__main__ import task
    from runner.cli.compose import compose_config

    TimedUNetTrainer.calls.clear()
    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(io.StringIO()):  # run() prints its summary
            task(compose_config(overrides(steps, tmp)))
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {**cycle_spans([r["s_per_step"] for r in rows]), "loss": [r["loss"] for r in rows],
            "samples": [c[3:] for c in TimedUNetTrainer.calls]}


def plain_round(cfg: Any, samples: list[tuple[list[int], list[int]]]) -> dict[str, Any]:
    """The same samples, seeds, initial weights, loss, clipping and AdamW, in a hand-written loop."""
    torch.manual_seed(cfg.train.seed)  # run() seeds the same way before build_models: identical weights
    trainer = TimedUNetTrainer(cfg)
    models = trainer.build_models("cpu")
    models["unet"].train()
    params = list(models.trainable_parameters())
    o = cfg.optimizer  # runner/optim/build.py builds torch AdamW with foreach=False; so do we
    opt = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, foreach=False)
    ds = trainer.dataset()
    TimedUNetTrainer.calls.clear()
    steps, losses, max_norm = [], [], cfg.train.max_grad_norm
    for indices, seeds in samples:
        t0 = time.perf_counter()
        batch = collate([ds[i] for i in indices])
        batch["sample_seed"] = torch.tensor(seeds, dtype=torch.int64)
        loss = trainer.loss(models, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        steps.append(time.perf_counter() - t0)
    return {**cycle_spans(steps), "loss": losses}


def profile_pair(cfg: Any, samples: list, steps: int) -> dict[str, dict[str, dict[str, float]]]:
    """One more round per side under cProfile (CPU clock, whole cycles only): CPU ms per step by owner."""
    out = {}
    for side in ("plain", "managed"):
        TimedUNetTrainer.profiler = prof = cProfile.Profile(time.process_time)
        try:
            plain_round(cfg, samples) if side == "plain" else managed_round(steps)
        finally:
            TimedUNetTrainer.profiler = None
            prof.disable()
        out[side] = by_owner(prof, ROOT, scale=1e3 / (steps - 2))
    return out


def fix_malloc() -> None:
    """glibc: fixed mmap (32 MiB) and trim (1 GiB) thresholds, so freed memory stays in the heap."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    if not (libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) and libc.mallopt(M_MMAP_THRESHOLD, 1 << 25)):
        raise SystemExit("mallopt failed: --fixed-malloc needs glibc")


def measure(rounds: int, steps: int, threads: int) -> dict[str, Any]:
    from runner.cli.compose import compose_config

    torch.set_num_threads(threads)
    warm = managed_round(steps)  # imports, Hydra, accelerate; its sample order is what the plain loop replays
    cfg = compose_config(overrides(steps, "unused"))
    out: dict[str, Any] = {side: {span: [] for span in SPANS} for side in ("plain", "managed")}
    out.update(pairs=[], loss_diff=0.0, load_start=os.getloadavg()[0])
    for r in range(rounds):
        got = {}
        for side in (("plain", "managed") if r % 2 == 0 else ("managed", "plain")):  # ABBA
            gc.collect()
            got[side] = plain_round(cfg, warm["samples"]) if side == "plain" else managed_round(steps)
            assert torch.get_num_threads() == threads, "the run changed torch's thread count"
        assert got["managed"]["samples"] == warm["samples"], "the managed sample order changed between rounds"
        out["loss_diff"] = max(out["loss_diff"], *(abs(a - b) for a, b in zip(got["plain"]["loss"], got["managed"]["loss"])))
        med = {side: {s: statistics.median(got[side][s]) for s in SPANS} for side in got}
        out["pairs"].append({s: 100 * (med["managed"][s] / med["plain"][s] - 1) for s in SPANS[:3]})
        for side, span in ((side, span) for side in got for span in SPANS):
            out[side][span] += got[side][span]
        print(f"round {r + 1}/{rounds}, plain -> managed: " + ", ".join(
            f"{s} {med['plain'][s]:.4g} -> {med['managed'][s]:.4g}" for s in SPANS), flush=True)
    out["load_end"] = os.getloadavg()[0]
    out["profile"] = profile_pair(cfg, warm["samples"], steps)
    out["params"] = sum(p.numel() for p in TimedUNetTrainer(cfg).build_models("meta").trainable_parameters())
    return out


def section(m: dict[str, Any], args: argparse.Namespace) -> str:
    tag = " --fixed-malloc" * args.fixed_malloc
    faults = {side: statistics.median(m[side]["faults"]) for side in ("plain", "managed")}
    lines = [MARK.format(tag, "begin"), SECTION.format(tag), "",
             f"Command ({time.strftime('%Y-%m-%d')}): `nice -n 0 python bench/overhead.py --rounds {args.rounds} --steps "
             f"{args.steps} --threads {args.threads}{tag}`; CPU machine, `nproc` "
             f"{os.cpu_count()}, shared (1-minute load average {m['load_start']:.2f} at the start, {m['load_end']:.2f} at "
             f"the end), torch {torch.__version__}, diffusers {diffusers.__version__}, `torch.set_num_threads({args.threads})` "
             "for both sides.", "",
             f"Model: `UNet2DModel` from config (block_out_channels {BLOCKS}, one layer per block, no attention, "
             f"{m['params'] / 1e6:.2f} M parameters, all trained), DDPM loss on {RESOLUTION} px demo images, batch {BATCH}, "
             f"float32, AdamW from `optimizer=adamw` (`foreach=False` on both sides), clipping at 1.0. {args.rounds} rounds "
             f"of {args.steps} steps per side alternating in one process (ABBA), first step of each round dropped: "
             f"{len(m['plain']['step'])} steps per side. Losses of the two sides agree to {m['loss_diff']:.1e}.", "",
             *(line for par in __doc__.split("\n\n")[3:6] for line in (par.strip().replace("``", "`"), "")),
             "| span | plain (median) | managed (median) | overhead | overhead | per round pair: median (min, max) |",
             "|---|---|---|---|---|---|"]
    worst = -100.0
    for span in SPANS[:3]:
        p, q = statistics.median(m["plain"][span]), statistics.median(m["managed"][span])
        worst = max(worst, pct := 100 * (q / p - 1))
        pairs = [pr[span] for pr in m["pairs"]]
        lines.append(f"| {span} | {1e3 * p:.1f} ms | {1e3 * q:.1f} ms | {1e3 * (q - p):+.2f} ms | **{pct:+.2f} %** | "
                     f"{statistics.median(pairs):+.2f} % ({min(pairs):+.1f}, {max(pairs):+.1f}) |")
    lines += ["", f"Minor page faults per cycle (median): plain {faults['plain']:.0f}, managed {faults['managed']:.0f}.", "",
              f"Goal: overhead <= {GOAL_PCT:g} % per step. Measured at most {worst:+.2f} %: "
              f"{'within' if worst <= GOAL_PCT else '**above**'} the goal.", "",
              "Where the managed side's extra CPU time goes in Python: one more round per side under cProfile (CPU "
              "clock, whole cycles), each function's time charged to the package whose code called it "
              "(bench/cpu_attribution.py). cProfile inflates Python-level calls several-fold, so compare rows with "
              "each other rather than with the step; page faults land on whichever function touched the page.", "",
              *markdown(m["profile"]["plain"], m["profile"]["managed"], top=8), MARK.format(tag, "end")]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=16, help="alternating round pairs (plain + managed)")
    ap.add_argument("--steps", type=int, default=16, help="optimizer steps per round (the first is dropped)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for both sides")
    ap.add_argument("--fixed-malloc", action="store_true", help="pin glibc's mmap/trim thresholds first (own section)")
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing docs/benchmarks.md")
    args = ap.parse_args()
    if args.fixed_malloc:
        fix_malloc()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)  # as runner's main(): a missing-kernel note
    text = section(measure(args.rounds, args.steps, args.threads), args)
    if args.no_write:
        print(text)
    else:
        tag = " --fixed-malloc" * args.fixed_malloc
        replace_section(text, MARK.format(tag, "begin"), MARK.format(tag, "end"), DOC)
        print(f"wrote {SECTION.format(tag)!r} in {DOC}")


if __name__ == "__main__":
    main()
