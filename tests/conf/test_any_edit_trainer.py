"""Every shipped preset runs a user's *edit* trainer on the public protocol (issue 30's any-trainer rule).

The trainer is tests/assets/edit_trainer.py: a tiny diffusers FluxTransformer2DModel whose reference
images join the sequence as Flux.1 Kontext's do, written against runner/trainer.py alone. It declares
``max_references = 2`` and ``default_references = 1``; the runner resolves ``data.references`` against
that, its batches carry ``references`` from the runner's data pipeline, and its example batch carries
them for the planner. First the trainer on its own (paired folder data, the plan against a real step,
the refusals), then every preset: planned (tiny) and trained two steps with its preflight plan made.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from bad_input import assert_clean_failure, run_main
from PIL import Image
from planner_truth import assert_plan_matches_a_real_cpu_step

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.errors import UserError
from runner.files import conf_dir
from runner.output.report import read_metrics

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets"
PRESETS = sorted(p.stem for p in (conf_dir() / "preset").glob("*.yaml"))  # a new preset is covered too
EDIT = ["trainer=custom", "trainer._target_=edit_trainer.PixelKontextTrainer"]
SMALL = ["data.demo_size=4", "train.batch_size=2", "train.grad_accum=1"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _assets_on_path(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ASSETS))  # the trainer lives outside the package, as a user's would
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # anything a preset caches stays in tmp


def paired_folder(root: Path, references: int = 1, size: tuple[int, int] = (64, 64)) -> Path:
    """Two targets with captions; reference 1 in control/, reference 2 as <stem>_ref2.png."""
    (root / "control").mkdir(parents=True)
    for n, stem in enumerate(("a", "b")):
        Image.new("RGB", size, (40 * n, 200, 30)).save(root / f"{stem}.png")
        (root / f"{stem}.txt").write_text(f"make the {stem} red")
        Image.new("RGB", size, (200, 40 * n, 30)).save(root / "control" / f"{stem}.png")
        if references > 1:
            Image.new("RGB", size, (30, 40 * n, 200)).save(root / f"{stem}_ref2.png")
    return root


def train(out: Path, *overrides: str) -> list[dict[str, Any]]:
    task(compose_config([*EDIT, "train.device=cpu", "train.steps=2", "train.progress=false", "sample.every=0",
                         f"output_dir={out}", *overrides]))
    return read_metrics(out / "metrics.jsonl")


def assert_two_finite_steps(rows: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows), rows


# ---- the trainer on its own ------------------------------------------------------------------------
def test_the_trainer_reads_its_count_and_paired_data_through_the_protocol(tmp_path):
    from edit_trainer import PixelKontextTrainer

    folder = paired_folder(tmp_path / "data", references=2)
    unset = PixelKontextTrainer(compose_config([*EDIT, f"data.path={folder}", "data.references=null"]))
    assert unset.references == 1  # its default_references
    two = PixelKontextTrainer(compose_config([*EDIT, f"data.path={folder}", "data.references=2",
                                              "data.buckets=true", "data.bucket_step=16"]))
    sample = two.dataset()[1]
    assert sample["references"].shape == (2, *sample["pixel_values"].shape)
    ref1 = torch.from_numpy(np.asarray(Image.open(folder / "control" / "b.png"), dtype=np.float32))
    assert torch.allclose(sample["references"][0], ref1.permute(2, 0, 1) / 127.5 - 1, atol=1e-6)  # control/b.png
    assert not torch.equal(sample["references"][0], sample["references"][1])  # b_ref2.png is the second


def test_the_references_condition_the_loss():
    """The references' tokens join the sequence: other references give another loss for the same target."""
    from edit_trainer import PixelKontextTrainer

    trainer = PixelKontextTrainer(compose_config(EDIT))
    torch.manual_seed(0)
    models = trainer.build_models("cpu")
    batch = trainer.example_batch(2, "cpu")
    with torch.no_grad():
        same = trainer.loss(models, batch)
        other = trainer.loss(models, {**batch, "references": batch["references"].flip(0)})
    assert torch.isfinite(same) and not torch.allclose(same, other)


def test_the_trainer_trains_on_a_paired_folder_with_the_count_unset(tmp_path):
    """data.references unset: the trainer's own count (1), so control/ images are references, not samples."""
    folder = paired_folder(tmp_path / "data")
    # Read as samples, control/a.png and control/b.png (no captions) would have refused the run.
    assert_two_finite_steps(train(tmp_path / "run", f"data.path={folder}"))


