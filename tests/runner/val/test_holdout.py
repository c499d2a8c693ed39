"""The held-out validation loss (runner/val/holdout.py): the split, the fixed seeds, the value, and
that training does not notice it.

The split must be deterministic and disjoint and never trained on; the value must equal a
reference the test computes from the saved weights with the seeds derived as documented; the
training losses must be bit-identical with and without evaluations (also for a trainer that draws
from the global RNG, which an evaluation would otherwise consume); a resume must give the same
curve; an out-of-memory error must only shrink the validation micro-batch.
"""
from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed
from PIL import Image
from safetensors.torch import load_file

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.data import FolderDataset, build_dataset, collate
from runner.data.order import SampleOrder
from runner.output.report import read_metrics
from runner.resolved import resolve
from runner.val.holdout import (
    COLUMN,
    TrainingSubset,
    held_out_count,
    sample_key,
    split_indices,
)

pytestmark = pytest.mark.usefixtures("one_thread")

ASSETS = Path(__file__).resolve().parents[3] / "tests" / "assets"
if str(ASSETS) not in sys.path:  # RecordingTrainer below subclasses the README's example trainer
    sys.path.append(str(ASSETS))
from custom_trainer import PixelDiffusionTrainer  # noqa: E402

PIXEL = ["trainer=custom", "trainer._target_=custom_trainer.PixelDiffusionTrainer", "data.resolution=16"]
COMMON = ["train.device=cpu", "train.progress=false", "train.preflight=false", "data.demo_size=8", "train.batch_size=2",
          "optimizer.lr=1e-3"]
VAL = ["data.val_fraction=0.25", "val.every=1"]


@pytest.fixture(autouse=True)
def assets_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS))


def train(out: Path, *overrides: str) -> list[dict]:
    task(compose_config([f"output_dir={out}", *COMMON, *overrides]))
    return read_metrics(out / "metrics.jsonl")


def folder(path: Path, n: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (24, 24), (10 * i % 255, 80, 160)).save(path / f"img{i:02d}.png")
        (path / f"img{i:02d}.txt").write_text(f"image number {i}")
    return path


class RecordingTrainer(PixelDiffusionTrainer):
    """Records the dataset index of every sample a loss saw, and draws from the global RNG in its
    loss (as dropout would), so a validation pass that consumed the RNG would change training."""

    trained: list[int] = []
    evaluated: list[int] = []

    def loss(self, models, batch):
        seen = RecordingTrainer.trained if models["unet"].training else RecordingTrainer.evaluated
        seen += [int(i) for i in batch["index"]]
        return super().loss(models, batch) + 1e-3 * torch.rand(())


RECORDING = ["trainer=custom", "trainer._target_=test_holdout.RecordingTrainer", "data.resolution=16"]


# ---- the split ----------------------------------------------------------------------------------
def test_the_split_is_deterministic_disjoint_and_stable(tmp_path):
    ds = FolderDataset(folder(tmp_path / "data", 20), 16)
    train_a, held_a = split_indices(ds, 0.2, seed=0)
    train_b, held_b = split_indices(FolderDataset(tmp_path / "data", 16), 0.2, seed=0)
    assert (train_a, held_a) == (train_b, held_b)  # the same images every time
    assert len(held_a) == held_out_count(20, 0.2) == 4 and not set(train_a) & set(held_a)
    assert sorted(train_a + held_a) == list(range(20))
    assert split_indices(ds, 0.2, seed=1)[1] != held_a  # val.seed picks another set
    keys = {sample_key(ds, i) for i in held_a}
    folder(tmp_path / "data", 21)  # one more image: the held-out set moves by at most one
    ds21 = FolderDataset(tmp_path / "data", 16)
    keys21 = {sample_key(ds21, i) for i in split_indices(ds21, 0.2, seed=0)[1]}
    assert len(keys & keys21) >= 3
    view = TrainingSubset(ds, train_a, len(held_a))
    order = SampleOrder(len(view), seed=0)
    assert not {view[i]["index"] for i in order.indices(0, 3 * len(view))} & set(held_a)


def test_held_out_samples_are_never_trained_on(tmp_path):
    RecordingTrainer.trained, RecordingTrainer.evaluated = [], []
    rows = train(tmp_path, *RECORDING, *VAL, "train.steps=6")  # 12 samples: two epochs of the 6 trained ones
    _, held = split_indices(build_dataset(compose_config(COMMON).data), 0.25, seed=0)
    assert len(held) == 2 and all(COLUMN in r for r in rows)
    assert len(RecordingTrainer.trained) == 12 and not set(RecordingTrainer.trained) & set(held)
    assert set(RecordingTrainer.trained) == set(range(8)) - set(held)
    assert RecordingTrainer.evaluated == held * 6  # every evaluation: the held-out samples, in order


# ---- the value ----------------------------------------------------------------------------------
def documented_seed(seed: int, key: str) -> int:
    """runner/val/holdout.py: a hash of val.seed and the sample's identity, below 2**40."""
    return int.from_bytes(hashlib.sha256(f"val-noise:{seed}:{key}".encode()).digest()[:8], "big") >> 24


