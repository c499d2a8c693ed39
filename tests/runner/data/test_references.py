"""``data.references`` (runner/data/references.py): paired edit data, a target plus its reference images.

Real image files in a temporary folder: the two layouts (``control/`` wins over ``*_ref1``), references
cropped, bucketed and flipped with their target, their bytes in the cache fingerprint, the paired demo
set, and every bad input refused before training naming the file.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runner.data import FolderDataset, build_dataset, collate
from runner.data.buckets import BucketSpec
from runner.data.demo import REFERENCE_GREYS, demo_mask, demo_reference
from runner.data.flip import VisitFlip, flips_on_visit
from runner.data.references import find_reference
from runner.errors import UserError


def gradient(w: int, h: int, flip: bool = False) -> Image.Image:
    """A left-to-right ramp (red) with a top-to-bottom one (green): any crop offset or mirror shows."""
    x = np.linspace(0, 255, w)[None, :].repeat(h, 0)
    y = np.linspace(0, 255, h)[:, None].repeat(w, 1)
    arr = np.stack([x[:, ::-1] if flip else x, y, np.full((h, w), 40.0)], -1).astype(np.uint8)
    return Image.fromarray(arr, "RGB")


def write(root: Path, name: str, size=(96, 64), ref: str | None = "folder", ref_size=None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    img = root / f"{name}.png"
    gradient(*size).save(img)
    (root / f"{name}.txt").write_text(f"edit {name}")
    w, h = ref_size or size
    if ref == "folder":
        (root / "control").mkdir(exist_ok=True)
        gradient(w, h).save(root / "control" / f"{name}.png")
    elif ref == "suffix":
        gradient(w, h).save(root / f"{name}_ref1.png")
    return img


def test_the_control_folder_wins_over_the_suffix_and_references_are_not_samples(tmp_path):
    write(tmp_path, "a", ref="folder")
    write(tmp_path, "b", ref="suffix")
    gradient(96, 64).save(tmp_path / "a_ref1.png")  # both layouts for a: the folder's is read
    ds = FolderDataset(tmp_path, 64, references=1)
    assert [p.name for p in ds.paths] == ["a.png", "b.png"]
    assert [r[0].relative_to(tmp_path).as_posix() for r in ds.references] == ["control/a.png", "b_ref1.png"]
    assert find_reference(tmp_path / "a.png", 2) is None
    sample = ds[0]
    assert sample["references"].shape == (1, 3, 64, 64) and sample["caption"] == "edit a"
    assert "references: 1 per target, 1 from control folders, 1 from *_ref files" in ds.describe()
    # without data.references the same folder reads every image as a sample: control/a.png has no caption
    with pytest.raises(UserError, match=r"control/a.png.*looks like a reference image.*set data.references=1"):
        FolderDataset(tmp_path, 64)


@pytest.mark.parametrize("settings", [{"center_crop": True}, {"center_crop": False},
                                      {"buckets": BucketSpec(64, 16, 32, 128)}], ids=["center", "random", "bucket"])
def test_a_reference_gets_its_targets_crop_at_the_targets_size(tmp_path, settings):
    """The reference is saved at half the target's size (same ratio): resized to the target's size, then
    the target's crop, it shows the same pixels (the same gradient) up to resampling."""
    write(tmp_path, "a", size=(192, 128), ref="folder", ref_size=(96, 64))
    sample = FolderDataset(tmp_path, 64, references=1, **settings)[0]
    ref = sample["references"][0]
    assert ref.shape == sample["pixel_values"].shape
    assert (ref - sample["pixel_values"]).abs().mean() < 0.02


def test_a_flip_mirrors_the_references_with_the_target(tmp_path):
    write(tmp_path, "a", ref="folder")
    ds = FolderDataset(tmp_path, 64, references=1)
    seeds = [s for s in range(40) if flips_on_visit(s)][:1] + [s for s in range(40) if not flips_on_visit(s)][:1]
    batch = collate([ds[0], ds[0]])
    batch["sample_seed"] = torch.tensor(seeds)
    plain = batch["references"].clone()
    out = VisitFlip(True).apply(batch)
    assert out["flip"].tolist() == [True, False]
    assert torch.equal(out["references"][0], plain[0].flip(-1)) and torch.equal(out["references"][1], plain[1])
    assert torch.equal(out["pixel_values"][0], collate([ds[0]])["pixel_values"][0].flip(-1))


def test_the_reference_files_are_in_the_fingerprint(tmp_path):
    write(tmp_path, "a", ref="folder")
    before = FolderDataset(tmp_path, 64, references=1).fingerprint(0)
    gradient(96, 64, flip=True).save(tmp_path / "control" / "a.png")
    after = FolderDataset(tmp_path, 64, references=1).fingerprint(0)
    assert before["file_sha256"] == after["file_sha256"]
    assert before["references_sha256"] != after["references_sha256"]


