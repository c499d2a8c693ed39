"""LTX-2's audio data (runner/data/audio.py): a clip's own audio track (PyAV), a .wav beside a frames folder, the
error for a clip without audio, and 2 tiny steps that train with the audio of a clip and log its loss."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.data import build_video_dataset
from runner.errors import UserError
from runner.output.report import read_metrics

av = pytest.importorskip("av")
pytestmark = pytest.mark.usefixtures("one_thread")
RATE, FPS, FRAMES = 16000, 24, 12


def tone(freq: float, seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def write_clip(path: Path, freq: float | None) -> None:
    """FRAMES frames of 64x64 at 24 fps (mpeg4), and a stereo AAC tone of ``freq`` Hz unless None."""
    with av.open(str(path), "w") as out:
        v = out.add_stream("mpeg4", rate=FPS)
        v.width = v.height = 64
        v.pix_fmt = "yuv420p"
        a = out.add_stream("aac", rate=RATE, layout="stereo") if freq is not None else None
        for i in range(FRAMES):
            img = Image.new("RGB", (64, 64), (20 * i % 255, 80, 160))
            for p in v.encode(av.VideoFrame.from_image(img)):
                out.mux(p)
        for p in v.encode():
            out.mux(p)
        if a is not None:
            wave = tone(freq, FRAMES / FPS + 0.2, RATE)
            frame_len = 1024
            for k in range(0, len(wave) - frame_len, frame_len):
                chunk = np.stack([wave[k:k + frame_len]] * 2)
                frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
                frame.sample_rate, frame.pts = RATE, k
                for p in a.encode(frame):
                    out.mux(p)
            for p in a.encode():
                out.mux(p)


def write_wav(path: Path, wave: np.ndarray) -> None:
    with av.open(str(path), "w") as out:
        s = out.add_stream("pcm_s16le", rate=RATE, layout="mono")
        frame = av.AudioFrame.from_ndarray((wave * 32767).astype(np.int16)[None], format="s16", layout="mono")
        frame.sample_rate = RATE
        for p in s.encode(frame):
            out.mux(p)
        for p in s.encode():
            out.mux(p)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clips")
    write_clip(root / "song.mp4", 440.0)
    (root / "song.txt").write_text("a square with a tone")
    frames = root / "still"
    frames.mkdir()
    for i in range(FRAMES):
        Image.new("RGB", (64, 64), (200, 10 * i, 30)).save(frames / f"{i:04d}.png")
    (root / "still.txt").write_text("a red square")
    write_wav(root / "still.wav", tone(1000.0, 1.0, RATE))
    return root


def data_cfg(path: Path, **extra):
    return compose_config(["trainer=ltx2", f"data.path={path}", "data.frames=9"]
                          + [f"data.{k}={v}" for k, v in extra.items()]).data


def dominant_hz(wave: torch.Tensor) -> float:
    spectrum = np.abs(np.fft.rfft(wave[0].numpy()))
    return float(np.argmax(spectrum) * RATE / wave.shape[1])


def test_audio_comes_from_the_clips_track_or_the_wav_beside_it(clips):
    ds = build_video_dataset(data_cfg(clips), 9, 24.0, RATE)
    samples = {ds.caption(i): ds[i] for i in range(len(ds))}
    song, still = samples["a square with a tone"], samples["a red square"]
    n = round(9 / 24 * RATE)
    assert song["audio"].shape == still["audio"].shape == (2, n)
    assert abs(dominant_hz(song["audio"]) - 440.0) < 10 and abs(dominant_hz(still["audio"]) - 1000.0) < 10
    assert torch.equal(still["audio"][0], still["audio"][1])  # mono, duplicated
    assert "audio" not in build_video_dataset(data_cfg(clips), 9, 24.0, None)[0]  # data.audio=false: none read


def test_a_clip_without_audio_is_an_error_naming_it_and_data_audio(tmp_path):
    write_clip(tmp_path / "mute.mp4", None)
    (tmp_path / "mute.txt").write_text("silence")
    with pytest.raises(UserError, match=r"mute.mp4' has no audio track and no mute.wav beside it.*data.audio=false"):
        build_video_dataset(data_cfg(tmp_path), 9, 24.0, RATE)


def test_two_tiny_steps_train_with_the_audio_of_a_clip(clips, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    out = tmp_path / "run"
    task(compose_config(["trainer=ltx2", "train.device=cpu", "train.progress=false", f"data.path={clips}",
                         "data.frames=9", "train.steps=2", "export.enabled=false", "train.preflight=false",
                         f"output_dir={out}"]))
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["audio_loss"]) and r["audio_loss"] > 0
        assert r["loss"] == pytest.approx(r["video_loss"] + r["audio_loss"], rel=1e-5)


def test_samples_during_training_are_a_clip_and_its_audio(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    task(compose_config(["trainer=ltx2", "train.device=cpu", "train.progress=false", "data.demo_size=2",
                         "train.steps=1", "sample.every=1", "sample.steps=2", "sample.prompts=[a red circle]",
                         "export.enabled=false", "train.preflight=false", f"output_dir={tmp_path}"]))
    step = tmp_path / "samples" / "step-1"
    with Image.open(step / "00-a-red-circle.png") as im:
        assert im.size == (64, 64)
    with Image.open(step / "00-a-red-circle.gif") as im:
        assert im.n_frames == 9
    with av.open(str(step / "00-a-red-circle.wav")) as wav:
        stream = wav.streams.audio[0]
        assert stream.channels == 2 and stream.rate == 16000  # the tiny vocoder's rate
        assert sum(f.samples for f in wav.decode(stream)) > 0
