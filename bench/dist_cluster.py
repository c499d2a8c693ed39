"""bench/dist_plan.py's cluster table (issue 29): Flux, Qwen-Image and Wan full fine-tunes on 8 GPUs.

Each (model, card) is one command, ``python -m runner mode=plan <overrides>``, the plan of one rank of
``dist=fsdp dist.world_size=8`` on the named card (its usable memory is the budget, its peaks price the
compute). Its communication (plan.json's ``step_time.comm``: every all-gather and reduce-scatter with
its bytes and calls, runner/plan/comm.py) is then priced over each interconnect of conf/devices.yaml
with :func:`runner.plan.comm.repriced`: the collectives do not depend on the link, so no plan is
repeated per column (tests/runner/plan/test_comm_time.py checks that a re-plan equals its repricing).

The settings of the full fine-tunes, as the Flux rows of the section above: the preset, then the
trained module in full (``model.train=full`` where the preset is LoRA) with AdamW on bf16 weights
(``optimizer=adamw model.train_dtype=bfloat16``: FSDP's optimizer must update DTensor shards),
``offload=[park]`` (streaming sharded blocks is refused), and nf4 kept on the text encoder only
(``quantization.nf4.modules=[text_encoder]``: a quantized trained module cannot be fine-tuned in
full). One sample per GPU (``train.batch_size=8``, ``train.grad_accum=1``).
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runner.devices import device_table, link_spec, link_table
from runner.plan.comm import repriced, step_seconds

CLUSTER_BEGIN, CLUSTER_END = "<!-- bench/dist_plan.py cluster begin -->", "<!-- bench/dist_plan.py cluster end -->"
GiB = 2**30
WORLD = 8
FULL = ["model.size=full", "offload=[park]", "optimizer=adamw", "model.train_dtype=bfloat16"]
MODELS: list[tuple[str, list[str]]] = [
    ("Flux.1-dev (12 B)", ["+preset=flux_24gb_full", "~offload.stream", *FULL]),
    ("Qwen-Image (20 B)", ["+preset=qwen_image_24gb", "model.train=full", "quantization.nf4.modules=[text_encoder]",
                           *FULL]),
    ("Wan 2.1 T2V 14B, 49 x 832x480", ["+preset=wan_24gb", "model.train=full", "quantization.nf4.modules=[text_encoder]",
                                       "train.grad_accum=1", *FULL]),
]
CARDS = ("rtx4090", "l40s", "h100_sxm")  # 24, 48, 80 GB
ONE_NODE = ("nvlink4", "nvlink3", "pcie5_x16", "pcie4_x16")  # 8 GPUs in one node over this link
TWO_NODES = ("ib_400", "ib_100")  # 8 GPUs as 2 nodes x 4, the card's own link within, this network between


def overrides(model: list[str], card: str) -> list[str]:
    return [*model, "dist=fsdp", f"dist.world_size={WORLD}", f"train.batch_size={WORLD}", f"device.name={card}",
            "budget_gb=null"]


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def priced(p: dict, card: str) -> dict[str, float]:
    """s/step of the plan ``p`` over each link: one node of 8, then 2 nodes of 4 over each network."""
    comm = p["step_time"]["comm"]
    own = link_spec(device_table()[card]["link"])
    out = {}
    for name in ONE_NODE:
        link = link_spec(name)
        out[name] = step_seconds(p["step_time"], repriced(comm, link, link))
    for name in TWO_NODES:
        out[name] = step_seconds(p["step_time"], repriced(comm, own, link_spec(name), ranks_per_node=WORLD // 2))
    return out


def host_cells(p: dict) -> str:
    """The plan's host RAM per rank, rank 0's and per node (runner/plan/dist.py host_per_node)."""
    h = p.get("host_ranks") or {}
    per_rank = h.get("per_rank_bytes", p["host_peak_bytes"])
    return (f"{gib(per_rank)} / {gib(h.get('rank0_bytes', per_rank))} / "
            f"{gib(h.get('per_node_bytes', WORLD * per_rank))}")


def cluster_section(plan: Callable[[list[str]], tuple[dict, float]]) -> str:
    """The section: ``plan(overrides)`` runs one ``mode=plan`` command and returns (plan.json, wall seconds)."""
    load = os.getloadavg()[0]
    links = link_table()
    head = ["| model | card (budget GiB) | per-GPU peak (+ workspaces) GiB | fits | host RAM GiB: per rank / rank 0 / "
            f"per node of {WORLD} | compute alone s/step | sent per GPU per step GiB | "
            + " | ".join(f"{n} ({links[n]['gbps']:g} GB/s)" for n in ONE_NODE) + " | "
            + " | ".join(f"2 x 4 GPUs, {n} ({links[n]['gbps']:g} GB/s per NIC)" for n in TWO_NODES)
            + " | wall (s) |", "|" + "---|" * (8 + len(ONE_NODE) + len(TWO_NODES))]
    rows, commands = [], []
    for label, model in MODELS:
        for card in CARDS:
            ov = overrides(model, card)
            p, wall = plan(ov)
            st, comm = p["step_time"], p["step_time"]["comm"]
            sent = sum(c["sent_bytes"] * c["repeats"] for c in comm["collectives"] if not c["exposed"])
            own = device_table()[card]["link"]
            cells = [f"**{s:.2f}**" if name == own else f"{s:.2f}" for name, s in priced(p, card).items()]
            print(f"{label} on {WORLD} x {card}: {gib(p['peak_bytes'])} GiB, fits={p['fits']}, "
                  f"{st['seconds']:.2f} s/step over {comm['links']} ({wall:.0f} s)", flush=True)
            rows.append(f"| {label} | {card} ({gib(p['budget_bytes'])}) | {gib(p['peak_bytes'])} "
                        f"({gib(p['required_bytes'])}) in {p['peak_phase']} | {'yes' if p['fits'] else 'no'} | "
                        f"{host_cells(p)} | "
                        f"{comm['compute_seconds']:.2f} | {gib(sent)} | " + " | ".join(cells) + f" | {wall:.0f} |")
            commands.append(f"`python -m runner mode=plan {' '.join(ov)}`")
    lines = [CLUSTER_BEGIN, f"## Cluster table: full fine-tunes on {WORLD} GPUs, s/step per interconnect "
             "(bench/dist_plan.py --table cluster)", "",
             f"Command (CPU only, 2 cores, 1-minute load average {load:.2f} at the start, {time.strftime('%Y-%m-%d')}): "
             "`PYTHONPATH=. python bench/dist_plan.py --table cluster`. One plan per row (its command is listed "
             "below the table); the interconnect columns price that plan's collectives over each link "
             "(runner/plan/comm.py: NCCL ring bytes (n-1)/n, its latency model, 80 % of the link; FSDP2 overlaps "
             "them with compute except the first gather and the last reduce-scatters). Bold: the card's own link "
             "(conf/devices.yaml); NVLink columns on PCIe cards are what-ifs (an RTX 4090 or L40S has no NVLink).", "",
             *head, *rows, "",
             "Per node: rank 0's host peak + 7 x the other ranks' on one node (every rank's host peak is in setup; "
             "at random init, as here, rank 0 builds the trained module whole and broadcasts it, and loads the "
             "modules that only fill the encoder cache; from safetensors files rank 0 reads its rows like the "
             "others, runner/distributed/loading.py). The 2-node columns put 4 GPUs per node (host RAM "
             "per node halves) with one NIC per GPU: the ring crosses nodes on 4 NICs at once. Compute alone is the "
             "step without communication; a link only slows the step where its collectives outlast the compute "
             "they overlap.", "", "Commands:", "", *[f"- {c}" for c in commands], CLUSTER_END]
    return "\n".join(lines)
