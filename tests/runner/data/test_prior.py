"""Prior preservation's data side (``data.sets[n].role: prior``, ``data.demo_prior``; runner/data/sets.py):
the per-sample ``prior`` flag, the share in the data line, and the refusals before step 1."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from runner.cli.compose import compose_config
from runner.checks import validate
from runner.data import TrainingData, build_dataset, collate
from runner.errors import UserError


def folder(root: Path, n: int, colour=(200, 40, 40)) -> str:
    root.mkdir(parents=True)
    for i in range(n):
        Image.new("RGB", (32, 32), colour).save(root / f"{i}.png")
        (root / f"{i}.txt").write_text(f"image {i}")
    return str(root)


def test_samples_of_a_prior_set_carry_the_flag_and_the_share_is_in_the_data_line(tmp_path):
    a, b = folder(tmp_path / "a", 3), folder(tmp_path / "b", 2)
    ds = build_dataset({"resolution": 32, "sets": [{"path": a, "repeats": 2}, {"path": b, "role": "prior"}]})
    assert isinstance(ds, TrainingData)
    assert [bool(ds[i]["prior"]) for i in range(5)] == [False, False, False, True, True]
    assert [bool(ds.light_visit(i, 0)["prior"]) for i in range(5)] == [False, False, False, True, True]
    assert collate([ds[0], ds[4]])["prior"].tolist() == [False, True]
    assert "prior (class) sets: 25% of the samples" in ds.describe()  # 2 of 3 x 2 + 2
    weighted = build_dataset({"resolution": 32, "sets": [{"path": a, "weight": 3}, {"path": b, "weight": 1, "role": "prior"}]})
    assert "prior (class) sets: 25% of the steps' batches" in weighted.describe()
    plain = build_dataset({"resolution": 32, "sets": [{"path": a}, {"path": b}]})
    assert "prior" not in plain[0] and "prior (class)" not in plain.describe()


def test_the_demo_prior_set_has_class_captions_and_masks_when_asked():
    ds = build_dataset({"resolution": 32, "demo_size": 4, "demo_prior": 2, "masks": True})
    assert len(ds) == 6 and [bool(ds[i]["prior"]) for i in range(6)] == [False] * 4 + [True] * 2
    assert all(ds[i]["caption"] in ("a circle", "a square", "a triangle", "stripes") for i in (4, 5))
    assert ds[5]["mask"].shape == (1, 32, 32) and not torch.equal(ds[4]["pixel_values"], ds[0]["pixel_values"])


@pytest.mark.parametrize("overrides, words", [
    (["data.sets=[{path: /tmp, role: class}]"], ["data.sets[0].role='class'", "instance", "prior"]),
    (["data.sets=[{path: /tmp, role: prior}]"], ["every set has role: prior"]),
    (["loss.prior_weight=0.5"], ["loss.prior_weight=0.5", "role: prior", "data.demo_prior"]),
    (["loss.prior_weight=0", "data.demo_prior=2"], ["loss.prior_weight=0.0", "> 0"]),
    (["data.demo_prior=2", "data.path=/tmp"], ["data.demo_prior=2", "role: prior"]),
    (["data.demo_prior=-1"], ["data.demo_prior=-1", ">= 0"]),
])
def test_bad_prior_settings_are_refused_naming_the_key(overrides, words):
    with pytest.raises(UserError) as e:
        cfg = compose_config(overrides)
        validate(cfg)
        build_dataset(cfg.data)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_cli_runs_with_the_demo_prior_set_and_masks(tmp_path):
    cmd = [sys.executable, "-m", "runner", "model.train=lora", "data.masks=true", "data.demo_prior=4",
           "loss.prior_weight=0.5", "train.steps=3", f"output_dir={tmp_path}", "train.progress=false"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "prior (class) sets: 20% of the samples; the prior sets' loss x 0.5 (loss.prior_weight)" in done.stdout + done.stderr
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2, 3]
