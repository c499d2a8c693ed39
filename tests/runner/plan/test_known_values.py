"""The planner keeps the values of token ids and masks (runner/plan/known_values.py), so a trainer whose
T5/CLIP encoder takes an attention mask plans and trains on every preset with its plan checked; a
value the planner cannot know is one paragraph naming the call and the trainer's line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bad_input import run_main
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.files import conf_dir
from runner.plan.known_values import known_values, value_of

ROOT = Path(__file__).resolve().parents[3]
ASSETS = ROOT / "tests" / "assets"
PRESETS = sorted(p.stem for p in (conf_dir() / "preset").glob("*.yaml"))
MASKED = ["trainer=sdxl", "trainer._target_=masked_trainer.MaskedSDXLTrainer"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _assets_on_path(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ASSETS))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.parametrize("cls,config", [
    (CLIPTextModel, CLIPTextConfig(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                                   vocab_size=1000, max_position_embeddings=77, bos_token_id=0, eos_token_id=2)),
    (T5EncoderModel, T5Config(d_model=32, d_ff=37, num_heads=4, num_layers=2, vocab_size=1000, d_kv=8)),
])
def test_an_encoder_with_a_padding_mask_runs_on_meta(cls, config):
    with torch.device("meta"):
        model = cls(config)
    ids = torch.zeros(2, 77, dtype=torch.long)
    mask = torch.ones(2, 77, dtype=torch.long)
    mask[:, 40:] = 0  # padding: the mask is built, not skipped
    with pytest.raises(RuntimeError, match="meta"):
        model(ids.to("meta"), attention_mask=mask.to("meta"))  # what the planner met before
    with known_values():
        out = model(ids.to("meta"), attention_mask=mask.to("meta"))
    assert out[0].shape == (2, 77, 32) and out[0].device.type == "meta"


def test_values_follow_small_tensors_and_only_them():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    with known_values():
        m = mask.to("meta")
        assert value_of(m) is not None and int(m.sum()) == 3 and bool((m.sum(-1) > 0).all())
        assert torch.equal(value_of(m[:, 1:]), mask[:, 1:])
        assert m.tolist() == mask.tolist() and torch.equal(m.cpu(), mask)  # a move back to the host reads the value
        big = torch.zeros(300, 300).to("meta")  # over the limit: activations never get values
        assert value_of(big) is None
        with pytest.raises(RuntimeError):
            float(big.sum())
        ones = torch.ones(2, 3, dtype=torch.long, device="meta")  # made while values live: it has one too
        assert torch.equal(value_of(m + ones), mask + 1)
        m.add_(big[:2, :3].long())  # an in-place op with an unknown input: the value is stale, and dropped
        assert value_of(m) is None


def test_a_trainer_with_masked_text_encoders_plans_at_full_size(tmp_path):
    assert task(compose_config([*MASKED, "mode=plan", "model.size=full", f"output_dir={tmp_path}"])) is None
    assert json.loads((tmp_path / "plan.json").read_text())["peak_bytes"] > 10 * 2**30


@pytest.mark.parametrize("preset", PRESETS)
def test_a_trainer_with_masked_text_encoders_plans_and_trains_on_every_preset(tmp_path, preset):
    """Trained on the simulated card: its preflight plans the preset's GPU (tiny) and checks the fit first."""
    out = tmp_path / "run"
    task(compose_config([*MASKED, f"+preset={preset}", "data.demo_size=4", "train.batch_size=2", "train.grad_accum=1",
                         "train.device=cuda_sim", "train.steps=2", "train.progress=false", "sample.every=0",
                         f"output_dir={out}"]))
    plan = json.loads((out / "plan.json").read_text())  # the preflight planned it (a failure would have stopped the run)
    assert plan["target"].startswith("cuda") and plan["fits"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)


def test_a_value_the_planner_cannot_know_names_the_trainers_line(tmp_path):
    env_path = [f"hydra.run.dir={tmp_path / 'h'}", f"output_dir={tmp_path / 'o'}"]
    r = run_main(["trainer=sdxl", "trainer._target_=masked_trainer.ValueReadingTrainer", "mode=plan", *env_path],
                 cwd=ASSETS)
    assert r.code == 2, r.err
    assert "Traceback" not in r.err
    assert "The planner could not simulate this run (mode=plan)" in r.err
    assert "masked_trainer.py" in r.err and "encode_part" in r.err and 'batch["pixel_values"].std()' in r.err
    assert "train.preflight=false" in r.err


def test_nested_known_values_is_the_same_mode_and_an_assumed_mask_is_all_true():
    """known_values() inside known_values() reuses the mode (no op is followed twice); a mask the
    planner assumes (runner/plan/batch.py: example batches, cached parts) is all true, and a denoiser
    that counts its tokens from it (Lumina 2's mask.sum(dim=1).tolist()) reads the full length."""
    from runner.plan.batch import all_valid, move_batch

    with known_values() as outer, known_values() as inner:
        assert inner is outer
        batch = move_batch({"mask": torch.zeros(2, 5, dtype=torch.bool, device="meta"),
                            "x": torch.zeros(2, 3, device="meta")}, torch.device("meta"))
        counts = batch["mask"].sum(dim=1)
        assert batch["mask"].device.type == "meta" and [int(n) for n in counts] == [5, 5]
        assert value_of(batch["x"]) is None  # only masks get an assumed value
    assert torch.equal(all_valid((1, 3)), torch.ones(1, 3, dtype=torch.bool))
