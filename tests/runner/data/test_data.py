"""runner.data: demo set, folder datasets, image modes, crops, errors, collate (flips: test_flip.py).

All images are generated with PIL into tmp_path, so no test data is shipped.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from runner.config import DataConfig
from runner.data import (
    DemoDataset,
    FolderDataset,
    build_dataset,
    collate,
    describe_dataset,
)
from runner.data.demo import demo_caption
from runner.data.images import IMAGE_EXTENSIONS
from runner.errors import UserError

R = 32


def cfg(**kw) -> DataConfig:
    base = DataConfig(resolution=R)
    return replace(base, **kw)


def write(path: Path, img: Image.Image, caption: str | None = "a caption") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def solid(colour=(200, 30, 30), size=(40, 40), mode="RGB") -> Image.Image:
    return Image.new("RGB", size, colour).convert(mode)


def check_pixels(t: torch.Tensor, r: int = R) -> None:
    assert t.shape == (3, r, r)
    assert t.dtype == torch.float32
    assert t.min() >= -1.0 and t.max() <= 1.0


# ---------------------------------------------------------------------------------- demo set


def test_demo_shape_range_determinism_and_captions():
    ds = build_dataset(cfg(demo_size=16))
    assert isinstance(ds, DemoDataset) and len(ds) == 16
    samples = [ds[i] for i in range(len(ds))]
    for i, s in enumerate(samples):
        check_pixels(s["pixel_values"])
        assert s["index"] == i
        assert s["caption"].endswith("background") and s["caption"] == demo_caption(i)
        # a shape on a background: clearly two colours, not a flat image
        assert s["pixel_values"].std() > 0.1
    captions = [s["caption"] for s in samples]
    assert len(set(captions)) == len(captions)

    again = build_dataset(cfg(demo_size=16))
    for i in range(16):
        assert torch.equal(again[i]["pixel_values"], samples[i]["pixel_values"])
    # the cache hands out copies: editing a sample does not change the next one
    samples[0]["pixel_values"].zero_()
    assert not torch.equal(ds[0]["pixel_values"], samples[0]["pixel_values"])


def test_demo_caption_matches_colours():
    ds = DemoDataset(4, 64)
    s = ds[0]  # "a red circle on a green background"
    assert s["caption"] == "a red circle on a green background"
    px = s["pixel_values"]
    centre, corner = px[:, 32, 32], px[:, 1, 1]
    assert centre[0] > 0.5 and centre[1] < -0.3  # red-ish centre (the circle covers it)
    assert corner[1] > corner[0]  # green-ish corner


def test_dictconfig_accepted():
    ds = build_dataset(OmegaConf.structured(DataConfig(resolution=16, demo_size=3)))
    assert len(ds) == 3 and ds[2]["pixel_values"].shape == (3, 16, 16)


# ------------------------------------------------------------------------------ folder layout


def test_nested_folder_sorted_and_captions(tmp_path):
    write(tmp_path / "b.JPG", solid(), "  second \n")
    write(tmp_path / "10_cats" / "a.png", solid(), "first")
    write(tmp_path / "10_cats" / "deeper" / "c.webp", solid(), "third")
    write(tmp_path / "z.bmp", solid(), "fourth")
    write(tmp_path / ".hidden" / "x.png", solid(), "skipped")
    write(tmp_path / "._y.png", solid(), "skipped")
    (tmp_path / "notes.md").write_text("not an image")

    ds = build_dataset(cfg(path=str(tmp_path)))
    assert isinstance(ds, FolderDataset)
    rel = [p.relative_to(tmp_path).as_posix() for p in ds.paths]
    assert rel == ["10_cats/a.png", "10_cats/deeper/c.webp", "b.JPG", "z.bmp"]
    assert [ds[i]["caption"] for i in range(4)] == ["first", "third", "second", "fourth"]
    for i in range(4):
        check_pixels(ds[i]["pixel_values"])
        assert ds[i]["index"] == i
    assert "4 images used, at 32x32" in describe_dataset(ds) and str(tmp_path) in describe_dataset(ds)
    assert "skipped: 3 hidden files or folders, 1 files that are not" in describe_dataset(ds)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: Image.new("RGBA", (50, 50), (255, 0, 0, 128)), id="RGBA"),
        pytest.param(lambda: solid(mode="L"), id="L"),
        pytest.param(lambda: solid(mode="1"), id="1"),
        pytest.param(lambda: solid(mode="P"), id="P"),
        pytest.param(lambda: Image.new("I;16", (40, 40), 40000), id="I16"),
        pytest.param(lambda: solid(size=(100, 40)), id="wide"),
        pytest.param(lambda: solid(size=(20, 90)), id="tall-and-small"),
    ],
)
def test_modes_and_shapes_come_out_rgb(tmp_path, make):
    write(tmp_path / "img.png", make())
    s = build_dataset(cfg(path=str(tmp_path)))[0]
    check_pixels(s["pixel_values"])


def test_cmyk_jpeg(tmp_path):
    write(tmp_path / "img.jpg", solid(mode="CMYK", size=(48, 64)))
    check_pixels(build_dataset(cfg(path=str(tmp_path)))[0]["pixel_values"])


def test_alpha_composited_over_white(tmp_path):
    write(tmp_path / "clear.png", Image.new("RGBA", (40, 40), (0, 0, 0, 0)))
    px = build_dataset(cfg(path=str(tmp_path)))[0]["pixel_values"]
    assert torch.allclose(px, torch.ones_like(px))


def test_sixteen_bit_grey_is_scaled_not_clipped(tmp_path):
    write(tmp_path / "grey.png", Image.new("I;16", (40, 40), 32768))
    px = build_dataset(cfg(path=str(tmp_path)))[0]["pixel_values"]
    assert px.abs().max() < 0.05  # mid grey, not white


def test_exif_orientation_applied(tmp_path):
    img = Image.new("RGB", (64, 32), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 32, 32))  # left half red, right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    path = tmp_path / "photo.jpg"
    img.save(path, exif=exif, quality=95)
    path.with_suffix(".txt").write_text("p")
    px = build_dataset(cfg(path=str(tmp_path), resolution=16))[0]["pixel_values"]
    # displayed upright: 32 wide, 64 tall, red on top; the centre crop straddles the boundary
    assert px[0, 1, 8] > 0.5 and px[2, 1, 8] < -0.5
    assert px[2, 14, 8] > 0.5 and px[0, 14, 8] < -0.5


def test_center_crop_keeps_centre(tmp_path):
    # 96x64: red in columns 8..88, blue at the left and right borders. The short side goes
    # 64 -> 32 (width 48); the centre 32x32 crop is columns 8..40 of 48 = 16..80 of the original,
    # entirely red. A left-aligned crop would include the blue border.
    img = Image.new("RGB", (96, 64), (0, 0, 255))
    img.paste((255, 0, 0), (8, 0, 88, 64))
    write(tmp_path / "wide.png", img)
    tall = img.transpose(Image.Transpose.ROTATE_90)
    write(tmp_path / "tall.png", tall)
    ds = build_dataset(cfg(path=str(tmp_path)))
    for i in range(2):
        px = ds[i]["pixel_values"]
        assert px[0].min() > 0.9 and px[2].max() < -0.9, ds.paths[i]


def test_random_crop_is_deterministic_and_in_bounds(tmp_path):
    # a left-to-right gradient, so every horizontal offset gives a different crop
    img = Image.linear_gradient("L").transpose(Image.Transpose.ROTATE_90).resize((96, 32)).convert("RGB")
    for k in range(6):
        write(tmp_path / f"{k}.png", img)
    a = build_dataset(cfg(path=str(tmp_path), center_crop=False))
    b = build_dataset(cfg(path=str(tmp_path), center_crop=False))
    crops = [a[i]["pixel_values"] for i in range(6)]
    for i in range(6):
        check_pixels(crops[i])
        assert torch.equal(crops[i], b[i]["pixel_values"])
    assert len({c.sum().item() for c in crops}) > 1  # offsets vary with the index


def test_missing_caption_empty(tmp_path, caplog):
    write(tmp_path / "a.png", solid(), "has one")
    write(tmp_path / "b.png", solid(), None)
    write(tmp_path / "c.png", solid(), None)
    with caplog.at_level(logging.WARNING, logger="runner"):
        ds = build_dataset(cfg(path=str(tmp_path), missing_caption="empty"))
    assert [ds[i]["caption"] for i in range(3)] == ["has one", "", ""]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 of 3" in warnings[0].getMessage()
    assert "2 with empty captions" in describe_dataset(ds)


def test_caption_bom_and_uppercase_txt(tmp_path):
    write(tmp_path / "a.png", solid(), None)
    (tmp_path / "a.TXT").write_bytes("\ufeffcafé  ".encode("utf-8"))
    assert build_dataset(cfg(path=str(tmp_path)))[0]["caption"] == "café"


# ------------------------------------------------------------------------------------ errors


def raises(match_all: list[str], **kw) -> str:
    with pytest.raises(UserError) as ei:
        ds = build_dataset(cfg(**kw))
        ds[0]
    msg = str(ei.value)
    for part in match_all:
        assert part in msg, (part, msg)
    assert "\n" not in msg
    return msg


def test_error_path_missing(tmp_path):
    missing = tmp_path / "nope"
    raises(["data.path", str(missing), "does not exist", ".png"], path=str(missing))


def test_error_path_is_file(tmp_path):
    f = write(tmp_path / "a.png", solid())
    raises(["data.path", str(f), "not a folder"], path=str(f))


def test_error_empty_path_string():
    raises(["data.path", "empty"], path="")


def test_error_no_images(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    msg = raises(["data.path", str(tmp_path), "no images"], path=str(tmp_path))
    for ext in IMAGE_EXTENSIONS:
        assert ext in msg


def test_error_missing_caption(tmp_path):
    write(tmp_path / "sub" / "ok.png", solid())
    img = write(tmp_path / "sub" / "cat.png", solid(), None)
    raises(
        ["data.path", str(img), str(img.with_suffix(".txt")), "data.missing_caption=empty", "1 of 2"],
        path=str(tmp_path),
    )


def test_error_corrupt_image_eager(tmp_path):
    write(tmp_path / "good.png", solid())
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"this is not a png at all")
    bad.with_suffix(".txt").write_text("x")
    with pytest.raises(UserError) as ei:
        build_dataset(cfg(path=str(tmp_path)))  # caught at construction, before any __getitem__
    assert str(bad) in str(ei.value) and "data.path" in str(ei.value)


def test_error_corrupt_image_lazy(tmp_path):
    good = write(tmp_path / "a.png", solid(size=(64, 64)))
    bad = tmp_path / "b.png"
    bad.write_bytes(good.read_bytes()[:60])  # truncated: header fine, pixels gone
    bad.with_suffix(".txt").write_text("x")
    ds = FolderDataset(tmp_path, R, verify_limit=0)  # large-folder mode: no eager check
    assert "not pre-checked" in describe_dataset(ds)
    check_pixels(ds[0]["pixel_values"])
    with pytest.raises(UserError) as ei:
        ds[1]
    assert str(bad) in str(ei.value) and "data.path" in str(ei.value)


def test_error_caption_not_utf8(tmp_path):
    write(tmp_path / "a.png", solid(), None)
    cap = tmp_path / "a.txt"
    cap.write_bytes(b"caf\xe9")  # latin-1
    raises(["data.path", str(cap), "UTF-8", "0xe9"], path=str(tmp_path))


def test_error_bad_missing_caption_value():
    raises(["data.missing_caption", "'skip'", "error", "empty"], missing_caption="skip")


@pytest.mark.parametrize("res", [0, -8, 100, 7])
def test_error_bad_resolution(res):
    msg = raises(["data.resolution", str(res), "multiple of 8"], resolution=res)
    if res == 100:
        assert "96 or 104" in msg


def test_error_bad_demo_size():
    raises(["data.demo_size", "0"], demo_size=0)


# ------------------------------------------------------------------------------------ collate


def test_collate():
    ds = DemoDataset(5, R)
    batch = collate([ds[i] for i in (0, 3, 4)])
    assert batch["pixel_values"].shape == (3, 3, R, R)
    assert batch["pixel_values"].dtype == torch.float32
    assert batch["index"].dtype == torch.int64 and batch["index"].tolist() == [0, 3, 4]
    assert batch["caption"] == [demo_caption(i) for i in (0, 3, 4)]
    with pytest.raises(ValueError):
        collate([])


def test_describe_demo_and_foreign():
    assert describe_dataset(DemoDataset(16, 64)).startswith("16 images at 64x64 from the built-in demo")
    assert describe_dataset([1, 2, 3]) == "3 samples from list"


def test_the_data_summary_names_what_was_used_skipped_and_upscaled(tmp_path, caplog):
    write(tmp_path / "big.png", solid(size=(64, 80)))
    write(tmp_path / "tiny.png", solid(size=(6, 30)))  # short side 6: blown up 5.3x to 32 px
    (tmp_path / ".DS_Store").write_bytes(b"junk")
    (tmp_path / "notes.json").write_text("{}")
    (tmp_path / "anim.gif").write_bytes(b"GIF89a")
    with caplog.at_level(logging.WARNING, logger="runner"):
        ds = FolderDataset(tmp_path, R)
    line = describe_dataset(ds)
    assert line.startswith(f"2 images used, at {R}x{R}")
    assert "skipped: 1 hidden files or folders, 2 files that are not" in line and ".gif, .json" in line
    assert "1 upscaled more than 4x, e.g. tiny.png 6x30" in line
    assert "tiny.png" in caplog.text and "blurry" in caplog.text
