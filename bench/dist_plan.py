"""One rank's plan for multi-GPU fine-tunes: Flux full fine-tune on 2, 4 and 8 GPUs of 24 GiB, SDXL full
fine-tune on 2 GPUs of 16 GiB (issue 17); the cluster table (issue 29): Flux, Qwen-Image and Wan full
fine-tunes on 8 GPUs of 24/48/80 GiB, with s/step over each interconnect.

    python bench/dist_plan.py [--table cases|cluster|all] [--no-write]

Each case is planned with its own command, as a user would run it (``mode=plan dist=... dist.world_size=N``:
the per-rank plan of runner/plan/dist.py), and its predicted per-GPU peak, breakdown and fit go into
this script's section of docs/benchmarks.md. No GPU is needed: the planner runs on the CPU.

Settings of the cases (each a shipped preset plus what multi-GPU changes):

* Flux (12 B transformer) full fine-tune: ``+preset=flux_24gb_full``, whose single-GPU answer is to
  stream the transformer from ~80 GB of pinned host RAM; with FSDP the weights, gradients and the
  optimizer state are split across the GPUs instead, so ``offload=[park] ~offload.stream`` (streaming FSDP-sharded
  blocks is refused) and AdamW on bf16 weights (``optimizer=adamw model.train_dtype=bfloat16``,
  kohya's full_bf16: FSDP's optimizer must update DTensor shards, which Adafactor's does not). One
  sample per GPU at 1024 px: ``train.batch_size=N``.
* The same Flux fine-tune with float32 master weights (issue 29: the preset's bf16 autocast, AdamW on
  float32 shards): FSDP2 gathers each unit in bf16 (``MixedPrecisionPolicy``), against
  ``dist.mixed_precision=false`` (float32 gathers, autocast's cache of a bf16 copy of every block).
  Per GPU that is 16 B per parameter / N of shards, gradients and AdamW state before any activation:
  ~44.3 GiB on 4 GPUs, so these rows are for 48/80 GB cards (the budget column stays the preset's 24).
* SDXL (2.6 B U-Net) full fine-tune on two 16 GiB cards: ``+preset=sdxl_24gb budget_gb=16``; FSDP
  needs a non-8-bit optimizer (``optimizer=adamw``), DDP keeps the preset's AdamW8bit.

The cluster table (bench/dist_cluster.py builds it): each model's full fine-tune with FSDP on 8 GPUs of one
named card per budget (RTX 4090 24 GB, L40S 48 GB, H100 SXM 80 GB: ``device.name``, whose usable memory is
the budget and whose peaks price the compute), planned once per card; the communication of that plan is
then priced over each interconnect of conf/devices.yaml (runner/plan/comm.py's ``repriced``: the same
collectives and bytes, no second plan).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from docs_section import replace_section  # bench/ is on sys.path as the script's folder

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench/dist_plan.py begin -->", "<!-- bench/dist_plan.py end -->"
GiB = 2**30
# ~offload.stream drops the preset's stream settings with the plugin (a setting of an unselected plugin is refused)
FLUX32 = ["+preset=flux_24gb_full", "model.size=full", "offload=[park]", "~offload.stream", "optimizer=adamw"]
FLUX = [*FLUX32, "model.train_dtype=bfloat16"]
SDXL = ["+preset=sdxl_24gb", "model.size=full", "budget_gb=16"]
CASES: list[tuple[str, list[str]]] = [
    ("Flux full, 1 GPU, no streaming (for scale)", [*FLUX, "train.batch_size=1"]),
    *[(f"Flux full, FSDP on {n} x 24 GiB", [*FLUX, "dist=fsdp", f"dist.world_size={n}", f"train.batch_size={n}"])
      for n in (2, 4, 8)],
    ("Flux full, FSDP on 2 x 24 GiB, sharded weights on the host",
     [*FLUX, "dist=fsdp", "dist.world_size=2", "train.batch_size=2", "dist.cpu_offload=true"]),
    *[(f"Flux full, float32 masters, FSDP on {n} GPUs, bf16 units gathered",
       [*FLUX32, "dist=fsdp", f"dist.world_size={n}", f"train.batch_size={n}"]) for n in (4, 8)],
    ("Flux full, float32 masters, FSDP on 4 GPUs, float32 gathers (dist.mixed_precision=false)",
     [*FLUX32, "dist=fsdp", "dist.world_size=4", "train.batch_size=4", "dist.mixed_precision=false"]),
    *[(f"Flux full, float32 masters, FSDP on {n} GPUs, fused backward (each shard steps after its reduce-scatter)",
       [*FLUX32, "dist=fsdp", f"dist.world_size={n}", f"train.batch_size={n}", "optimizer.fused_backward=true"])
      for n in (4, 8)],
    ("SDXL full, 1 GPU of 16 GiB", [*SDXL]),
    ("SDXL full, DDP on 2 x 16 GiB (AdamW8bit)", [*SDXL, "dist=ddp", "dist.world_size=2"]),
    ("SDXL full, FSDP on 2 x 16 GiB (AdamW)", [*SDXL, "dist=fsdp", "dist.world_size=2", "optimizer=adamw"]),
]


def plan(overrides: list[str]) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "runner", "mode=plan", *overrides, f"output_dir={tmp}"], cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wall = time.perf_counter() - t0
        path = Path(tmp) / "plan.json"
        if proc.returncode not in (0, 3) or not path.exists():
            raise SystemExit(f"python -m runner mode=plan {' '.join(overrides)} failed ({proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
        return json.loads(path.read_text()), wall


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def host(p: dict) -> str:
    """Host RAM per rank / rank 0 / per node (one process: its peak alone)."""
    h = p.get("host_ranks")
    if not h:
        return gib(p["host_peak_bytes"])
    return f"{gib(h['per_rank_bytes'])} / {gib(h['rank0_bytes'])} / {gib(h['per_node_bytes'])}"


def section(rows: list[tuple[str, list[str], dict, float]], load: float) -> str:
    lines = [BEGIN, "## Multi-GPU plans: one rank's peak (bench/dist_plan.py)", "",
             f"Command (CPU only, 2 cores, 1-minute load average {load:.2f} at the start, "
             f"{time.strftime('%Y-%m-%d')}): `python bench/dist_plan.py`. Each row is one command, "
             "`python -m runner mode=plan <overrides>`; the plan is of one GPU's step (runner/plan/dist.py says how "
             "sharding, all-gather, reduce-scatter and DDP's buckets are counted).", "",
             "| case | overrides | per-GPU peak (+ workspaces) | budget | fits | weights / gradients / optimizer / "
             "activations / temporaries (GiB) | all-gather + reduce-scatter (GiB) | host RAM per rank / rank 0 / per node "
             "(GiB) | wall (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, overrides, p, wall in rows:
        cat = p["by_category"]
        comm = sum(sum(c.values()) for m, c in p["by_module"].items() if m.startswith("(fsdp"))
        lines.append(
            f"| {name} | `{' '.join(overrides)}` | {gib(p['peak_bytes'])} ({gib(p['required_bytes'])}) in "
            f"{p['peak_phase']} | {gib(p['budget_bytes']) if p['budget_bytes'] else '-'} | "
            f"{'yes' if p['fits'] else 'no'} | {gib(cat.get('weights', 0))} / {gib(cat.get('gradients', 0))} / "
            f"{gib(cat.get('optimizer_state', 0))} / {gib(cat.get('activations', 0))} / "
            f"{gib(cat.get('temporaries', 0))} | {gib(comm)} | "
            f"{host(p)} | {wall:.0f} |")
    lines += ["", "Weights and gradients include the all-gather and reduce-scatter buffers; the column beside them "
              "shows how much of them those are. The host RAM column is each process's tensors: with "
              "`dist.cpu_offload=true` a rank's shards of weights, gradients and optimizer state live there; "
              "under `dist=fsdp` a full fine-tune's trained module is built on meta and filled shard by shard "
              "(runner/distributed/loading.py): at random init, as here, rank 0 builds it whole and broadcasts it "
              "(its larger peak); from a safetensors folder every rank holds the per-rank figure. Per node: "
              "rank 0's peak + (`dist.ranks_per_node` - 1) x the per-rank one (default min(world_size, 8)). "
              "Float32 masters (issue 29): with FSDP2's mixed precision no bf16 copy of the blocks is cached "
              "(temporaries 0.04 against 22.75 GiB with `dist.mixed_precision=false`), and the peak moves to the "
              "backward, where a rank's float32 shards, gradients and AdamW state alone are 16 B per parameter / N "
              "(44.34 GiB on 4 GPUs). With `optimizer.fused_backward=true` FSDP2 calls each shard's hook after its "
              "unit's reduce-scatter and the shard steps and frees its gradient there, so the float32 gradient "
              "shards (4 B per parameter / N) are never all alive; the per-parameter clipping this implies "
              "(train.max_grad_norm > 0) changes the math, which mode=fit asks for with fit.allow=[per_param_clipping].", END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print the section, leave docs/benchmarks.md alone")
    parser.add_argument("--table", choices=("cases", "cluster", "all"), default="all",
                        help="which section to plan and write (default: both)")
    args = parser.parse_args()
    if args.table in ("cluster", "all"):
        from dist_cluster import CLUSTER_BEGIN, CLUSTER_END, cluster_section

        text = cluster_section(plan)
        if args.no_write:
            print(text)
        else:
            replace_section(text, CLUSTER_BEGIN, CLUSTER_END)
            print(f"wrote {CLUSTER_BEGIN} ... {CLUSTER_END} in docs/benchmarks.md")
        if args.table == "cluster":
            return
    load = os.getloadavg()[0]
    rows = []
    for name, overrides in CASES:
        p, wall = plan(overrides)
        print(f"{name}: {gib(p['peak_bytes'])} GiB, fits={p['fits']} ({wall:.0f} s)", flush=True)
        rows.append((name, overrides, p, wall))
    text = section(rows, load)
    if args.no_write:
        print(text)
    else:
        replace_section(text, BEGIN, END)
        print(f"wrote {BEGIN} ... {END} in docs/benchmarks.md")


if __name__ == "__main__":
    main()
