"""A trainer that sends its token ids to ``next(text_encoder.parameters()).device`` (the host, for a
parked encoder) trains on the presets on the simulated card, which raises CUDA's device-mismatch
error where a GPU would (tests/assets/host_ids_trainer.py). Before park aligned devices, the cache
fill stopped in ``aten.embedding``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.cli.launch import run_job
from runner.files import conf_dir

ASSETS = Path(__file__).resolve().parents[2] / "assets"
PRESETS = sorted(p.stem for p in (conf_dir() / "preset").glob("*.yaml"))
TRAINER = ["trainer=custom", "trainer._target_=host_ids_trainer.HostIdsTrainer", "train.device=cuda_sim",
           "train.steps=2", "data.resolution=32", "train.progress=false", "sample.every=0"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _assets_on_path(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ASSETS))  # the trainer lives outside the package, as a user's would
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def train(out: Path, preset: str) -> dict:
    try:
        run_job(task, compose_config([f"+preset={preset}", *TRAINER, f"output_dir={out}"]))
    except SystemExit:
        pass
    return json.loads((out / "job_summary.json").read_text())


def assert_trains(tmp_path: Path, preset: str) -> None:
    s = train(tmp_path / "run", preset)
    assert s["status"] == "ok" and s["steps_done"] == 2, s.get("error")
    assert s["peak_memory_source"].startswith("cuda_sim")


@pytest.mark.parametrize("preset", ["flux2_klein_16gb", "qwen_image_24gb"])
def test_host_ids_train_on_a_parked_encoder_on_the_simulated_card(tmp_path, preset):
    assert_trains(tmp_path, preset)


@pytest.mark.parametrize("preset", PRESETS)
def test_host_ids_train_on_every_preset_on_the_simulated_card(tmp_path, preset):
    assert_trains(tmp_path, preset)