@pytest.mark.parametrize("overrides", [[], ["+preset=flux_kontext_24gb"], ["data.references=2"]])
def test_planned_peak_of_the_edit_trainer_matches_a_real_cpu_step(overrides):
    cfg = compose_config([*EDIT, "train.device=cpu", *overrides])
    validate(cfg)
    assert_plan_matches_a_real_cpu_step(cfg)


def test_the_plan_counts_the_references(tmp_path):
    """A second reference adds its bytes to the batch and its tokens to every block's sequence."""
    peaks = []
    for n in (1, 2):
        out = tmp_path / str(n)
        assert task(compose_config([*EDIT, "mode=plan", f"data.references={n}", f"output_dir={out}"])) is None
        peaks.append(json.loads((out / "plan.json").read_text())["peak_bytes"])
    from edit_trainer import PixelKontextTrainer

    cfg = compose_config([*EDIT, "data.references=1"])
    batch = PixelKontextTrainer(cfg).example_batch(2, "meta")
    reference_bytes = batch["references"].numel() * batch["references"].element_size()
    assert peaks[1] - peaks[0] > reference_bytes  # at least the second reference's pixels, plus its activations


# ---- refusals before step 1 ------------------------------------------------------------------------
@pytest.mark.parametrize("fault,overrides,said", [
    ("more than it takes", ["data.references=3"],
     ["data.references=3", "PixelKontextTrainer takes at most 2 reference image(s)", "data.references=2"]),
    ("more than it takes, planned", ["data.references=3", "mode=plan"],
     ["data.references=3", "PixelKontextTrainer takes at most 2 reference image(s)"]),
    ("none for an edit model", ["data.references=0"], ["data.references=0", "data.references=1"]),
    ("a target without its reference", ["data.path={missing}"],
     ["data.references=1 but 1 reference images are missing", "reference 1 of", "b.png"]),
    ("a reference beyond the count", ["data.path={extra}", "data.references=1"],
     ["a_ref2.png' is reference 2", "data.references=1", "data.references=2"]),
    ("references for a trainer that declares none", ["trainer._target_=dit_trainer.ClassConditionalDiT",
                                                     "data.references=1"],
     ["data.references=1", "ClassConditionalDiT is not an edit model", "max_references", "runner/trainer.py"]),
])
def test_bad_reference_data_is_refused_before_step_one(tmp_path, fault, overrides, said):
    missing = paired_folder(tmp_path / "missing")
    (missing / "control" / "b.png").unlink()
    extra = paired_folder(tmp_path / "extra", references=2)
    (extra / "b_ref2.png").unlink()
    args = [a.format(missing=missing, extra=extra) for a in overrides]
    r = run_main([*EDIT, *args, "train.device=cpu", "train.steps=1", f"output_dir={tmp_path / 'o'}",
                  f"hydra.run.dir={tmp_path / 'h'}"], cwd=ASSETS)
    assert_clean_failure(r, *said)
    assert not (tmp_path / "o" / "metrics.jsonl").exists()  # refused before step 1


def test_a_declaration_that_contradicts_itself_is_refused():
    from edit_trainer import PixelKontextTrainer

    from runner.trainer import reference_count

    class TooMany(PixelKontextTrainer):
        default_references = 3

    with pytest.raises(UserError, match=r"TooMany.default_references=3 is more than its max_references=2"):
        reference_count(TooMany, compose_config(EDIT))


# ---- the shipped presets ---------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_every_shipped_preset_plans_and_trains_the_edit_trainer(tmp_path, preset):
    """Planned for the preset's GPU (tiny), then trained on the CPU with its preflight plan made and checked."""
    common = [*EDIT, f"+preset={preset}", *SMALL]
    assert task(compose_config([*common, "mode=plan", f"output_dir={tmp_path / 'plan'}"])) is None
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["fits"] and plan["run"]["modules"] == ["transformer"]
    out = tmp_path / "run"
    assert_two_finite_steps(train(out, *common))
    assert (out / "plan.json").is_file()  # the preflight planned it (a failure would have stopped the run)


def test_readme_edit_trainer_command_runs(tmp_path):
    """The edit-trainer command of docs/guide/own-trainer.md, as a user types it, two steps on the CPU."""
    lines = [ln for ln in (ROOT / "docs" / "guide" / "own-trainer.md").read_text().splitlines()
             if ln.startswith("PYTHONPATH=tests/assets python -m runner") and "edit_trainer." in ln]
    assert len(lines) == 1, lines
    args = shlex.split(lines[0])[4:]  # after PYTHONPATH=... python -m runner
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, ["tests/assets", os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "runner", *args, "train.steps=2", "train.device=cpu", "data.demo_size=4",
                        "train.progress=false", f"output_dir={tmp_path}"], check=False, cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_two_finite_steps(read_metrics(tmp_path / "metrics.jsonl"))
