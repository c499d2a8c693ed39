"""Issue 29: the EMA and the validation loss under ``dist=fsdp`` on 2 CPU ranks (gloo), against one process.

One full fine-tune of the tiny SDXL U-Net, 3 steps with ``ema.enabled=true`` and ``data.val_fraction=0.25``,
run in one process and under ``torchrun --nproc_per_node=2 dist=fsdp``:

* each rank keeps the EMA of its own shards; the sharded checkpoint holds it in its DCP folder, split
  over both ranks (not gathered), with ``ema.json`` beside it; read whole, it is one process's EMA
  within float tolerance;
* the exported ``diffusers_ema`` U-Net (rank 0 reads the sharded checkpoint whole) is that EMA;
* ``val_loss`` is one process's within float tolerance;
* samples with the EMA swapped in (``sample.use_ema``) are one process's, and training goes on after them
  with the trained weights;
* a resume continues the EMA: from the sharded checkpoint on 2 ranks (bit for bit the uninterrupted
  run's), from one process's full checkpoint into 2 ranks, and from the sharded one into one process.

Tolerance: FSDP's reduce-scatter sums in another order than one process, and Adam turns a gradient's
last bits into update-sized differences; the EMA is an average of the weights after each step, so it
differs from one process's by no more than the weights do (the bound the DDP test uses).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_dist_training import COMMON, REL, assert_same_losses, launch, one_process

from runner.output.report import read_metrics

pytestmark = pytest.mark.slow

EXTRA = ["ema.enabled=true", "ema.decay=0.5", "data.val_fraction=0.25", "val.every=1", "model.train=full",
         "train.save_every=2"]
SAMPLES = ["sample.every=1", "sample.prompts=[a red cube]", "sample.steps=2", "sample.use_ema=true"]


def read_sharded(ckpt: Path, key: str) -> dict[str, torch.Tensor]:
    """Every tensor under ``key`` of a sharded checkpoint, read whole in this process (as mode=export does)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(ckpt / "sharded"))
    meta = reader.read_metadata().state_dict_metadata
    prefix = key + "."
    target = {k[len(prefix):]: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
              if k.startswith(prefix) and hasattr(m, "size")}
    dcp.load({key: target}, storage_reader=reader, no_dist=True)
    return target


def safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - v).abs().max()) for k, v in b.items())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fsdp_features")
    one_process(d / "one", *EXTRA, *SAMPLES, "train.steps=3")
    launch("torchrun", d / "run", "dist=fsdp", *COMMON, *EXTRA, *SAMPLES, "train.steps=3", "export.enabled=true",
           f"output_dir={d / 'two'}")
    return {"one": d / "one", "two": d / "two", "root": d}


def test_fsdp_keeps_a_sharded_ema_like_one_process_and_exports_it(runs):
    """``dist=fsdp ema.enabled=true`` trains 3 steps on 2 CPU ranks: the same losses as one process; the
    checkpoint's EMA is sharded over both ranks and, read whole, is one process's EMA within tolerance."""
    one, two = runs["one"], runs["two"]
    assert_same_losses(read_metrics(two / "metrics.jsonl"), read_metrics(one / "metrics.jsonl"))
    ckpt = two / "checkpoints" / "step-00000003"
    assert (ckpt / "sharded" / ".metadata").is_file() and (ckpt / "ema.json").is_file()
    assert not (ckpt / "ema.safetensors").exists() and not (ckpt / "trainable.safetensors").exists()
    info = json.loads((ckpt / "ema.json").read_text())
    assert info["metadata"]["updates"] == "3"

    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(ckpt / "sharded")).read_metadata().state_dict_metadata
    ema_keys = [k for k in meta if k.startswith("ema.")]
    assert len(ema_keys) == len(info["shapes"])
    # a tensor of 2 or more rows is written as two chunks, one per rank (sharded, not gathered on rank 0)
    split = [k for k in ema_keys if meta[k].size[0] >= 2]
    assert split and all(len(meta[k].chunks) == 2 for k in split)

    ema = read_sharded(ckpt, "ema")
    weights = read_sharded(ckpt, "model")
    ref_ema = safetensors(one / "checkpoints" / "step-00000003" / "ema.safetensors")
    ref_weights = safetensors(one / "checkpoints" / "step-00000003" / "trainable.safetensors")
    weight_diff, ema_diff = max_diff(weights, ref_weights), max_diff(ema, ref_ema)
    assert ema_diff <= weight_diff + 1e-9, (ema_diff, weight_diff)
    assert any(not torch.equal(ema[k], weights[k]) for k in ema)  # an average, not a copy of the weights
    # Adam turns last-bit gradient differences into visible ones only where a gradient is ~0 (its update is
    # ~sign(g) * lr): nearly every EMA value agrees (a rank averaging wrong weights would move most of them)
    diff = torch.cat([(ema[k] - v).abs().flatten() for k, v in ref_ema.items()])
    assert float(diff.quantile(0.99)) <= 1e-5 and float(diff.median()) <= 1e-7, (diff.quantile(0.99), diff.median())

    # export (rank 0, reading the sharded checkpoint whole): the diffusers_ema U-Net is the EMA
    exported = safetensors(ckpt / "export" / "diffusers_ema" / "unet" / "diffusion_pytorch_model.safetensors")
    names = {k.removeprefix("unet."): v for k, v in ema.items()}
    assert exported.keys() == names.keys()
    assert all(torch.equal(exported[k], v.to(exported[k].dtype)) for k, v in names.items())
    assert json.loads((ckpt / "export" / "export.json").read_text())["ema"]["updates"] == 3


