"""Aspect-ratio buckets: the bucket list, assignment, resize-to-cover and crop, SDXL's size
conditioning, the planned (largest) bucket, and sizes in the cache fingerprint.

Images of several aspect ratios are drawn with PIL into tmp_path.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image

from runner.config import DataConfig
from runner.data import FolderDataset, build_dataset, planned_size
from runner.data.buckets import BucketSpec, cover_geometry
from runner.errors import UserError

# (width, height) of the test images: portrait, landscape, square, very wide, very tall
SIZES = [(60, 90), (90, 60), (70, 70), (160, 40), (40, 160), (64, 96)]


def make_folder(folder: Path, sizes=SIZES) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, (w, h) in enumerate(sizes):
        img = Image.new("RGB", (w, h), (30, 30, 30))
        img.paste((200, 40, 40), (0, 0, w // 2, h))  # left half red: shows which side was cropped
        img.save(folder / f"{i:02d}.png")
        (folder / f"{i:02d}.txt").write_text(f"image {i}")
    return folder


def test_bucket_list_follows_kohyas_rules():
    spec = BucketSpec(1024, 64)
    assert (1024, 1024) in spec.sizes and spec.largest() == (1024, 1024)
    for h, w in spec.sizes:
        assert h % 64 == 0 and w % 64 == 0
        assert 512 <= h <= 2048 and 512 <= w <= 2048
        assert h * w <= 1024 * 1024
        assert (w, h) in spec.sizes  # every bucket has its transpose
    assert (1216, 832) in spec.sizes and (832, 1216) in spec.sizes  # the usual SDXL portrait/landscape
    small = BucketSpec(64, 16)
    assert small.low == 32 and small.high == 128
    assert set(small.sizes) == {(64, 64), (128, 32), (80, 48), (48, 80), (32, 128), (32, 96), (96, 32),
                                (32, 112), (112, 32)}
    assert BucketSpec(64, 16, min_side=48, max_side=80).sizes == ((80, 48), (64, 64), (48, 80))


def test_each_image_goes_to_the_bucket_nearest_its_aspect_ratio():
    spec = BucketSpec(64, 16)
    for w, h in [(60, 90), (90, 60), (70, 70), (160, 40), (40, 160), (1000, 999), (3, 1)]:
        bh, bw = spec.assign(w, h)
        best = min(abs(math.log(sw / sh) - math.log(w / h)) for sh, sw in spec.sizes)
        assert abs(math.log(bw / bh) - math.log(w / h)) == best
    assert spec.assign(60, 90) == (80, 48) and spec.assign(160, 40) == (32, 128) and spec.assign(70, 70) == (64, 64)


def test_cover_geometry_reaches_both_sides_and_crops_one():
    for w, h in SIZES:
        for target in BucketSpec(64, 16).sizes:
            rw, rh = cover_geometry(w, h, target)
            assert rw >= target[1] and rh >= target[0]
            assert rw == target[1] or rh == target[0]


def test_folder_samples_have_their_bucket_shape_and_sdxl_size_conditioning(tmp_path):
    ds = FolderDataset(make_folder(tmp_path), 64, buckets=BucketSpec(64, 16))
    for i, (w, h) in enumerate(SIZES):
        s = ds[i]
        bh, bw = ds.group_of(i)
        assert s["pixel_values"].shape == (3, bh, bw)
        assert s["original_size"].tolist() == [h, w]
        rw, rh = cover_geometry(w, h, (bh, bw))
        assert s["crop_top_left"].tolist() == [(rh - bh) // 2, (rw - bw) // 2]  # center crop
        light = ds.light(i)
        assert "pixel_values" not in light and torch.equal(light["crop_top_left"], s["crop_top_left"])
    # the 160x40 image: resized to 128x32 exactly (no crop), left half red
    s = ds[3]
    assert ds.group_of(3) == (32, 128) and s["crop_top_left"].tolist() == [0, 0]
    assert s["pixel_values"][0, 16, 10] > 0.5 and s["pixel_values"][0, 16, 120] < -0.5
    text = ds.describe()
    assert "bucketed around 64x64" in text and "buckets used" in text


def test_random_crop_is_per_index_and_inside_the_image(tmp_path):
    ds = FolderDataset(make_folder(tmp_path, [(200, 60)] * 6), 64, buckets=BucketSpec(64, 16), center_crop=False)
    offsets = [tuple(ds[i]["crop_top_left"].tolist()) for i in range(6)]
    assert offsets == [tuple(ds[i]["crop_top_left"].tolist()) for i in range(6)]  # deterministic
    assert len(set(offsets)) > 1
    for i, (top, left) in enumerate(offsets):
        rw, rh = cover_geometry(200, 60, ds.group_of(i))
        assert 0 <= left <= rw - ds.group_of(i)[1] and 0 <= top <= rh - ds.group_of(i)[0]


def test_exif_rotation_swaps_the_sides(tmp_path):
    img = Image.new("RGB", (90, 60), (10, 200, 10))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: shown as 60 wide, 90 tall
    img.save(tmp_path / "phone.jpg", exif=exif)
    (tmp_path / "phone.txt").write_text("a phone photo")
    ds = FolderDataset(tmp_path, 64, buckets=BucketSpec(64, 16))
    assert ds.original_sizes == [(60, 90)] and ds.group_of(0) == (80, 48)
    assert ds[0]["pixel_values"].shape == (3, 80, 48)


def test_cache_fingerprint_carries_the_bucket_only_with_buckets(tmp_path):
    folder = make_folder(tmp_path)
    plain = FolderDataset(folder, 64)
    bucketed = FolderDataset(folder, 64, buckets=BucketSpec(64, 16))
    assert "size" not in plain.fingerprint(0)  # keys of existing caches unchanged
    assert bucketed.fingerprint(0)["size"] == [80, 48]
    assert {k: v for k, v in bucketed.fingerprint(0).items() if k != "size"} == plain.fingerprint(0)


def test_planned_size_is_the_largest_bucket(tmp_path):
    cfg = DataConfig(resolution=1024, path=str(make_folder(tmp_path)), buckets=True)
    assert planned_size(cfg) == ((1024, 1024), "the largest of 33 aspect-ratio buckets (data.buckets)")
    (h, w), why = planned_size(replace(cfg, resolution=1000))
    assert h * w == max(a * b for a, b in BucketSpec(1000).sizes) and "buckets" in why
    assert planned_size(replace(cfg, buckets=False)) == ((1024, 1024), "")
    assert planned_size(replace(cfg, path=None)) == ((1024, 1024), "")  # the demo set stays square


@pytest.mark.parametrize("change, words", [
    ({"bucket_step": 12}, ["data.bucket_step=12", "multiple of 8"]),
    ({"bucket_min_side": 8}, ["data.bucket_min_side=8"]),
    ({"bucket_min_side": 96, "bucket_max_side": 80}, ["swap them"]),
    ({"bucket_min_side": 80}, ["outside data.bucket_min_side=80"]),
])
def test_bad_bucket_settings(tmp_path, change, words):
    cfg = replace(DataConfig(resolution=64, path=str(make_folder(tmp_path)), buckets=True), **change)
    with pytest.raises(UserError) as e:
        build_dataset(cfg)
    for w in words:
        assert w in str(e.value)


def test_plan_plans_the_largest_bucket_and_says_so(tmp_path):
    from runner.cli.compose import compose_config
    from runner.plan import plan_step

    folder = make_folder(tmp_path / "data", [(96, 64), (64, 96)])
    cfg = compose_config(["train.device=cpu", f"data.path={folder}", "data.resolution=64", "data.buckets=true",
                          "data.bucket_step=16", "data.bucket_min_side=48", "data.bucket_max_side=96"])
    plan = plan_step(cfg)
    spec = BucketSpec(64, 16, 48, 96)
    assert plan.run["planned_size"] == list(spec.largest()) == [64, 64]
    assert "(the largest of 3 aspect-ratio buckets (data.buckets))" in plan.format_table()
    # At 72 px (5184 px of area) with 16 px steps between 48 and 96, 64x80 (5120 px) beats the 64x64 square.
    wide = compose_config(["train.device=cpu", f"data.path={folder}", "data.resolution=72", "data.buckets=true",
                           "data.bucket_step=16", "data.bucket_min_side=48", "data.bucket_max_side=96"])
    plan2 = plan_step(wide)
    h, w = plan2.run["planned_size"]
    assert (h, w) == BucketSpec(72, 16, 48, 96).largest() and h * w == 5120 and {h, w} == {64, 80}
    assert f"{w}x{h} px (the largest of" in plan2.format_table()
    square = plan_step(compose_config(["train.device=cpu", "data.resolution=64"]))
    assert square.peak_bytes == plan.peak_bytes  # the same size planned: the same bytes
    assert plan2.peak_bytes > plan.peak_bytes  # more pixels, more activations
    json.dumps(plan.to_dict(), default=str)