@pytest.mark.parametrize("fault, said", [
    ("missing", r"reference 1 of '.*b.png'.*looked for '.*control/b.png' or '.*b_ref1.png'"),
    ("unreadable", r"cannot read image '.*control/a.png'"),
    ("ratio", r"reference '.*control/a.png' is 64x64 but its target is 96x64: the aspect ratios differ"),
    ("too-many", r"'.*a_ref2.png' is reference 2 of '.*a.png', but data.references=1"),
    ("too-many-folder", r"'.*control2/a.png' is reference 2"),
    ("orphan-folder", r"reference '.*control/c.png' has no target image: looked for '.*/c.png'"),
    ("orphan-suffix", r"reference '.*c_ref1.png' has no target image"),
])
def test_bad_references_are_refused_naming_the_file(tmp_path, fault, said):
    write(tmp_path, "a", ref="folder", ref_size=(64, 64) if fault == "ratio" else None)
    write(tmp_path, "b", ref=None if fault == "missing" else "suffix")
    if fault == "unreadable":
        (tmp_path / "control" / "a.png").write_bytes(b"not a png")
    if fault == "too-many":
        gradient(96, 64).save(tmp_path / "a_ref2.png")
    if fault == "too-many-folder":
        (tmp_path / "control2").mkdir()
        gradient(96, 64).save(tmp_path / "control2" / "a.png")
    if fault.startswith("orphan"):  # the pair's caption and reference are there, its target image is not
        write(tmp_path, "c", ref="folder" if fault == "orphan-folder" else "suffix")
        (tmp_path / "c.png").unlink()
    with pytest.raises(UserError, match=said):
        build_dataset({"path": str(tmp_path), "resolution": 64, "references": 1})


def test_two_references_per_target(tmp_path):
    write(tmp_path, "a", ref="folder")
    gradient(96, 64, flip=True).save(tmp_path / "a_ref2.png")
    sample = FolderDataset(tmp_path, 64, references=2)[0]
    assert sample["references"].shape == (2, 3, 64, 64)
    assert not torch.equal(sample["references"][0], sample["references"][1])  # each its own file, in order


def test_the_paired_demo_set_has_a_grey_reference_and_an_instruction():
    ds = build_dataset({"resolution": 32, "demo_size": 4, "references": 1})
    plain = build_dataset({"resolution": 32, "demo_size": 4})
    s = ds[1]
    assert s["references"].shape == (1, 3, 32, 32) and s["caption"].startswith("make the ")
    assert torch.equal(s["pixel_values"], plain[1]["pixel_values"])  # the targets are the demo images
    ref = s["references"][0]
    assert torch.equal(ref, demo_reference(1, 32, 0))
    grey = REFERENCE_GREYS[0] / 127.5 - 1
    shape = demo_mask(1, 32)[0] == 1  # inside the shape (not its anti-aliased edge): grey in the reference
    assert shape.any() and abs(float(ref[:, shape].mean()) - grey) < 0.03  # (Lanczos rings a little)
    background = demo_mask(1, 32)[0] == 0
    assert (ref[:, background] - s["pixel_values"][:, background]).abs().mean() < 0.03  # the same background
    assert ds.caption(1) == s["caption"] != plain.caption(1)


def test_a_video_trainer_refuses_references():
    from runner.data import build_video_dataset

    with pytest.raises(UserError, match=r"data.references applies to image edit trainers"):
        build_video_dataset({"references": 1, "resolution": 64}, 9, 16.0)


@pytest.mark.parametrize("trainer", ["flux_kontext", "qwen_image_edit"])
def test_an_unset_count_checks_the_folder_with_the_edit_trainers_own(tmp_path, trainer):
    """The edit presets leave data.references unset (the trainer's own: 1). Validation reads the folder with
    that count, so control/ images are references (not captionless samples, which refused the run), and
    the data set it hands over is the one the trainer would read, references included."""
    from runner.parts import build_trainer
    from runner.cli.compose import compose_config
    from runner.checks import validate

    for name in ("a", "b"):
        write(tmp_path, name, size=(64, 64))
    cfg = compose_config([f"trainer={trainer}", f"data.path={tmp_path}"])
    validate(cfg)
    ds = build_trainer(cfg).dataset()
    assert len(ds) == 2 and ds[0]["references"].shape == (1, 3, 64, 64)
    plain = compose_config(["trainer=flux", f"data.path={tmp_path}"])  # not an edit family: read as images
    with pytest.raises(UserError, match=r"control/a.png.*looks like a reference image"):
        validate(plain)
