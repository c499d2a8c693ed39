"""Two processes with the gloo backend, started by the launchers users use (``torchrun``, ``accelerate
launch``), against one process with the same global batch.

What is shown, launch by launch (each compared step by step with a one-process reference run in
this process):

1. ``torchrun`` + ``dist=ddp``, full fine-tune with park (a fresh encoder cache), block
   checkpointing and VAE tiling, and an out-of-memory error raised on rank 1 only, inside the
   U-Net's forward, in step 2: the same losses; both ranks retried with micro-batch 1 (rank 0's
   metrics say so, and rank 0 did not run out of memory itself); rank 0 alone filled the cache
   and rank 1 read it; one run directory, one log, written by rank 0.
2. ``accelerate launch`` + ``dist=fsdp``, LoRA on an nf4-quantized base (the constrained preset:
   park, checkpointing) + tiling, with the same one-rank OOM, this time in the middle of FSDP's
   all-gathers: the same losses.
3. ``torchrun`` + ``dist=fsdp`` full fine-tune resumed from the one-process run's full checkpoint:
   the same losses for the next steps; its sharded checkpoint resumed in one process: the same
   losses again. So resume works 1 -> 2 and 2 -> 1 processes, across formats.

Tolerance: the ranks' mean losses are averaged in float64 and the gradients are sums in another
order than one process's batched reductions: measured differences up to 2e-7 (relative); 1e-5
is far below what one sample counted twice or dropped would change (~1e-2).

Each launch starts two Python processes that import torch and diffusers and build the tiny SDXL
models (~30-45 s on 2 busy cores); marked ``slow``.
"""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.__main__ import task
from runner.output.report import read_metrics
from runner.cli.compose import compose_config

ROOT = Path(__file__).resolve().parents[3]
ASSETS = ROOT / "tests" / "assets"
TRAINER = "trainer._target_=dist_trainer.OOMOnOneRankSDXL"
BASE = ["train.progress=false", "train.preflight=false", "export.enabled=false", "data.demo_size=8",
        "optimizer.lr=1e-3", "train.batch_size=4", "train.keep_saved=5"]
