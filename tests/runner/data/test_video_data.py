"""runner.data.video / clips / demo_video: clip folders, frame sampling, demo clips, fingerprints, errors.

Every clip is drawn by the test (the demo's moving shapes) into tmp_path: folders of frames, GIFs,
MP4 files (written with PyAV, in the test extra) and plain images, so no video is shipped.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from PIL import Image

from runner.data import build_video_dataset, check_dataset, collate
from runner.data.clips import have_video_decoder, natural_key
from runner.data.demo_video import DemoClips, demo_clip_caption, demo_frame, demo_motion
from runner.data.video import (
    ClipFolderDataset,
    ClipSettings,
    check_frame_counts,
    check_video_keys,
    windows,
)
from runner.errors import UserError

W, H = 48, 32


def settings(**kw) -> ClipSettings:
    base = dict(frames=5, fps=16.0, width=W, height=H)
    base.update(kw)
    return ClipSettings(**base)


def frames_folder(root: Path, name: str, n: int, caption: str | None = "a clip", index: int = 1) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for f in range(n):
        demo_frame(index, f, n, 80, 48).save(folder / f"frame{f}.png")  # frame2 sorts before frame10
    if caption is not None:
        (root / f"{name}.txt").write_text(caption)
    return folder


def gif(root: Path, name: str, n: int, ms: int, caption: str = "a gif") -> Path:
    frames = [demo_frame(2, f, n, 64, 64) for f in range(n)]
    path = root / f"{name}.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=ms, loop=0)
    (root / f"{name}.txt").write_text(caption)
    return path


def mp4(root: Path, name: str, n: int, fps: int, caption: str = "a video") -> Path:
    import av

    path = root / f"{name}.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = 96, 64, "yuv420p"
        for f in range(n):
            for p in s.encode(av.VideoFrame.from_image(demo_frame(3, f, n, 96, 64))):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    (root / f"{name}.txt").write_text(caption)
    return path


def data_cfg(path: Path | None, **kw) -> dict:
    return {"path": None if path is None else str(path), "resolution": 32, "width": W, "height": H, **kw}


# ---- the demo clips --------------------------------------------------------------------------------
def test_demo_clips_move_deterministically_and_say_where():
    ds = build_video_dataset(data_cfg(None, demo_size=8, frames=5), 9, 16)
    assert isinstance(ds, DemoClips) and len(ds) == 8
    a, b = ds[3], ds[3]
    assert a["pixel_values"].shape == (3, 5, H, W) and torch.equal(a["pixel_values"], b["pixel_values"])
    assert a["pixel_values"].min() >= -1 and a["pixel_values"].max() <= 1
    assert a["caption"] == demo_clip_caption(3) and f"moving {demo_motion(3)}" in a["caption"]
    px = a["pixel_values"]
    assert (px[:, 0] - px[:, -1]).abs().mean() > 0.01  # the shape moved between the first and last frame
    assert {demo_motion(i) for i in range(8)} == {"right", "left", "up", "down"}


def test_visit_flip_mirrors_every_frame_of_a_clip():
    """data.random_flip is the runner's, per visit (runner/data/flip.py): a clip batch's flipped rows
    are mirrored along the width, every frame alike; the data set itself never flips."""
    from runner.data.flip import VisitFlip, flips_on_visit

    ds = build_video_dataset(data_cfg(None, demo_size=4, frames=3, random_flip=True), 9, 16)
    plain = build_video_dataset(data_cfg(None, demo_size=4, frames=3), 9, 16)
    assert torch.equal(ds[1]["pixel_values"], plain[1]["pixel_values"])
    seeds = torch.arange(64, dtype=torch.int64)
    mirrored = next(int(s) for s in seeds if flips_on_visit(int(s)))
    kept = next(int(s) for s in seeds if not flips_on_visit(int(s)))
    batch = collate([ds[1], ds[2]])
    px = batch["pixel_values"].clone()
    batch["sample_seed"] = torch.tensor([mirrored, kept])
    out = VisitFlip(True).apply(batch)
    assert out["flip"].tolist() == [True, False]
    assert torch.equal(out["pixel_values"][0], torch.flip(px[0], dims=[-1]))  # [C, F, H, W]: width, every frame
    assert torch.equal(out["pixel_values"][1], px[1])


def test_trainer_defaults_fill_unset_keys():
    ds = build_video_dataset(data_cfg(None, demo_size=2), 9, 24.0)
    assert ds.settings.frames == 9 and ds.settings.fps == 24.0
    assert ds[0]["pixel_values"].shape == (3, 9, H, W)


# ---- clip folders ------------------------------------------------------------------------------------
def test_every_kind_of_clip_is_read_in_path_order(tmp_path):
    frames_folder(tmp_path, "a_frames", 12)
    gif(tmp_path, "b_gif", 10, 62)  # 62 ms a frame: ~16 fps
    Image.new("RGB", (40, 30), (10, 200, 10)).save(tmp_path / "c_image.png")
    (tmp_path / "c_image.txt").write_text("an image")
    ds = ClipFolderDataset(tmp_path, settings())
    assert [c.kind for c in ds.clips] == ["frames", "gif", "image"]
    assert [ds.caption(i) for i in range(len(ds))] == ["a clip", "a gif", "an image"]
    assert ds[0]["pixel_values"].shape == (3, 5, H, W) and ds[2]["pixel_values"].shape == (3, 1, H, W)
    assert ds.frame_counts == [1, 5]
    frames = [ds.clips[0].files[i].name for i in range(3)]
    assert frames == ["frame0.png", "frame1.png", "frame2.png"]  # numbers compare as numbers
    assert sorted(["f10", "f2", "f1"], key=natural_key) == ["f1", "f2", "f10"]
    assert "1 frames, 1 gif, 1 image" in ds.describe()


@pytest.mark.skipif(not have_video_decoder(), reason="PyAV (the video extra) is not installed")
def test_video_files_are_resampled_to_data_fps(tmp_path):
    mp4(tmp_path, "v", 40, 32)
    ds = ClipFolderDataset(tmp_path, settings(sampling="slide"))
    assert ds.clips[0].fps == 32 and ds.clips[0].length == 40
    # 32 fps read at 16: every second frame, windows back to back
    assert [w for _, w in ds.samples] == [[0, 2, 4, 6, 8], [9, 11, 13, 15, 17], [18, 20, 22, 24, 26],
                                          [27, 29, 31, 33, 35]]
    x = ds[1]["pixel_values"]
    assert x.shape == (3, 5, H, W) and x.std() > 0.1


def test_frame_sampling_modes(tmp_path):
    frames_folder(tmp_path, "c", 20)
    clip = ClipFolderDataset(tmp_path, settings()).clips[0]  # a folder is at data.fps: stride 1
    assert windows(clip, settings(sampling="start"), 0) == [[0, 1, 2, 3, 4]]
    assert windows(clip, settings(sampling="middle"), 0) == [[7, 8, 9, 10, 11]]
    assert windows(clip, settings(sampling="slide"), 0) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14],
                                                           [15, 16, 17, 18, 19]]
    starts = {windows(clip, settings(sampling="random"), i)[0][0] for i in range(40)}
    assert starts <= set(range(16)) and len(starts) > 5  # per-sample offsets, all in range
    assert windows(clip, settings(sampling="random"), 7) == windows(clip, settings(sampling="random"), 7)
    assert windows(clip, settings(frames=21), 0) == []  # too short


def test_short_clips_are_skipped_and_none_long_enough_is_an_error(tmp_path, caplog):
    frames_folder(tmp_path, "long", 9)
    frames_folder(tmp_path, "short", 3)
    with caplog.at_level(logging.WARNING, logger="runner"):
        ds = ClipFolderDataset(tmp_path, settings(frames=9))
    assert len(ds) == 1 and ds.too_short == 1 and "1 too short" in ds.describe()
    assert "shorter than one window" in caplog.text and "short" in caplog.text
    with pytest.raises(UserError, match=r"no clip is long enough for data.frames=17.*'long', has 9 frames"):
        ClipFolderDataset(tmp_path, settings(frames=17))


def test_center_and_per_index_crop(tmp_path):
    frames_folder(tmp_path, "c", 5)
    centre = ClipFolderDataset(tmp_path, settings())[0]["pixel_values"]
    crop = ClipFolderDataset(tmp_path, settings(center_crop=False))
    assert crop[0]["pixel_values"].shape == centre.shape
    assert torch.equal(crop[0]["pixel_values"], crop[0]["pixel_values"])  # the same crop every time


def test_missing_captions(tmp_path):
    frames_folder(tmp_path, "c", 5, caption=None)
    with pytest.raises(UserError, match=r"1 of 1 clips have no caption file.*c.txt"):
        ClipFolderDataset(tmp_path, settings())
    ds = ClipFolderDataset(tmp_path, settings(), missing_caption="empty")
    assert ds.caption(0) == "" and "1 with empty captions" in ds.describe()


def test_errors_name_the_folder_and_the_file(tmp_path):
    with pytest.raises(UserError, match="contains no clips or images"):
        ClipFolderDataset(tmp_path, settings())
    (tmp_path / "bad.gif").write_bytes(b"not a gif")
    (tmp_path / "bad.txt").write_text("x")
    with pytest.raises(UserError, match=r"cannot read clip .*bad.gif"):
        ClipFolderDataset(tmp_path, settings())


def test_video_files_without_a_decoder_are_one_clear_error(tmp_path, monkeypatch):
    (tmp_path / "v.mp4").write_bytes(b"\0" * 64)
    (tmp_path / "v.txt").write_text("x")
    import runner.data.clips as clips

    monkeypatch.setattr(clips, "have_video_decoder", lambda: False)
    with pytest.raises(UserError, match=r"no video decoder is installed.*diffusion-memory-runner\[video\]"):
        ClipFolderDataset(tmp_path, settings())


def test_fingerprints_follow_file_content_without_decoding(tmp_path, monkeypatch):
    folder = frames_folder(tmp_path, "c", 10)
    ds = ClipFolderDataset(tmp_path, settings(sampling="slide"))
    import runner.data.video as video

    monkeypatch.setattr(video, "decode_frames", lambda *a: pytest.fail("a fingerprint decoded frames"))
    first, second = ds.fingerprint(0), ds.fingerprint(1)
    assert first != second and first == ds.fingerprint(0)
    demo_frame(9, 0, 1, 80, 48).save(folder / "frame7.png")  # a frame of the second window changes
    assert ds.fingerprint(0) == first and ds.fingerprint(1) != second


def test_mixed_frame_counts_need_batch_size_1(tmp_path):
    frames_folder(tmp_path, "c", 5)
    Image.new("RGB", (40, 30)).save(tmp_path / "i.png")
    (tmp_path / "i.txt").write_text("an image")
    ds = ClipFolderDataset(tmp_path, settings())
    check_frame_counts(ds, 1)
    with pytest.raises(UserError, match=r"mixes samples of 1, 5 frames.*train.batch_size=1"):
        check_frame_counts(ds, 2)
    one = ClipFolderDataset(tmp_path, settings(frames=1))  # data.frames=1: every clip is one frame, batches stack
    assert one.frame_counts == [1] and collate([one[0], one[1]])["pixel_values"].shape == (2, 3, 1, H, W)


def test_validation_hands_the_checked_folder_to_the_trainer(tmp_path):
    frames_folder(tmp_path, "c", 5)
    cfg = data_cfg(tmp_path, frames=5)
    check_dataset(cfg, video=(9, 16.0))
    first = build_video_dataset(cfg, 9, 16.0)
    assert build_video_dataset(cfg, 9, 16.0) is not first  # handed over once


@pytest.mark.parametrize("key, value, match", [
    ("frames", 0, "data.frames=0 is not valid"),
    ("frames", 2.5, "data.frames=2.5 is not valid"),
    ("fps", -1, "data.fps=-1 is not valid"),
    ("frame_sampling", "strat", r"data.frame_sampling='strat'.*did you mean 'start'|start"),
    ("width", 100, "data.width=100 is not valid"),
    ("height", 0, "data.height=0 is not valid"),
])
def test_bad_video_keys(key, value, match):
    with pytest.raises(UserError, match=match):
        check_video_keys({key: value})


def test_caption_options_apply_to_clips_per_visit_and_image_only_options_are_refused():
    """data.caption_dropout / data.shuffle_tags reach video trainers as they reach image ones (per
    visit, from the visit's seed); buckets and several sets are image options and are refused."""
    plain = build_video_dataset(data_cfg(None, demo_size=4, frames=3), 9, 16)
    dropped = build_video_dataset(data_cfg(None, demo_size=4, frames=3, caption_dropout=1.0), 9, 16)
    assert dropped.visit(1, 7)["caption"] == "" and dropped.caption(1) == plain.caption(1)
    assert torch.equal(dropped.visit(1, 7)["pixel_values"], plain[1]["pixel_values"])
    shuffled = build_video_dataset(data_cfg(None, demo_size=4, frames=3, shuffle_tags=True), 9, 16)
    tags = lambda c: sorted(t.strip() for t in c.split(","))  # noqa: E731
    assert all(tags(shuffled.visit(2, s)["caption"]) == tags(plain.caption(2)) for s in range(5))
    with pytest.raises(UserError, match="data.buckets=true applies to image trainers"):
        build_video_dataset(data_cfg(None, demo_size=4, frames=3, buckets=True), 9, 16)
    with pytest.raises(UserError, match="data.sets applies to image trainers"):
        build_video_dataset(data_cfg(None, demo_size=4, frames=3, sets=[{"path": "x"}]), 9, 16)


def test_an_image_trainer_on_a_video_preset_names_the_ignored_clip_settings(tmp_path, caplog):
    import logging

    from bad_input import run_main

    caplog.set_level(logging.WARNING, logger="runner")
    result = run_main(["+preset=wan_24gb", "trainer=sdxl", "mode=plan", "data.frames=49", f"output_dir={tmp_path}",
                       f"hydra.run.dir={tmp_path / 'h'}"])
    assert result.code == 0, result.text[-2000:]
    said = caplog.text + result.text + (tmp_path / "h" / "__main__.log").read_text()
    assert said.count("so data.frames=49, data.fps=16.0 (video settings") == 1  # the tiny size drops 832x480
    assert "SDXLTrainer trains on images" in said
