"""A sweep job's folder: its number and the swept keys' values (runner/config/sweep_dirs.py)."""
from __future__ import annotations

import sys

import pytest

from runner.config.sweep_dirs import MAX_VALUE, job_dir, swept_keys


def test_only_the_swept_keys_name_the_folder(monkeypatch):
    argv = ["runner", "-m", "+preset=sdxl_24gb", "optimizer.lr=1e-4,5e-4", "train.steps=range(1,3)", "seed=3"]
    monkeypatch.setattr(sys, "argv", argv)
    assert swept_keys(argv[1:]) == {"optimizer.lr", "train.steps"}
    job = ["+preset=sdxl_24gb", "optimizer.lr=0.0005", "train.steps=2", "seed=3"]
    assert job_dir(1, job) == "1_lr=0.0005_steps=2"


@pytest.mark.parametrize("value", ["/data/my photos/set a", "x" * 100])
def test_values_are_file_safe_and_short(monkeypatch, value):
    monkeypatch.setattr(sys, "argv", ["runner", "-m", f"data.path={value},b"])
    name = job_dir(0, [f"data.path={value}"])
    assert "/" not in name and " " not in name and len(name) <= len("0_") + MAX_VALUE


def test_an_argv_it_cannot_parse_names_every_override(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["worker", "a=(("])
    assert job_dir(2, ["seed=3"]) == "2_seed=3"


def test_an_optuna_presets_search_space_names_the_folder(monkeypatch):
    """hydra/sweeper=runner_lora: the swept keys are in hydra.sweeper.params, not on the command line."""
    monkeypatch.setattr(sys, "argv", ["runner", "-m", "hydra/sweeper=runner_lora", "train.steps=2"])
    params = {"optimizer.lr": "tag(log, interval(1e-5, 1e-3))", "model.lora_rank": "choice(4, 8)"}
    job = ["optimizer.lr=0.0002", "model.lora_rank=8", "train.steps=2"]
    assert job_dir(3, job, params) == "3_lr=0.0002_lora_rank=8"
    assert job_dir(3, job) == "3"
