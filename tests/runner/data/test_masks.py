"""data.masks: where a mask is found, what is refused before step 1, and that crops and flips move
the mask with its image (runner/data/masks.py, runner/data/folder.py, runner/data/flip.py).

Alignment is checked with images that *are* their masks (white where the mask is white, black
elsewhere) and an asymmetric L-shaped pattern, so any mismatch of crop offset, resize or flip
between the two shows up as differing pixels.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runner.data import DemoDataset, FolderDataset, build_dataset, collate
from runner.data.buckets import BucketSpec
from runner.data.demo import demo_image, demo_mask
from runner.data.flip import VisitFlip, flips_on_visit
from runner.data.masks import find_mask
from runner.errors import UserError


def l_shape(w: int, h: int) -> Image.Image:
    """A white L in the top-left corner on black: neither left-right nor up-down symmetric."""
    arr = np.zeros((h, w), dtype=np.uint8)
    arr[: h * 2 // 3, : w // 4] = 255  # the tall bar, left
    arr[: h // 4, : w * 3 // 4] = 255  # the top bar
    return Image.fromarray(arr, "L")


def write(root: Path, name: str, size=(96, 64), mask="folder", mask_img: Image.Image | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    m = mask_img if mask_img is not None else l_shape(*size)
    m.convert("RGB").save(root / f"{name}.png")  # the image is its own mask, as RGB
    (root / f"{name}.txt").write_text(f"a picture of {name}")
    if mask == "folder":
        (root / "masks").mkdir(exist_ok=True)
        m.save(root / "masks" / f"{name}.png")
    elif mask == "suffix":
        m.save(root / f"{name}_mask.png")
    return root / f"{name}.png"


def test_the_masks_folder_wins_over_the_suffix_and_masks_are_not_samples(tmp_path):
    img = write(tmp_path, "cat", mask="folder")
    l_shape(96, 64).save(tmp_path / "cat_mask.png")
    write(tmp_path, "dog", mask="suffix")
    assert find_mask(img) == tmp_path / "masks" / "cat.png"
    assert find_mask(tmp_path / "dog.png") == tmp_path / "dog_mask.png"
    ds = FolderDataset(tmp_path, 32, masks=True)
    assert [p.name for p in ds.paths] == ["cat.png", "dog.png"]  # neither masks/ nor *_mask are images
    assert ds.masks == [tmp_path / "masks" / "cat.png", tmp_path / "dog_mask.png"]
    assert "loss masks: 1 from masks/, 1 from *_mask files" in ds.describe()
    # Without data.masks nothing changes: the mask files are images like any other.
    (tmp_path / "cat_mask.txt").write_text("x")
    (tmp_path / "dog_mask.txt").write_text("x")
    (tmp_path / "masks" / "cat.txt").write_text("x")
    assert len(FolderDataset(tmp_path, 32)) == 5


@pytest.mark.parametrize("fault, said", [
    ("missing", "have no mask"),
    ("unreadable", "cannot read mask"),
    ("ratio", "aspect ratios differ"),
    ("black", "all black"),
])
def test_bad_masks_are_refused_naming_the_file(tmp_path, fault, said):
    write(tmp_path, "good")
    img = write(tmp_path, "bad", mask="none")
    mask = tmp_path / "masks" / "bad.png"
    if fault == "unreadable":
        mask.write_bytes(b"not a png at all")
    elif fault == "ratio":
        l_shape(64, 64).save(mask)
    elif fault == "black":
        Image.new("L", (96, 64), 0).save(mask)
    with pytest.raises(UserError) as e:
        build_dataset({"path": str(tmp_path), "resolution": 32, "masks": True})
    text = str(e.value)
    assert said in text and "data.masks" in text
    assert (str(img) if fault == "missing" else str(mask)) in text


def test_a_scaled_mask_of_the_same_ratio_is_accepted(tmp_path):
    write(tmp_path, "a", size=(96, 64), mask="none")
    (tmp_path / "masks").mkdir()
    l_shape(48, 32).save(tmp_path / "masks" / "a.png")
    sample = FolderDataset(tmp_path, 32, masks=True)[0]
    assert sample["mask"].shape == (1, 32, 32)


def test_a_non_bool_setting_is_refused():
    with pytest.raises(UserError, match="data.masks='yes' is not valid"):
        build_dataset({"masks": "yes"})


def brightness(sample: dict) -> torch.Tensor:
    return (sample["pixel_values"].mean(dim=0, keepdim=True) + 1) / 2  # [1, H, W] in 0..1


@pytest.mark.parametrize("settings", [
    {"center_crop": False},  # a per-index random crop of a 3:2 image
    {"buckets": BucketSpec(64, step=16)},  # resized to cover a bucket and cropped
])
def test_crops_move_the_mask_with_its_image(tmp_path, settings):
    for n, size in enumerate([(96, 64), (64, 112), (150, 100)]):
        write(tmp_path, f"img{n}", size=size)
    ds = FolderDataset(tmp_path, 64, masks=True, **settings)
    for i in range(len(ds)):
        s = ds[i]
        assert s["mask"].shape[1:] == s["pixel_values"].shape[1:]
        assert 0 < float(s["mask"].mean()) < 1  # the crop kept part of the L, not all of the image
        assert torch.allclose(s["mask"], brightness(s), atol=2 / 255)


def test_a_flip_mirrors_the_mask_with_the_pixels(tmp_path):
    write(tmp_path, "a", size=(96, 64))
    ds = FolderDataset(tmp_path, 32, masks=True, center_crop=False)
    seeds = [s for s in range(40) if flips_on_visit(s)][:1] + [s for s in range(40) if not flips_on_visit(s)][:1]
    batch = collate([ds[0], ds[0]])
    batch["sample_seed"] = torch.tensor(seeds)
    original = batch["mask"].clone()
    out = VisitFlip(True).apply(batch)
    assert out["flip"].tolist() == [True, False]
    assert torch.equal(out["mask"][0], torch.flip(original[0], dims=[-1])) and torch.equal(out["mask"][1], original[1])
    assert not torch.equal(out["mask"][0], original[0])  # the L is asymmetric: the flip is visible
    for row in range(2):
        assert torch.allclose(out["mask"][row], brightness({"pixel_values": out["pixel_values"][row]}), atol=2 / 255)


def test_the_mask_file_is_in_the_fingerprint(tmp_path):
    write(tmp_path, "a")
    before = FolderDataset(tmp_path, 32, masks=True).fingerprint(0)
    assert "mask_sha256" not in FolderDataset(tmp_path, 32, missing_caption="empty").fingerprint(0)
    arr = np.array(l_shape(96, 64))
    arr[-1, -1] = 255
    Image.fromarray(arr, "L").save(tmp_path / "masks" / "a.png")
    after = FolderDataset(tmp_path, 32, masks=True).fingerprint(0)
    assert after["mask_sha256"] != before["mask_sha256"] and after["file_sha256"] == before["file_sha256"]


def test_demo_masks_cover_each_shape():
    ds = DemoDataset(4, 32, masks=True)
    plain = DemoDataset(4, 32)
    for i in range(4):
        s = ds[i]
        assert torch.equal(s["pixel_values"], plain[i]["pixel_values"])  # the images are unchanged
        assert "mask" not in plain[i]
        m = s["mask"]
        assert m.shape == (1, 32, 32) and 0 < float(m.mean()) < 1 and float(m.min()) == 0 and float(m.max()) == 1
        # where the mask is 1, the image has the shape's colour, not the background's
        rgb = np.asarray(demo_image(i, 32), dtype=np.float32)
        on, off = rgb[m[0].numpy() == 1].mean(axis=0), rgb[m[0].numpy() == 0].mean(axis=0)
        assert np.abs(on - off).sum() > 100
    assert torch.equal(demo_mask(1, 32), ds[1]["mask"])


@pytest.mark.parametrize("key", ["masks", "demo_prior"])
def test_video_trainers_refuse_the_image_only_options(key):
    from runner.data import build_video_dataset

    with pytest.raises(UserError, match=f"data.{key}"):
        build_video_dataset({key: True if key == "masks" else 2}, 9, 16.0)