COMMON = [*BASE, TRAINER]
FULL = ["checkpoint=blocks", "offload=park", "tiling=vae"]
LORA = ["+preset=constrained", "optimizer=adamw", "+tiling=vae"]
OOM_ON_RANK_1 = "rank=1,step=2,above=1,block=3"
REL = 1e-5

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(launcher: str, cwd: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``torchrun`` or ``accelerate launch`` of ``python -m runner`` on 2 CPU processes."""
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2",
               "--num_machines=1", f"--main_process_port={_free_port()}", "--mixed_precision=no",
               "--dynamo_backend=no"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT), str(ASSETS)]), **(env or {})}
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([*cmd, "-m", "runner", *overrides], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-5000:]
    return proc


def one_process(out: Path, *overrides: str, common: list[str] = COMMON) -> list[dict]:
    sys.path.insert(0, str(ASSETS))
    try:
        task(compose_config([f"output_dir={out}", *common, *overrides]))
    finally:
        sys.path.remove(str(ASSETS))
    return read_metrics(out / "metrics.jsonl")


def assert_same_losses(rows: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for r, ref in zip(rows, reference):
        assert r["loss"] == pytest.approx(ref["loss"], rel=REL), (r["step"], r["loss"], ref["loss"])


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """One-process runs: a full fine-tune of 6 steps saving every 2 steps, and a LoRA run of 3 steps."""
    d = tmp_path_factory.mktemp("one_process")
    full = one_process(d / "full", *FULL, f"offload.park.cache_dir={d / 'cache'}", "train.steps=6",
                       "train.save_every=2")
    lora = one_process(d / "lora", *LORA, f"offload.park.cache_dir={d / 'cache'}", "train.steps=3")
    return {"full": (d / "full", full), "lora": (d / "lora", lora), "cache": (d / "cache", [])}


def test_torchrun_ddp_matches_one_process_and_agrees_on_a_one_rank_oom(tmp_path, references):
    counts = tmp_path / "counts"
    proc = launch("torchrun", tmp_path / "run", "dist=ddp", *FULL, *COMMON, "train.steps=3",
                  f"offload.park.cache_dir={tmp_path / 'fresh_cache'}",
                  env={"RUNNER_TEST_OOM": OOM_ON_RANK_1, "RUNNER_TEST_COUNTS": str(counts)})
    runs = [p for p in (tmp_path / "run" / "outputs").glob("*/*") if p.is_dir()]
    assert len(runs) == 1, runs  # both ranks took rank 0's start time for Hydra's run directory
    out = runs[0]
    rows = read_metrics(out / "metrics.jsonl")
    assert_same_losses(rows, references["full"][1][:3])
    # rank 1 ran out of memory in step 2; rank 0 (which did not) retried the step with it
    assert [r["micro_batch_size"] for r in rows] == [2, 1, 1] and [r["oom_retries"] for r in rows] == [0, 1, 0]
    per_rank = {r: json.loads((counts / f"rank-{r}.json").read_text()) for r in (0, 1)}
    assert per_rank[1]["raised"] >= 1 and per_rank[0]["raised"] == 0
    # the encoder cache: written by rank 0 alone, read by rank 1 once it was complete
    assert per_rank[0]["encoded"] > 0 and per_rank[1]["encoded"] == 0
    # so rank 1 never loaded the modules that only fill it (runner/distributed/loading.py): no weight bytes built
    assert_cache_only_modules_on_rank_0(per_rank)
    log = next(out.glob("*.log")).read_text()
    assert "dist=ddp: text_encoder, text_encoder_2, vae loaded on rank 0 only" in log
    assert log.count("run: on cpu") == 1 and "rank 0 of 2, DDP" in log and "[rank 1]" not in log
    assert "PeerOutOfMemory" in log and "out of memory in step 2: micro-batch 2 -> 1" in log  # rank 0's own line
    assert "[rank 1] out of memory in step 2" in proc.stdout + proc.stderr  # rank 1: its console only
    assert (out / ".hydra" / "overrides.yaml").is_file()
    assert json.loads((out / "job_summary.json").read_text())["status"] == "ok"


def assert_cache_only_modules_on_rank_0(per_rank: dict[int, dict]) -> None:
    """Rank 1 built text_encoder, text_encoder_2 and vae with no parameter bytes, rank 0 with all of
    theirs; the U-Net (trained) the same on both (dist_trainer.py's ``built``: bytes as each rank built it)."""
    cache_only = ("text_encoder", "text_encoder_2", "vae")
    assert all(per_rank[0]["built"][m] > 0 for m in cache_only), per_rank[0]["built"]
    assert all(per_rank[1]["built"][m] == 0 for m in cache_only), per_rank[1]["built"]


def test_a_rank_that_does_not_see_rank_0s_cache_stops_naming_the_key(tmp_path):
    """Each process its own cache folder (``cache-${oc.env:RANK}``): rank 1 built the cache-only modules
    without weights and, after rank 0's fill, finds its own folder empty. It stops before any module
    runs with one paragraph naming offload.park.cache_dir (plugins/park/loaded.py), not a traceback of
    the runner's (torchrun's own report of the failed child follows)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ASSETS)])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "runner",
           "dist=ddp", "offload=park", *COMMON, "train.steps=1", f"output_dir={tmp_path / 'out'}",
           f"offload.park.cache_dir={tmp_path}/cache-${{oc.env:RANK}}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    console = proc.stdout + proc.stderr
    assert proc.returncode != 0, console[-3000:]
    assert "error: offload.park.cache_dir: 16 encoder cache entries are missing in " in console, console[-3000:]
    assert "cache-1 after rank 0 filled it, and this process did not load text_encoder, text_encoder_2, vae" in console
    assert "set offload.park.cache_dir to a path all of them read" in console
    assert "/runner/" not in "".join(line for line in console.splitlines(True) if line.lstrip().startswith("File "))
    assert (tmp_path / "cache-0").is_dir()  # rank 0 filled its own


def test_accelerate_launch_fsdp_with_quantized_lora_matches_one_process(tmp_path, references):
    cache = references["cache"][0]
    launch("accelerate", tmp_path, "dist=fsdp", *LORA, *COMMON, "train.steps=3", f"output_dir={tmp_path / 'out'}",
           f"offload.park.cache_dir={cache}", env={"RUNNER_TEST_OOM": OOM_ON_RANK_1})
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert_same_losses(rows, references["lora"][1])
    assert [r["micro_batch_size"] for r in rows] == [2, 1, 1]


def test_resume_one_process_into_fsdp_and_back(tmp_path, references):
    ref_dir, ref = references["full"]
    cache = references["cache"][0]
    two = tmp_path / "two"
    launch("torchrun", tmp_path, "dist=fsdp", *FULL, *COMMON, "train.steps=4", f"output_dir={two}",
           f"offload.park.cache_dir={cache}", f"train.resume={ref_dir / 'checkpoints' / 'step-00000002'}",
           env={"RUNNER_TEST_COUNTS": str(tmp_path / "counts")})
    assert_same_losses(read_metrics(two / "metrics.jsonl"), ref[2:4])
    # random init under FSDP: rank 0 broadcasts the frozen modules it drew, but not those only it calls
    assert_cache_only_modules_on_rank_0({r: json.loads((tmp_path / "counts" / f"rank-{r}.json").read_text())
                                         for r in (0, 1)})
    sharded = two / "checkpoints" / "step-00000004"
    assert (sharded / "sharded" / ".metadata").is_file() and not (sharded / "trainable.safetensors").exists()
    assert json.loads((sharded / "state.json").read_text())["world_size"] == 2

    back = tmp_path / "back"
    rows = one_process(back, *FULL, f"offload.park.cache_dir={cache}", "train.steps=6", f"train.resume={sharded}")
    assert_same_losses(rows, ref[4:6])


def test_two_nodes_of_two_ranks_rehearsed_on_one_machine(tmp_path, references):
    """A multi-node launch, rehearsed: two ``torchrun --nnodes=2 --nproc-per-node=2`` (node ranks 0 and
    1) meet at a localhost c10d rendezvous, as two machines would at their head node's address, and
    train 3 steps as 4 ranks of one DDP group: the same losses as one process (one sample per rank)."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ASSETS)])}
    out = tmp_path / "out"
    nodes = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
               f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=rehearsal", "-m", "runner", "dist=ddp", *LORA, *COMMON, "train.steps=3",
               f"output_dir={out}", f"offload.park.cache_dir={references['cache'][0]}"]
        nodes.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    logs = [p.communicate(timeout=900)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(log[-4000:] for log in logs)
    assert "Traceback" not in "".join(logs)
    rows = read_metrics(out / "metrics.jsonl")
    assert_same_losses(rows, references["lora"][1])
    console = logs[0] + logs[1]
    assert console.count("run: on cpu") == 1 and "rank 0 of 4, DDP" in console  # rank 0 (node 0) speaks for the run


def test_ddp_keeps_the_ema_and_the_validation_loss_of_one_process(tmp_path):
    """Issue 29: dist=ddp with ema.enabled=true and data.val_fraction=0.25 trains 3 steps on 2 CPU ranks.
    Every rank holds the same weights after each step, so each keeps the same EMA and computes the
    same held-out loss; rank 0 logs val_loss and saves ema.safetensors. Both equal one process's
    run of the same global batch within the DDP tolerance (REL)."""
    from safetensors.torch import load_file

    extra = ["ema.enabled=true", "ema.decay=0.5", "data.val_fraction=0.25", "val.every=1", "train.steps=3",
             "model.train=lora", "train.save_every=3"]
    ref_dir = tmp_path / "one"
    reference = one_process(ref_dir, *extra)
    launch("torchrun", tmp_path / "run", "dist=ddp", *COMMON, *extra, f"output_dir={tmp_path / 'two'}")
    rows = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert_same_losses(rows, reference)
    vals = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    ref_vals = [(r["step"], r["val_loss"]) for r in reference if r.get("val_loss") is not None]
    assert [s for s, _ in vals] == [s for s, _ in ref_vals] == [1, 2, 3]
    for (_, v), (_, ref) in zip(vals, ref_vals):
        assert v == pytest.approx(ref, rel=REL)
    ema = load_file(str(tmp_path / "two" / "checkpoints" / "step-00000003" / "ema.safetensors"))
    ref_ema = load_file(str(ref_dir / "checkpoints" / "step-00000003" / "ema.safetensors"))
    assert ema.keys() == ref_ema.keys() and ema
    # DDP's averaging reorders float sums, and Adam turns a gradient's last bits into update-sized
    # differences of the LoRA weights (up to ~1e-4 of their size here). The EMA is an average of the
    # weights after each step, so it differs from one process's by no more than the weights do.
    weights = load_file(str(tmp_path / "two" / "checkpoints" / "step-00000003" / "trainable.safetensors"))
    ref_weights = load_file(str(ref_dir / "checkpoints" / "step-00000003" / "trainable.safetensors"))
    weight_diff = max(float((weights[k] - v).abs().max()) for k, v in ref_weights.items())
    ema_diff = max(float((ema[k] - v).abs().max()) for k, v in ref_ema.items())
    assert ema_diff <= weight_diff + 1e-9, (ema_diff, weight_diff)
    assert any(not torch.equal(ema[k], weights[k]) for k in ema)  # an average, not a copy of the weights


def test_ddp_with_fused_backward_steps_each_averaged_gradient_like_one_process(tmp_path):
    """Issue 29: dist=ddp optimizer.fused_backward=true model.train=full trains 3 steps on 2 CPU ranks,
    each gradient averaged over the ranks in its hook before its parameter steps (no DDP buckets):
    the losses and the weights equal one process's fused run (per-parameter clipping included)."""
    from safetensors.torch import load_file

    extra = ["optimizer.fused_backward=true", "model.train=full", "train.steps=3", "train.save_every=3"]
    reference = one_process(tmp_path / "one", *extra)
    proc = launch("torchrun", tmp_path / "run", "dist=ddp", *COMMON, *extra, f"output_dir={tmp_path / 'two'}")
    logs = proc.stdout + proc.stderr + "".join(p.read_text() for p in tmp_path.rglob("*.log"))
    assert "each gradient is averaged over the ranks in its hook" in logs
    assert_same_losses(read_metrics(tmp_path / "two" / "metrics.jsonl"), reference)
    two = load_file(str(tmp_path / "two" / "checkpoints" / "step-00000003" / "trainable.safetensors"))
    one = load_file(str(tmp_path / "one" / "checkpoints" / "step-00000003" / "trainable.safetensors"))
    assert two.keys() == one.keys()
    diff = torch.cat([(two[k] - v).abs().flatten() for k, v in one.items()])
    # The ranks' reordered sums differ in the last bits; Adam turns that into a visible difference only
    # where a gradient is ~0 (its update is ~sign(g) * lr), at most 2 lr per step. Nearly every weight agrees.
    assert float(diff.max()) <= 2 * 1e-3 * 3, float(diff.max())
    # (a rank stepping on its own half of the batch would move most weights by a good part of lr = 1e-3)
    assert float(diff.quantile(0.99)) <= 1e-5 and float(diff.median()) <= 1e-7, (diff.quantile(0.99), diff.median())


def test_fsdp_gathers_bf16_units_from_float32_shards_like_one_process_autocast(tmp_path):
    """Issue 29: dist=fsdp with bf16 autocast and float32 trained weights shards each unit with FSDP2's
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32) (runner/distributed/runtime.py). A full
    fine-tune with block checkpointing trains 3 steps on 2 CPU ranks (``train.cpu_autocast=true`` keeps
    bf16 autocast on the CPU): inside a unit's forward its Linear weights are whole bf16 tensors (one
    process: the float32 weight, which autocast casts per op); outside the forward the U-Net's
    parameters are float32 DTensor shards, the parameters the optimizer steps. The losses are one
    process's bf16-autocast losses: both compute every matmul from the same bf16-rounded weights and
    accumulate float32 gradients, so only the order of float sums differs (bf16 rounding of the ranks'
    half-batch gradients; measured up to 2.5e-4 relative, tolerance 2e-3, where a sample counted twice
    or dropped changes the loss by ~1e-2)."""
    common = [*BASE, "trainer._target_=dist_trainer.RecordsDtypesSDXL", "train.cpu_autocast=true",
              "train.mixed_precision=bf16", "model.train=full", "checkpoint=blocks", "train.steps=3"]
    seen_one, seen_two = tmp_path / "dtypes-one", tmp_path / "dtypes-two"
    os.environ["RUNNER_TEST_DTYPES"] = str(seen_one)
    try:
        reference = one_process(tmp_path / "one", common=common)
    finally:
        del os.environ["RUNNER_TEST_DTYPES"]
    proc = launch("torchrun", tmp_path / "run", "dist=fsdp", *common, f"output_dir={tmp_path / 'two'}",
                  env={"RUNNER_TEST_DTYPES": str(seen_two)})
    logs = proc.stdout + proc.stderr + "".join(p.read_text() for p in tmp_path.rglob("*.log"))
    assert "each unit all-gathered in bfloat16, gradients reduce-scattered in float32" in logs
    rows = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == [1, 2, 3]
    for r, ref in zip(rows, reference):
        assert r["loss"] == pytest.approx(ref["loss"], rel=2e-3), (r["step"], r["loss"], ref["loss"])

    one = json.loads((seen_one / "rank-0.json").read_text())
    assert {(f["dtype"], f["type"]) for f in one["forward"]} == {("torch.float32", "Parameter")}
    shape = one["forward"][0]["shape"]
    for rank in (0, 1):
        two = json.loads((seen_two / f"rank-{rank}.json").read_text())
        # in the unit's forward: its gathered weight, whole and in bf16
        assert len(two["forward"]) >= 1 and {f["dtype"] for f in two["forward"]} == {"torch.bfloat16"}
        assert all(f["shape"] == shape and f["type"] != "DTensor" for f in two["forward"])
        # between forwards: float32 shards (DTensors), what the optimizer holds and steps
        assert two["stored"] == [["torch.float32", "DTensor"]], two["stored"]


def test_fsdp_cpu_offload_on_a_cpu_run_trains_like_the_run_without_it(tmp_path):
    """Issue 29: ``dist=fsdp dist.cpu_offload=true`` on 2 CPU ranks (train.device=cpu, gloo) trains 3 steps
    of a full fine-tune. Before, FSDP2's CPUOffloadPolicy pinned the host shards and a CPU-only torch
    raised "Cannot access accelerator device" before step 1; now the shards are pinned only for a
    CUDA-like target (runner/distributed/runtime.py:cpu_offload_policy). The losses are those of the same run
    without offload and of one process (on this CPU the offloaded run measured bit for bit the same
    as the one without: the shards are on the host either way)."""
    extra = ["model.train=full", "train.steps=3"]
    reference = one_process(tmp_path / "one", *extra)
    plain = launch("torchrun", tmp_path / "run0", "dist=fsdp", *COMMON, *extra, f"output_dir={tmp_path / 'plain'}")
    offload = launch("torchrun", tmp_path / "run1", "dist=fsdp", "dist.cpu_offload=true", *COMMON, *extra,
                     f"output_dir={tmp_path / 'offload'}")
    def logs(proc: subprocess.CompletedProcess, out: str) -> str:
        return proc.stdout + proc.stderr + "".join(p.read_text() for p in (tmp_path / out).glob("*.log"))

    assert "FSDP2 (sharded over 2 ranks, weights on the host)" in logs(offload, "offload")
    assert "sharded weights on the host" in logs(offload, "offload")
    assert "FSDP2 (sharded over 2 ranks)" in logs(plain, "plain")
    assert "sharded weights on the host" not in logs(plain, "plain")
    rows, without = read_metrics(tmp_path / "offload" / "metrics.jsonl"), read_metrics(tmp_path / "plain" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_same_losses(rows, without)
    assert_same_losses(rows, reference)


def test_auto_fit_searches_on_rank_0_and_every_rank_trains_with_its_answer(tmp_path):
    """``train.auto_fit=true`` under ``dist=ddp`` on 2 ranks: rank 0 alone runs the search (its plans are
    one rank's), writes the fit preset, and both ranks train with the settings it chose; a budget the
    base does not fit forces a change (block checkpointing or a smaller micro-batch, a multiple of 2)."""
    out = tmp_path / "run"
    base = ["dist=ddp", *BASE, "data.resolution=128", "train.steps=3", f"output_dir={out}", "fit.confirm=4"]
    plan = subprocess.run([sys.executable, "-m", "runner", "mode=plan", "dist.world_size=2", *base],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    planned = json.loads((out / "plan.json").read_text())  # one rank's, as the search plans
    budget = (planned["required_bytes"] - 0.12 * planned["peak_bytes"]) / 2**30  # the base needs 12 % less
    proc = launch("torchrun", tmp_path / "cwd", *base, "train.auto_fit=true", f"budget_gb={budget:.6f}")
    console = proc.stdout + proc.stderr
    assert plan.returncode == 0 and console.count("auto_fit: training with") == 1, console[-4000:]
    fit = json.loads((out / "fit.json").read_text())
    winner = fit["winner"]
    assert winner["knobs"] != fit["base"]["knobs"] and winner["planned_peak_bytes"] < planned["peak_bytes"]
    assert all(c["knobs"]["micro"] % 2 == 0 for c in fit["candidates"])  # each rank takes micro / 2 samples
    assert all(not c["knobs"]["stream_gb"] and not c["knobs"]["optimizer_offload"] for c in fit["candidates"])
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["micro_batch_size"] == winner["knobs"]["micro"] // 2  # both ranks trained with the winner
