"""Samples during training (runner/sampling/): tiny SDXL, Flux, Chroma, SD1.5, SD3.5, Z-Image and Lumina 2 models on CPU, real PNG files."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from runner_setup import prepared_context
from safetensors.torch import load_file

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.errors import UserError
from runner.families.sdxl.trainer import SDXLTrainer
from runner.output.report import read_metrics
from runner.resolved import resolve
from runner.sampling import NoSampler, Sampler, build_sampler, image_name, read_prompts

PROMPTS = "sample.prompts=[a photo of a cat,a red car]"
FILES = ["00-a-photo-of-a-cat.png", "01-a-red-car.png"]
FAMILY = {"flux_kontext": ["data.references=1"], "qwen_image_edit": ["data.references=1"]}  # an edit family samples each prompt with training sample i's reference


def train(out: Path, *overrides: str) -> list[dict]:
    cfg = compose_config([f"output_dir={out}", "train.progress=false", "train.preflight=false", *overrides])
    validate(cfg)
    task(cfg)
    return read_metrics(out / "metrics.jsonl")


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("family", ["sdxl", "flux", "flux_kontext", "chroma", "sd15", "sd35", "z_image", "lumina2", "qwen_image_edit"])
def test_samples_at_start_every_n_steps_and_end_differ_between_steps(tmp_path, family):
    train(tmp_path, f"trainer={family}", *FAMILY.get(family, []), "train.steps=3", "optimizer.lr=1e-2", "sample.every=2", PROMPTS,
          "sample.steps=2", "sample.resolution=32")
    root = tmp_path / "samples"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-0", "step-2", "step-3"]  # start, every 2, end
    for step in ("step-0", "step-2", "step-3"):
        assert sorted(p.name for p in (root / step).iterdir()) == FILES
        for name in FILES:
            assert pixels(root / step / name).shape == (32, 32, 3)  # sample.resolution, not data.resolution (64)
    for name in FILES:  # the same seed at every step: images change only because the weights did
        images = [pixels(root / step / name) for step in ("step-0", "step-2", "step-3")]
        assert not np.array_equal(images[0], images[1]) and not np.array_equal(images[1], images[2])
    assert not np.array_equal(pixels(root / "step-0" / FILES[0]), pixels(root / "step-0" / FILES[1]))  # prompt+seed
    settings = json.loads((root / "prompts.json").read_text())
    assert settings["prompts"] == ["a photo of a cat", "a red car"] and settings["files"] == FILES
    assert settings["steps"] == 2 and settings["resolution"] == 32 and settings["seeds"] == [0, 1]
    assert settings["guidance"] == {"sdxl": 5.0, "flux": 3.5, "flux_kontext": 2.5, "chroma": 5.0, "sd15": 7.5,
                                    "sd35": 3.5, "z_image": 0.0, "lumina2": 4.0, "qwen_image_edit": 4.0}[family]


def test_sampling_leaves_training_bit_identical(tmp_path):
    base = train(tmp_path / "plain", "train.steps=3", "train.batch_size=1")
    sampled = train(tmp_path / "sampled", "train.steps=3", "train.batch_size=1", "sample.every=1", PROMPTS,
                    "sample.steps=2")
    assert len(list((tmp_path / "sampled" / "samples").glob("step-*/*.png"))) == 8  # steps 0..3, 2 prompts
    assert [r["loss"] for r in base] == [r["loss"] for r in sampled]
    wa = load_file(tmp_path / "plain" / "checkpoints" / "step-00000003" / "trainable.safetensors")
    wb = load_file(tmp_path / "sampled" / "checkpoints" / "step-00000003" / "trainable.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("family", ["sdxl", "flux", "flux_kontext", "chroma", "sd35", "z_image", "lumina2", "qwen_image_edit"])
def test_park_drops_encoders_and_vae_and_the_samples_are_unchanged(tmp_path, family, caplog):
    """Prompts are encoded before park drops the text encoders, and the dropped VAE still decodes:
    the images are byte-identical to a run without plugins (park's cached training is bit-exact)."""
    sample = [f"trainer={family}", *FAMILY.get(family, []), "train.steps=2", "sample.every=2", PROMPTS, "sample.steps=2", "model.train=lora"]
    if family == "lumina2":  # ComfyUI fuses Lumina 2's q/k/v: its LoRA on them is exported for diffusers only
        sample.append("export.lora_format=diffusers")
    train(tmp_path / "plain", *sample)
    with caplog.at_level(logging.INFO, logger="runner"):
        # QwenImageEditPipeline VAE-encodes the sample's reference itself, at ~1 MP: a tiled encode of it is not
        # the untiled one's bytes, so that family is checked with park alone
        tiling = [] if family == "qwen_image_edit" else ["tiling=vae"]
        train(tmp_path / "park", *sample, "offload=park", *tiling, f"offload.park.cache_dir={tmp_path / 'cache'}")
    dropped = {"sd35": "text_encoder, text_encoder_2, text_encoder_3, vae", "chroma": "text_encoder, vae",
               "z_image": "text_encoder, vae", "lumina2": "text_encoder, vae", "qwen_image_edit": "text_encoder, vae"}.get(
        family, "text_encoder, text_encoder_2, vae")
    assert f"park: dropped {dropped}" in caplog.text
    assert "the sampler keeps it on the host" in caplog.text
    plain = sorted((tmp_path / "plain" / "samples").glob("step-*/*.png"))
    park = sorted((tmp_path / "park" / "samples").glob("step-*/*.png"))
    assert [p.relative_to(tmp_path / "plain") for p in plain] == [p.relative_to(tmp_path / "park") for p in park]
    assert len(plain) == 4 and [digest(p) for p in plain] == [digest(p) for p in park]


# ---- the sampler on its own -------------------------------------------------------------------
def test_sampling_restores_train_flags_grad_mode_and_rng(tmp_path):
    ctx = prepared_context(tmp_path, "sample.every=1", PROMPTS, "sample.steps=2")
    sampler = build_sampler(ctx)
    ctx.apply_setup_phases()
    try:
        assert isinstance(sampler, Sampler) and len(sampler.cond) == 2
        ctx.models["unet"].train()
        ctx.models["unet"].up_blocks[0].eval()  # a mixed state is restored as it was, module by module
        flags = {n: m.training for n, m in ctx.models["unet"].named_modules()}
        rng = torch.get_rng_state()
        paths = sampler.sample(5)
        assert [p.name for p in paths] == FILES and all(p.parent.name == "step-5" for p in paths)
        assert {n: m.training for n, m in ctx.models["unet"].named_modules()} == flags
        assert torch.equal(torch.get_rng_state(), rng) and torch.is_grad_enabled()
        assert all(p.grad is None for p in ctx.models["unet"].parameters())
    finally:
        ctx.teardown()


class TrainerWithOwnSample(SDXLTrainer):
    """A user's trainer with its own sample(): the runner calls it and saves what it returns."""

    calls: list = []

    def sample(self, models, prompts, *, steps, guidance, seed, resolution, negative_prompt):
        self.calls.append(dict(prompts=prompts, steps=steps, guidance=guidance, seed=seed, resolution=resolution,
                               negative_prompt=negative_prompt, unet_training=models["unet"].training))
        return [Image.new("RGB", (resolution, resolution), (10 * i, 0, 0)) for i in range(len(prompts))]


def test_a_trainers_own_sample_method_is_used(tmp_path):
    cfg = compose_config(["sample.every=1", PROMPTS, "sample.steps=3", "sample.resolution=16", "sample.seed=7",
                          "sample.negative_prompt=blurry"])
    trainer = TrainerWithOwnSample(cfg, resolve(cfg))
    ctx = prepared_context(tmp_path, "sample.every=1", PROMPTS, "sample.steps=3", "sample.resolution=16", "sample.seed=7",
                  "sample.negative_prompt=blurry", trainer=trainer)
    try:
        build_sampler(ctx).sample(0)
    finally:
        ctx.teardown()
    assert trainer.calls == [dict(prompts=["a photo of a cat", "a red car"], steps=3, guidance=None, seed=7,
                                  resolution=16, negative_prompt="blurry", unet_training=False)]
    assert pixels(tmp_path / "samples" / "step-0" / FILES[1])[0, 0].tolist() == [10, 0, 0]


# ---- settings ---------------------------------------------------------------------------------
def test_sampling_is_off_by_default(tmp_path):
    ctx = prepared_context(tmp_path)
    assert isinstance(build_sampler(ctx), NoSampler)


def test_prompts_file_lines_skip_blanks_and_comments(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("# my prompts\na photo of a cat\n\n  a red car  \n")
    cfg = compose_config(["sample.every=5", f"sample.prompts_file={f}"])
    validate(cfg)
    assert read_prompts(cfg.sample) == ["a photo of a cat", "a red car"]


@pytest.mark.parametrize("overrides, words", [
    (["sample.every=2"], "sample.prompts is empty"),
    (["sample.every=-1", PROMPTS], "sample.every=-1"),
    (["sample.every=2", PROMPTS, "sample.steps=0"], "sample.steps=0"),
    (["sample.every=2", "sample.prompts_file=/nonexistent/prompts.txt"], "/nonexistent/prompts.txt"),
    (["sample.every=2", PROMPTS, "sample.prompts_file=/nonexistent/prompts.txt"], "both set"),
])
def test_bad_settings_are_user_errors_naming_the_key(overrides, words):
    with pytest.raises(UserError, match=words.replace(".", r"\.")):
        validate(compose_config(overrides))


@pytest.mark.parametrize("overrides, words", [
    (["trainer=flux", "sample.resolution=40"], "sample.resolution=40 is not usable for FluxTrainer"),
    (["trainer=flux", "sample.negative_prompt=blurry"], "sample.negative_prompt is set"),
])
def test_family_specific_settings_are_user_errors(tmp_path, overrides, words):
    with pytest.raises(UserError, match=words.replace(".", r"\.")):  # the resolution: refused by the run's checks
        build_sampler(prepared_context(tmp_path, "sample.every=1", PROMPTS, *overrides))


def test_image_names_are_file_safe():
    assert image_name(3, "A photo: of a CAT!/../x") == "03-a-photo-of-a-cat-x.png"
    assert image_name(0, "???") == "00-prompt.png"
