"""Each step's global batch (runner/data/order.py) and several data sets (runner/data/sets.py).

The order is a pure function of (data layout, batch size, seed, step): checked against the old
one-stream order, within-bucket batches, resume mid-epoch, and the frequencies that repeats and
weights promise, counted on a seeded order.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from runner.config import DataConfig
from runner.data import BatchOrder, build_dataset
from runner.data.order import SEED_STRIDE, SampleOrder
from runner.data.sets import TrainingData
from runner.errors import UserError


class Sized(torch.utils.data.Dataset):
    """n samples, sample i of output size groups[i] (no pixels needed by the order)."""

    def __init__(self, groups):
        self.groups = list(groups)

    def __len__(self):
        return len(self.groups)

    def __getitem__(self, i):
        return {"index": i}

    def group_of(self, i):
        return self.groups[i]


def test_one_stream_is_the_old_order_bit_for_bit():
    old = SampleOrder(10, 3)
    new = BatchOrder(list(range(10)), 4, 3)
    assert new.one_stream and new.describe() == ""
    for step in range(8):  # crosses epoch boundaries mid-batch
        b = new.batch(step)
        assert b.indices == old.indices(step * 4, 4)
        assert torch.equal(b.seeds, old.sample_seeds(step * 4, 4))
    assert new.batch(2).seeds.tolist() == [3 * SEED_STRIDE + p for p in range(8, 12)]


def test_batches_come_from_one_size_and_cover_every_sample_each_epoch():
    groups = ["a"] * 7 + ["b"] * 4 + ["c"] * 1
    order = BatchOrder(Sized(groups), 4, seed=5)
    assert not order.one_stream
    per_epoch = order.batches_per_epoch
    assert per_epoch == 2 + 1 + 1  # ceil(7/4) + ceil(4/4) + ceil(1/4)
    assert order.topped_per_epoch == 1 + 0 + 3
    for epoch in range(3):
        seen = Counter()
        for step in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            b = order.batch(step)
            assert len(b.indices) == 4 and len({groups[i] for i in b.indices}) == 1
            seen.update(b.indices)
        assert set(seen) == set(range(12))  # every sample at least once per epoch
        assert sum(seen.values()) - 12 == order.topped_per_epoch
    # seeded: another order object gives the same batches; another seed does not
    again, other = BatchOrder(Sized(groups), 4, seed=5), BatchOrder(Sized(groups), 4, seed=6)
    assert all(again.batch(k).indices == order.batch(k).indices for k in range(10))
    assert any(other.batch(k).indices != order.batch(k).indices for k in range(10))
    assert "4 batches of 4 per epoch" in order.describe() and "4 visits per epoch repeat" in order.describe()


def test_resume_mid_epoch_continues_the_same_order():
    groups = ["a"] * 9 + ["b"] * 6
    full = BatchOrder(Sized(groups), 3, seed=1)
    expected = [full.batch(k) for k in range(12)]
    resumed = BatchOrder(Sized(groups), 3, seed=1)
    resumed.resume(step=5, samples_seen=15)  # a fresh process, mid-epoch (5 batches per epoch)
    for k in range(5, 12):
        got = resumed.batch(k)
        assert got.indices == expected[k].indices and torch.equal(got.seeds, expected[k].seeds)


def parts(*spec):
    """TrainingData over Sized sets: spec = (size, repeats, weight, group) per set."""
    return TrainingData([(Sized([g] * n), r, w, f"data.sets[{i}]") for i, (n, r, w, g) in enumerate(spec)])


def test_repeats_give_exact_frequencies_per_epoch():
    data = parts((4, 3, None, "s"), (8, 1, None, "s"))  # kohya: set 0's images 3x, set 1's once
    order = BatchOrder(data, 4, seed=2)
    assert order.one_stream and len(order.pool) == 4 * 3 + 8
    steps = len(order.pool) // 4 * 10  # ten epochs
    counts = Counter(i for k in range(steps) for i in order.batch(k).indices)
    assert all(counts[i] == 30 for i in range(4)) and all(counts[i] == 10 for i in range(4, 12))
    # the same with buckets (two sizes): batches within one size, the same exact frequencies
    bucketed = BatchOrder(parts((4, 3, None, "wide"), (8, 1, None, "tall")), 4, seed=2)
    assert not bucketed.one_stream and bucketed.topped_per_epoch == 0
    counts = Counter(i for k in range(bucketed.batches_per_epoch * 10) for i in bucketed.batch(k).indices)
    assert all(counts[i] == 30 for i in range(4)) and all(counts[i] == 10 for i in range(4, 12))


def test_weights_are_the_chance_a_batch_comes_from_a_set():
    data = parts((4, 1, 3.0, "s"), (16, 5, 1.0, "s"), (2, 1, 4.0, "t"))
    order = BatchOrder(data, 2, seed=7)
    assert order.weighted
    n = 3000
    by_set = Counter()
    per_image = Counter()
    for k in range(n):
        b = order.batch(k)
        sets = {data.locate(i)[0] for i in b.indices}
        assert len(sets) == 1  # one set per batch
        by_set[sets.pop()] += 1
        per_image.update(b.indices)
    for s, p in enumerate([3 / 8, 1 / 8, 4 / 8]):
        sd = (n * p * (1 - p)) ** 0.5
        assert abs(by_set[s] - n * p) < 5 * sd, (s, by_set[s], n * p)
    # within a set every image gets an equal share: each set cycles through its own shuffled pool
    set1 = [per_image[i] for i in range(4, 20)]
    assert max(set1) - min(set1) <= 2 * 5  # one cycle's worth (repeats 5) at most
    # random access equals sequential access (the counts are recomputed from stored points)
    fresh = BatchOrder(data, 2, seed=7)
    assert fresh.batch(2999).indices == order.batch(2999).indices
    assert fresh.batch(5).indices == order.batch(5).indices
    assert "drawn by weight (data.sets[0] 38%, data.sets[1] 12%, data.sets[2] 50%)" in order.describe()


def test_weights_on_some_sets_only_are_refused():
    with pytest.raises(UserError) as e:
        BatchOrder(parts((4, 1, 1.0, "s"), (4, 1, None, "s")), 2, seed=0)
    assert "data.sets[1]" in str(e.value)


# ---- data.sets from the config ------------------------------------------------------------------
def folder(path: Path, sizes, ext=".txt", word="x") -> Path:
    path.mkdir(parents=True)
    for i, (w, h) in enumerate(sizes):
        Image.new("RGB", (w, h), (i * 30, 90, 160)).save(path / f"{i}.png")
        (path / f"{i}{ext}").write_text(f"{word} {i}")
    return path


def test_sets_from_the_config(tmp_path):
    a = folder(tmp_path / "a", [(64, 64)] * 3, word="alpha")
    b = folder(tmp_path / "b", [(40, 40)] * 2, ext=".caption", word="beta")
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), {"resolution": 32, "sets": [
        {"path": str(a), "repeats": 2}, {"path": str(b), "caption_ext": ".caption", "resolution": 16}]})
    ds = build_dataset(cfg)
    assert isinstance(ds, TrainingData) and len(ds) == 5
    assert [ds[i]["caption"] for i in range(5)] == ["alpha 0", "alpha 1", "alpha 2", "beta 0", "beta 1"]
    assert ds[0]["pixel_values"].shape == (3, 32, 32) and ds[4]["pixel_values"].shape == (3, 16, 16)
    assert ds[4]["index"] == 4
    assert ds.fingerprint(4)["size"] == [16, 16] and "size" not in ds.fingerprint(0)  # only where it differs
    order = BatchOrder(ds, 2, seed=0)
    assert not order.one_stream  # two sizes: batches within one
    assert all(len({ds.group_of(i) for i in order.batch(k).indices}) == 1 for k in range(12))
    assert "2 sets, 5 images" in ds.describe() and "repeats 2" in ds.describe()
    from runner.data import planned_size

    assert planned_size(cfg) == ((32, 32), "the largest data.sets resolution (16, 32)")


@pytest.mark.parametrize("sets, words", [
    ([{"path": "{a}", "repaets": 2}], ["data.sets[0].repaets", "Did you mean 'repeats'"]),
    ([{"repeats": 2}], ["data.sets[0].path is missing"]),
    ([{"path": "{a}", "repeats": 0}], ["data.sets[0].repeats=0"]),
    ([{"path": "{a}", "weight": 0}], ["data.sets[0].weight=0"]),
    ([{"path": "{a}", "weight": 1.0}, {"path": "{a}"}], ["not on data.sets[1]"]),
    ([{"path": "{a}", "caption_ext": "txt"}], ["data.sets[0].caption_ext='txt'", "Did you mean data.sets[0].caption_ext=.txt"]),
    ([{"path": "{a}", "resolution": 30}], ["data.sets[0].resolution=30"]),
    ([{"path": "/no/such/folder"}], ["data.sets[0].path='/no/such/folder' does not exist"]),
])
def test_bad_sets_name_the_entry(tmp_path, sets, words):
    a = folder(tmp_path / "a", [(32, 32)])
    sets = [{k: (str(v).format(a=a) if k == "path" else v) for k, v in s.items()} for s in sets]
    with pytest.raises(UserError) as e:
        build_dataset({"resolution": 32, "sets": sets})
    for w in words:
        assert w in str(e.value), str(e.value)


def test_path_and_sets_together_are_refused(tmp_path):
    a = folder(tmp_path / "a", [(32, 32)])
    with pytest.raises(UserError) as e:
        build_dataset({"resolution": 32, "path": str(a), "sets": [{"path": str(a)}]})
    assert "data.path and data.sets are both set" in str(e.value)