def test_fsdp_samples_with_the_ema_swapped_in_and_trains_on_after_it(runs):
    """``sample.use_ema=true`` under dist=fsdp: every rank copies its EMA shards into its weight shards for
    the pass (the units resharded around it, so no unit keeps weights gathered before or during the swap),
    rank 0 writes one process's images; the next steps train on the trained weights again: their losses
    are one process's (test_fsdp_keeps_a_sharded_ema_like_one_process_and_exports_it)."""
    import numpy as np
    from PIL import Image

    for step in (0, 1, 2, 3):
        ones = sorted((runs["one"] / "samples" / f"step-{step}").glob("*.png"))
        twos = sorted((runs["two"] / "samples" / f"step-{step}").glob("*.png"))
        assert [p.name for p in twos] == [p.name for p in ones] and ones, step
        for a, b in zip(ones, twos):
            diff = np.abs(np.asarray(Image.open(a), dtype=np.int16) - np.asarray(Image.open(b), dtype=np.int16))
            assert int(diff.max()) <= 2, (step, a.name, int(diff.max()))


def test_fsdp_logs_the_validation_loss_of_one_process(runs):
    """``dist=fsdp data.val_fraction=0.25``: every rank runs every held-out forward (they are collective);
    rank 0 logs val_loss after each step, one process's value within float tolerance."""
    rows = read_metrics(runs["two"] / "metrics.jsonl")
    ref = read_metrics(runs["one"] / "metrics.jsonl")
    vals = [(r["step"], r.get("val_loss")) for r in rows]
    ref_vals = [(r["step"], r.get("val_loss")) for r in ref]
    assert [s for s, v in vals if v is not None] == [s for s, v in ref_vals if v is not None] == [1, 2, 3]
    for (_, v), (_, r) in zip(vals, ref_vals):
        assert v == pytest.approx(r, rel=REL)


def test_a_resume_continues_the_sharded_ema_in_any_world_size(runs):
    """The EMA continues from step 2: sharded -> 2 ranks (bit for bit the uninterrupted run), full (one
    process's) -> 2 ranks and sharded -> one process (one process's EMA within tolerance)."""
    one, two, root = runs["one"], runs["two"], runs["root"]
    ref_ema = safetensors(one / "checkpoints" / "step-00000003" / "ema.safetensors")
    ref_weights = safetensors(one / "checkpoints" / "step-00000003" / "trainable.safetensors")
    uninterrupted = read_sharded(two / "checkpoints" / "step-00000003", "ema")

    again = root / "again"
    launch("torchrun", root / "run_again", "dist=fsdp", *COMMON, *EXTRA, "train.steps=3", f"output_dir={again}",
           f"train.resume={two / 'checkpoints' / 'step-00000002'}")
    resumed = read_sharded(again / "checkpoints" / "step-00000003", "ema")
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], v) for k, v in uninterrupted.items())

    from_full = root / "from_full"
    launch("torchrun", root / "run_full", "dist=fsdp", *COMMON, *EXTRA, "train.steps=3", f"output_dir={from_full}",
           f"train.resume={one / 'checkpoints' / 'step-00000002'}")
    ckpt = from_full / "checkpoints" / "step-00000003"
    assert max_diff(read_sharded(ckpt, "ema"), ref_ema) <= max_diff(read_sharded(ckpt, "model"), ref_weights) + 1e-9
    assert json.loads((ckpt / "ema.json").read_text())["metadata"]["updates"] == "3"

    back = root / "back"
    one_process(back, *EXTRA, "train.steps=3", f"train.resume={two / 'checkpoints' / 'step-00000002'}")
    ckpt = back / "checkpoints" / "step-00000003"
    assert max_diff(safetensors(ckpt / "ema.safetensors"), ref_ema) \
        <= max_diff(safetensors(ckpt / "trainable.safetensors"), ref_weights) + 1e-9