def test_val_loss_equals_a_reference_with_the_same_seeds(tmp_path):
    rows = train(tmp_path, *PIXEL, *VAL, "train.steps=2", "train.save_every=1", "train.keep_saved=2")
    assert [COLUMN in r for r in rows] == [True, True]
    cfg = compose_config([*PIXEL, *COMMON])
    r = resolve(cfg)
    trainer = build_trainer(cfg, r)
    demo = trainer.dataset()
    _, held = split_indices(demo, 0.25, seed=0)
    for step, row in zip((1, 2), rows):
        set_seed(r.seed)
        models = prepare_models(trainer.build_models("cpu"), cfg.model, r)
        weights = load_file(str(tmp_path / "checkpoints" / f"step-{step:08d}" / "trainable.safetensors"))
        with torch.no_grad():
            for n, p in models.named_trainable_parameters():
                p.copy_(weights[n])
            models["unet"].eval()
            losses = []
            for i in held:
                batch = collate([demo[i]])
                batch["sample_seed"] = torch.tensor([documented_seed(0, str(i))])
                losses.append(float(trainer.loss(models, batch)))
        # one sample per forward here, two in the run: float rounding of the batched convolutions only
        assert math.isclose(row[COLUMN], sum(losses) / len(losses), rel_tol=1e-5), (step, row[COLUMN], losses)
    assert rows[0][COLUMN] != rows[1][COLUMN]


def test_training_is_bit_identical_with_and_without_evaluations(tmp_path):
    """RecordingTrainer draws from the global RNG in every loss: without the fork, the evaluations
    after steps 1 and 2 would change the noise of steps 2 and 3."""
    often = train(tmp_path / "often", *RECORDING, "data.val_fraction=0.25", "val.every=1", "train.steps=3")
    last = train(tmp_path / "last", *RECORDING, "data.val_fraction=0.25", "train.steps=3")
    assert [r["loss"] for r in often] == [r["loss"] for r in last]
    assert [COLUMN in r for r in often] == [True, True, True] and [COLUMN in r for r in last] == [False, False, True]
    assert often[-1][COLUMN] == last[-1][COLUMN]
    a = load_file(str(tmp_path / "often" / "checkpoints" / "step-00000003" / "trainable.safetensors"))
    b = load_file(str(tmp_path / "last" / "checkpoints" / "step-00000003" / "trainable.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resuming_gives_the_same_val_curve(tmp_path):
    full = train(tmp_path / "full", *PIXEL, *VAL, "train.steps=4")
    train(tmp_path / "a", *PIXEL, *VAL, "train.steps=2")
    resumed = train(tmp_path / "a", *PIXEL, *VAL, "train.steps=4", f"train.resume={tmp_path / 'a'}")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r[COLUMN] for r in resumed] == [r[COLUMN] for r in full]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]


def test_an_out_of_memory_error_shrinks_the_validation_batch(tmp_path, caplog):
    """Every micro-batch above 1 runs out of memory: the training step and the validation pass both
    go down to one sample; the values equal a run configured with micro-batch 1 from the start."""
    oom = ["trainer=custom", "trainer._target_=oom_trainer.OOMPixelTrainer", "data.resolution=16",
           "+trainer.options.oom_above=1"]
    with caplog.at_level("WARNING", logger="runner"):
        rows = train(tmp_path / "oom", *oom, *VAL, "train.steps=2")
    assert "validation micro-batch 2 -> 1" in caplog.text
    ref = train(tmp_path / "ref", *PIXEL, *VAL, "train.steps=2", "train.grad_accum=2")
    assert [r[COLUMN] for r in rows] == [r[COLUMN] for r in ref]


def test_val_path_with_cached_encoders_equals_the_uncached_pass(tmp_path):
    """A separate folder; with offload=park every training latent and embedding is cached and the
    encoders dropped, so the held-out folder is encoded once at start. Its loss equals the pass that
    encodes at every evaluation up to float rounding of the encoders' batch shapes (measured: equal)."""
    val = folder(tmp_path / "val", 3)
    common = ["train.steps=2", f"data.val_path={val}", "val.every=1", "data.resolution=32"]
    plain = train(tmp_path / "plain", *common)
    parked = train(tmp_path / "park", *common, "offload=park", f"offload.park.cache_dir={tmp_path / 'cache'}")
    assert [r["loss"] for r in parked] == [r["loss"] for r in plain]
    for a, b in zip(plain, parked):
        assert math.isclose(a[COLUMN], b[COLUMN], rel_tol=1e-6)


def test_the_val_loss_reaches_the_tracker(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = train(tmp_path, *PIXEL, "data.val_fraction=0.25", "val.every=2", "train.steps=3", "log.tracker=tensorboard",
                 "log.project=p")
    files = sorted((tmp_path / "tracker" / "p").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(files[0].parent), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars(COLUMN)
    assert [e.step for e in events] == [2, 3] == [r["step"] for r in rows if COLUMN in r]
    assert all(math.isclose(e.value, r[COLUMN], rel_tol=1e-6) for e, r in zip(events, [rows[1], rows[2]]))
