"""data.random_flip: a coin per visit from the sample's seed (runner/data/flip.py).

What is claimed and checked: an image is seen in both orientations over a run; the coin depends
on the visit's seed only (so any split of a step into micro-batches flips the same samples, and
a resumed run flips as the run it continues would have); the flip is an exact mirror; a disabled
flip leaves the batch untouched. End to end: a resumed run with flips gives the losses of the
run never stopped, and flips change the losses (they are applied). The cached == uncached check
with flips is in tests/plugins/park/test_park.py, the OOM split in tests/runner/guards/test_oom.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from runner.cli.compose import compose_config
from runner.data import DemoDataset, collate
from runner.data.flip import NO_FLIP, VisitFlip, flip_rows, flips_on_visit, visit_flip
from runner.data.order import SampleOrder
from runner.output.report import read_metrics

ASSETS = Path(__file__).resolve().parents[2] / "assets"


def test_the_coin_is_fair_and_a_function_of_the_seed():
    seeds = range(10_000)
    heads = sum(flips_on_visit(s) for s in seeds)
    assert 4_700 < heads < 5_300, heads  # splitmix64's low bit: ~half
    assert [flips_on_visit(s) for s in seeds] == [flips_on_visit(s) for s in seeds]


def test_every_image_is_seen_in_both_orientations_over_a_run():
    n, seed = 8, 0
    order = SampleOrder(n, seed)
    flip = VisitFlip(True)
    seen: dict[int, set[bool]] = {i: set() for i in range(n)}
    for start in range(0, 20 * n, 4):  # 20 epochs in steps of 4 samples
        mask = flip.mask(order.sample_seeds(start, 4))
        for i, f in zip(order.indices(start, 4), mask.tolist()):
            seen[i].add(f)
    assert all(v == {True, False} for v in seen.values()), seen  # a fixed coin per image gives one each


def test_the_mask_of_a_step_is_the_masks_of_its_micro_batches_and_of_a_resumed_run():
    order, flip = SampleOrder(16, 3), VisitFlip(True)
    whole = flip.mask(order.sample_seeds(40, 8))
    parts = torch.cat([flip.mask(order.sample_seeds(40 + k, 2)) for k in range(0, 8, 2)])
    assert torch.equal(whole, parts)
    # A second SampleOrder (a new process resuming at position 40) gives the same seeds, hence flips.
    assert torch.equal(whole, VisitFlip(True).mask(SampleOrder(16, 3).sample_seeds(40, 8)))
    assert whole.any() and not whole.all()


def test_apply_mirrors_exactly_the_flipped_rows_and_records_them():
    ds = DemoDataset(6, 16)
    order = SampleOrder(6, 0)
    raw = collate([ds[i] for i in order.indices(0, 6)])
    raw["sample_seed"] = order.sample_seeds(0, 6)
    plain = raw["pixel_values"].clone()
    out = VisitFlip(True).apply(dict(raw))
    mask = out["flip"]
    assert mask.dtype == torch.bool and mask.any() and not mask.all()
    for row, f in enumerate(mask.tolist()):
        expected = torch.flip(plain[row], dims=[-1]) if f else plain[row]
        assert torch.equal(out["pixel_values"][row], expected)
    assert torch.equal(raw["pixel_values"], plain)  # the input batch's tensor is not changed in place
    assert torch.equal(flip_rows(plain, torch.zeros(6, dtype=torch.bool)), plain)


def test_disabled_is_a_no_op_and_the_datasets_do_not_flip():
    raw = {"pixel_values": torch.randn(2, 3, 4, 4), "sample_seed": torch.tensor([1, 2])}
    assert NO_FLIP.apply(raw) is raw and "flip" not in raw
    cfg = compose_config(["data.random_flip=true"])
    assert visit_flip(cfg.data) == VisitFlip(True) and visit_flip(compose_config([]).data) is NO_FLIP
    # The datasets give the same pixels with and without the setting: the runner flips per visit.
    from runner.data import build_dataset

    assert torch.equal(build_dataset(cfg.data)[3]["pixel_values"], build_dataset(compose_config([]).data)[3]["pixel_values"])


@pytest.fixture
def pixel_trainer_path():
    sys.path.insert(0, str(ASSETS))
    yield
    sys.path.remove(str(ASSETS))


def _losses(out: Path, *overrides: str) -> list[float]:
    from runner.__main__ import task

    base = ["trainer=custom", "trainer._target_=custom_trainer.PixelDiffusionTrainer", "data.resolution=16",
            "train.batch_size=4", "train.steps=4", "train.progress=false", "train.preflight=false",
            "train.save_every=1", "train.keep_saved=5", "data.demo_size=6"]
    task(compose_config([*base, f"output_dir={out}", *overrides]))
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


@pytest.mark.usefixtures("one_thread", "pixel_trainer_path")
def test_resume_with_random_flip_gives_the_losses_of_an_unbroken_run(tmp_path):
    full = _losses(tmp_path / "full", "data.random_flip=true")
    plain = _losses(tmp_path / "plain")
    assert full != plain  # the flips are applied
    first = _losses(tmp_path / "first", "data.random_flip=true", "train.steps=2")
    resumed = _losses(tmp_path / "resumed", "data.random_flip=true",
                      f"train.resume={tmp_path / 'first' / 'checkpoints' / 'step-00000002'}")
    assert first + resumed == full