def test_an_oom_on_one_rank_in_the_held_out_pass_is_retried_by_every_rank(runs, tmp_path):
    """The held-out forwards under dist=fsdp are collective: an out-of-memory error on rank 1 alone, in the
    middle of the U-Net's forward, is agreed on (runner/distributed/agree.py): both ranks halve the validation
    micro-batch and retry, and val_loss is still one process's (the mean weights each sample equally)."""
    counts = tmp_path / "counts"
    proc = launch("torchrun", tmp_path / "run", "dist=fsdp", *COMMON, *EXTRA, "train.steps=2",
                  f"output_dir={tmp_path / 'out'}",
                  env={"RUNNER_TEST_OOM": "rank=1,val=1,above=1,block=3", "RUNNER_TEST_COUNTS": str(counts)})
    assert json.loads((counts / "rank-1.json").read_text())["raised"] == 1
    assert not (counts / "rank-0.json").exists() or json.loads((counts / "rank-0.json").read_text())["raised"] == 0
    log = proc.stdout + proc.stderr + "".join(p.read_text() for p in (tmp_path / "out").glob("*.log"))
    assert "validation: out of memory at step 1: validation micro-batch 2 -> 1" in log
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    ref = read_metrics(runs["one"] / "metrics.jsonl")[:2]
    assert_same_losses(rows, ref)
    for r, want in zip(rows, ref):
        assert r["val_loss"] == pytest.approx(want["val_loss"], rel=REL), (r["step"], r["val_loss"], want["val_loss"])


def test_fsdp_with_fused_backward_steps_each_shard_after_its_reduce_scatter(tmp_path):
    """Issue 29: ``dist=fsdp optimizer.fused_backward=true model.train=full`` trains 3 steps on 2 CPU
    ranks. FSDP2 calls each sharded parameter's post-accumulate-grad hook after its unit's
    reduce-scatter, so the hook steps this rank's shard of the averaged gradient and frees it; the
    per-parameter clipping (``train.max_grad_norm``, active at this size) uses the whole parameter's
    norm, agreed over the ranks. The losses and the weights are one process's fused run within float
    rounding. A step on an unreduced gradient (each rank's half batch) or a missed hook (no update)
    would move the weights by a good part of lr = 1e-3 per step."""
    extra = ["optimizer.fused_backward=true", "model.train=full", "train.max_grad_norm=0.01", "train.steps=3",
             "train.save_every=3"]
    reference = one_process(tmp_path / "one", *extra)
    proc = launch("torchrun", tmp_path / "run", "dist=fsdp", *COMMON, *extra, f"output_dir={tmp_path / 'two'}")
    logs = proc.stdout + proc.stderr + "".join(p.read_text() for p in tmp_path.rglob("*.log"))
    assert "dist=fsdp: unet sharded over 2 rank(s)" in logs
    assert "stepped only then" not in logs  # every shard stepped in its hook, during backward (not in step())
    rows = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == [1, 2, 3]
    for r, ref in zip(rows, reference):
        assert r["loss"] == pytest.approx(ref["loss"], rel=REL), (r["step"], r["loss"], ref["loss"])
    weights = read_sharded(tmp_path / "two" / "checkpoints" / "step-00000003", "model")
    ref_weights = safetensors(tmp_path / "one" / "checkpoints" / "step-00000003" / "trainable.safetensors")
    assert max_diff(weights, ref_weights) <= 2 * 1e-3 * 3
    diff = torch.cat([(weights[k] - v).abs().flatten() for k, v in ref_weights.items()])
    assert float(diff.quantile(0.99)) <= 1e-5 and float(diff.median()) <= 1e-7, (diff.quantile(0.99), diff.median())
