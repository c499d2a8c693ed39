"""CLIP and DINO scores of a run's samples (runner/val/scores.py, ``val.scores``): in job_summary.json and the
sweep's csv with the base model's beside them; a model folder loads (safetensors) to the same numbers as the
weights saved into it; every bad key refused before step 1, naming it."""
from __future__ import annotations

import csv
import json

import pytest
import torch
from bad_input import assert_clean_failure, run_main
from PIL import Image

from runner.cli.compose import compose_config
from runner.checks import check_config
from runner.errors import UserError
from runner.val.scores import clip_score, dino_embeddings, dino_score, load_score_model, tiny_score_model

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLES = ["sample.every=1", "sample.prompts=[a cat,a red car]", "sample.steps=1", "sample.resolution=32"]
SCORES = ("clip_score", "base_clip_score", "dino_score", "base_dino_score")


def test_scores_of_the_trained_and_base_samples_in_the_job_summary_and_the_csv(tmp_path):
    r = run_main(["-m", f"hydra.sweep.dir={tmp_path}", "model.train=lora", "train.steps=1", "train.progress=false", "data.demo_size=4",
                  "optimizer.lr=1e-2", *SAMPLES, "val.scores=[clip,dino]"])
    assert r.code == 0, r.text[-3000:]
    job = tmp_path / "0"
    summary = json.loads((job / "job_summary.json").read_text())
    scores = json.loads((job / "scores.json").read_text())
    assert (scores["step"], scores["base_step"], scores["random_weights"]) == (1, 0, ["clip", "dino"])
    for key in SCORES:
        assert isinstance(summary[key], float) and summary[key] == scores[key]
        assert -1.0 <= summary[key] <= 1.0
    # Trained at lr 1e-2, the LoRA moved the samples: their scores are not step 0's (the base model's)
    assert summary["clip_score"] != summary["base_clip_score"] and summary["dino_score"] != summary["base_dino_score"]
    assert summary["score_weights"] == "random: clip+dino (plumbing only)"
    assert "random-weight tiny test models" in (job / "__main__.log").read_text()
    with open(tmp_path / "sweep_summary.csv", encoding="utf-8") as f:
        (row,) = list(csv.DictReader(f))
    assert {k: float(row[k]) for k in SCORES} == {k: summary[k] for k in SCORES}
    assert f"{summary['clip_score']:.4f} ({summary['base_clip_score']:.4f})" in r.out  # the printed table


def _images(n: int, seed: int) -> list[Image.Image]:
    g = torch.Generator().manual_seed(seed)
    return [Image.fromarray(torch.randint(0, 256, (40, 48, 3), generator=g, dtype=torch.uint8).numpy()) for _ in range(n)]


def _save(name: str, folder) -> tuple:
    model, processor, tokenizer = tiny_score_model(name)
    model.save_pretrained(folder)  # safetensors
    processor.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return model, processor, tokenizer


def test_a_model_folder_loads_to_the_scores_of_the_weights_saved_in_it(tmp_path):
    cpu = torch.device("cpu")
    images, refs, prompts = _images(2, 0), _images(3, 1), ["a cat", "a red car"]
    clip = _save("clip", tmp_path / "clip")
    loaded = load_score_model("clip", str(tmp_path / "clip"))
    assert clip_score(*loaded, images, prompts, cpu) == pytest.approx(clip_score(*clip, images, prompts, cpu), abs=1e-6)
    dino = _save("dino", tmp_path / "dino")
    loaded = load_score_model("dino", str(tmp_path / "dino"))
    got = dino_score(dino_embeddings(loaded[0], loaded[1], images, cpu), dino_embeddings(loaded[0], loaded[1], refs, cpu))
    want = dino_score(dino_embeddings(dino[0], dino[1], images, cpu), dino_embeddings(dino[0], dino[1], refs, cpu))
    assert got == pytest.approx(want, abs=1e-6)
    same = dino_embeddings(dino[0], dino[1], images, cpu)
    assert dino_score(same[:1], same[:1]) == pytest.approx(1.0)  # an image is its own nearest concept


def _folders(tmp_path):
    _save("dino", tmp_path / "dino")
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "config.json").write_text('{"model_type": "dinov2"}')
    (tmp_path / "pickle" / "pytorch_model.bin").write_bytes(b"")
    return tmp_path


@pytest.mark.parametrize("overrides, words", [
    (["val.scores=[clipp]", *SAMPLES], ["val.scores='clipp' is not known", "clip, dino"]),
    (["val.scores=[clip,clip]", *SAMPLES], ["val.scores=['clip', 'clip'] names a score twice"]),
    (["val.scores=[clip]"], ["val.scores=['clip']", "sample.every=0", "sample.every=<steps>"]),
    (["val.scores=[clip]", "model.size=full", *SAMPLES], ["val.score_models.clip is not set", "nothing is downloaded"]),
    (["val.score_models.dino={tmp}/none"], ["val.score_models.dino=", "is not a folder"]),
    (["val.score_models.clip={tmp}/dino"], ["val.score_models.clip=", "'dinov2' model", "model_type clip"]),
    (["val.score_models.dino={tmp}/pickle"], ["val.score_models.dino=", "no *.safetensors", "never a pickled"]),
    (["sweep.objective=clip_score"], ["sweep.objective=clip_score needs the clip score", "val.scores=[clip]"]),
])
def test_each_score_key_is_checked_before_step_1(tmp_path, overrides, words):
    tmp = _folders(tmp_path)
    with pytest.raises(UserError) as e:
        check_config(compose_config([o.format(tmp=tmp) for o in overrides]))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_bad_score_key_on_the_command_line_is_one_line_before_anything_runs(tmp_path):
    r = run_main(["val.scores=[clip,dinov3]", *SAMPLES, f"output_dir={tmp_path / 'out'}",
                  f"hydra.run.dir={tmp_path / 'h'}"])
    assert_clean_failure(r, "val.scores='dinov3' is not known", "dino, clip")
    assert r.code == 2 and not (tmp_path / "out" / "metrics.jsonl").exists()
