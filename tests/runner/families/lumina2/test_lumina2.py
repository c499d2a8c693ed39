"""Lumina 2 (runner/families/lumina2/trainer.py) against diffusers' ``Lumina2Pipeline``, on the tiny model (CPU, offline).

* the text conditioning is the pipeline's ``encode_prompt`` (system prompt, Gemma-2's second-to-last
  hidden state, the tokenizer's mask), bit for bit;
* ``predict`` is the pipeline's transformer call with its conventions (timestep ``1 - sigma``, output
  the negative velocity): one pipeline step's noise prediction equals ``predict``;
* the loss goes down, the planner (which reads the mask's token count, as the transformer does) agrees
  with a real CPU step within 5 %, cached and uncached losses are equal, the exported LoRA loads into
  ``Lumina2Pipeline`` at the trained strength and generates without NaN; the full-size configs have the
  published parameter counts; the preset trains at tiny size.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed
from planner_truth import assert_plan_matches_a_real_cpu_step
from safetensors.torch import load_file

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.errors import UserError
from runner.export.checkpoint import EXPORT_DIR
from runner.export.comfy import COMFY_FILE
from runner.export.lora import DIFFUSERS_FILE
from runner.families.lumina2.trainer import Lumina2Trainer
from runner.output.report import read_metrics
from runner.resolved import resolve
from runner.state.checkpoint import load_trainable_weights

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTIONS = ["a photo of a cat", "a red bicycle leaning on a wall, oil painting"]
COMMON = ["trainer=lumina2", "train.device=cpu", "train.progress=false", "data.demo_size=2"]


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # offload=park's default cache stays in tmp


def train(out: Path, *overrides: str) -> list[dict]:
    task(compose_config([*COMMON, f"output_dir={out}", *overrides]))
    return read_metrics(out / "metrics.jsonl")


def fresh(*overrides: str, frozen: bool = True):
    """(trainer, models) built as a run builds them (same seed); ``frozen``: no gradients anywhere."""
    cfg = compose_config([*COMMON, *overrides])
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    assert isinstance(trainer, Lumina2Trainer)
    set_seed(run.seed)
    models = prepare_models(trainer.build_models("cpu"), cfg.model, run)
    for m in models.modules.values() if frozen else ():
        m.requires_grad_(False)
    return trainer, models


@pytest.fixture(scope="module")
def built():
    return fresh()


def test_full_size_configs_have_the_published_parameter_counts():
    from runner.families.common.loading import build_module

    trainer = build_trainer(compose_config(["trainer=lumina2", "model.size=full"]))

    def count(name):
        cls = trainer.module_classes()[name]
        return sum(p.numel() for p in build_module(cls, trainer.size_configs()[name], "meta", torch.bfloat16).parameters())

    assert count("transformer") == 2_609_769_152  # Lumina-Image-2.0: "2.6 B"
    assert count("text_encoder") == 2_614_341_888  # google/gemma-2-2b
    assert count("vae") == 83_819_683  # FLUX.1's VAE


def test_text_conditioning_is_the_pipelines(built):
    trainer, models = built
    ours = trainer.encode_part(models, "text", {"caption": list(CAPTIONS), "sample_seed": torch.zeros(2, dtype=torch.int64)})
    with torch.no_grad():
        embeds, mask, *_ = trainer.pipeline(models).encode_prompt(
            list(CAPTIONS), do_classifier_free_guidance=False, device="cpu",
            max_sequence_length=trainer.max_sequence_length)
    torch.testing.assert_close(ours["prompt_embeds"], embeds, rtol=0, atol=0)
    assert torch.equal(ours["prompt_attention_mask"], mask.bool())
    lengths = mask.sum(dim=1)
    assert lengths[0] < lengths[1] < trainer.max_sequence_length


def test_predict_is_the_pipelines_transformer_call(built):
    trainer, models = built
    cond = trainer.encode_part(models, "text", {"caption": list(CAPTIONS), "sample_seed": torch.zeros(2, dtype=torch.int64)})
    pipe = trainer.pipeline(models)
    seen = {}

    def capture(module, args, kwargs, out):
        seen.update(x=kwargs["hidden_states"], t=kwargs["timestep"], out=out[0])

    handle = models["transformer"].register_forward_hook(capture, with_kwargs=True)
    try:
        pipe(prompt_embeds=cond["prompt_embeds"], prompt_attention_mask=cond["prompt_attention_mask"],
             guidance_scale=1.0, num_inference_steps=2, height=64, width=64, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    sigma = 1.0 - seen["t"]  # the pipeline passes 1 - t / 1000
    assert 0.0 < float(sigma[0]) < 1.0
    with torch.no_grad():
        ours = trainer.predict(models, seen["x"], sigma, cond)
    torch.testing.assert_close(ours, -seen["out"], rtol=1e-5, atol=1e-6)


def test_loss_goes_down_over_a_short_run(tmp_path):
    losses = [r["loss"] for r in train(tmp_path, "train.steps=10", "optimizer.lr=3e-3", "export.enabled=false")]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses


@pytest.mark.parametrize("extra", [[], ["model.train=lora", "checkpoint=blocks"]], ids=["full", "lora-ckpt"])
def test_planned_peak_matches_a_real_cpu_step(extra):
    cfg = compose_config([*COMMON, "data.resolution=128", *extra])
    validate(cfg)
    assert_plan_matches_a_real_cpu_step(cfg)


def test_cached_and_uncached_losses_are_equal(tmp_path):
    park = ["offload=park", f"offload.park.cache_dir={tmp_path / 'cache'}"]
    steps = ["train.steps=3", "export.enabled=false"]
    base = [r["loss"] for r in train(tmp_path / "base", *steps)]
    first = [r["loss"] for r in train(tmp_path / "first", *steps, *park)]
    second = [r["loss"] for r in train(tmp_path / "second", *steps, *park)]
    assert base == first == second, (base, first, second)
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == 4  # two samples: latents and text each


def test_exported_lora_loads_into_the_pipeline_and_generates(tmp_path):
    lora = ["model.train=lora", "model.lora_rank=4", "model.lora_alpha=8"]
    train(tmp_path, "train.steps=2", "optimizer.lr=0.01", "train.batch_size=1", *lora)
    export = tmp_path / "checkpoints" / "step-00000002" / EXPORT_DIR
    trainer, trained = fresh(*lora, frozen=False)
    load_trainable_weights(tmp_path / "checkpoints" / "step-00000002", trained)
    batch = trainer.example_batch(1, "cpu")
    t = torch.tensor([0.5])

    def denoise(transformer):
        with torch.no_grad():
            return trainer.predict({"transformer": transformer}, batch["latents"], t, batch)

    expected = denoise(trained["transformer"])
    _, base = fresh()
    pipe = trainer.pipeline(base)
    before = denoise(pipe.transformer)
    pipe.load_lora_weights(str(export / DIFFUSERS_FILE))
    after = denoise(pipe.transformer)
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-5)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt="a red circle", height=32, width=32, num_inference_steps=2, guidance_scale=4.0,
               generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert out.shape == (1, 3, 32, 32) and torch.isfinite(out).all()


def test_samples_during_training(tmp_path):
    train(tmp_path, "sample.every=1", "sample.steps=2", "sample.prompts=[a red circle]", "train.steps=1",
          "export.enabled=false")
    from PIL import Image

    with Image.open(next((tmp_path / "samples" / "step-1").glob("*.png"))) as im:
        assert im.size == (64, 64)


def test_the_preset_trains_at_tiny_size(tmp_path):
    task(compose_config(["+preset=lumina2_16gb", *COMMON[1:], "train.steps=2", f"output_dir={tmp_path}"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    export = tmp_path / "checkpoints" / "step-00000002" / EXPORT_DIR
    assert (export / DIFFUSERS_FILE).is_file()  # and ComfyUI's, q/k/v fused (tests/runner/export/test_comfy_apply.py)
    assert "diffusion_model.layers.0.attention.qkv.lora_A.weight" in load_file(str(export / COMFY_FILE))


@pytest.mark.parametrize("value", ["0", "300"])
def test_a_bad_max_sequence_length_is_a_user_error(value):
    with pytest.raises(UserError, match=rf"trainer.max_sequence_length={value} is not valid"):
        build_trainer(compose_config(["trainer=lumina2", f"trainer.max_sequence_length={value}", "train.device=cpu"]))


def test_an_original_lumina2_file_is_refused_naming_what_loads(tmp_path):
    """Recognised (not read as diffusers' layout, nor as Z-Image's), and refused before any weight is read."""
    from safetensors.torch import save_file

    file = tmp_path / "lumina_2_model_bf16.safetensors"
    save_file({"layers.0.attention.qkv.weight": torch.zeros(6, 2), "layers.0.adaLN_modulation.1.weight": torch.zeros(8, 2)},
              str(file))
    with pytest.raises(UserError, match=r"original Lumina 2 layout.*trainer=lumina2 does not read.*diffusers folder"):
        build_trainer(compose_config(["trainer=lumina2", f"model.path={file}", "train.device=cpu"]))
    with pytest.raises(UserError, match=r"original Lumina 2 layout.*not a z_image checkpoint"):
        build_trainer(compose_config(["trainer=z_image", f"model.path={file}", "train.device=cpu"]))
