"""Wan image-to-video (trainer=wan trainer.variant=i2v-2.1-14b | i2v-2.2-a14b): the transformer call equals
WanImageToVideoPipeline's for the same start image, a tiny LoRA trains and loads into that pipeline,
samples start from an image, the variants and experts are checked, and a full-size plan counts the
36-channel input and the image encoder."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed
from PIL import Image

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.export.checkpoint import EXPORT_DIR
from runner.export.lora import DIFFUSERS_FILE
from runner.families.common.pixels import to_pil
from runner.output.report import read_metrics
from runner.resolved import resolve
from runner.state.checkpoint import load_trainable_weights

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = {
    "i2v-2.1-14b": ["trainer=wan", "trainer.variant=i2v-2.1-14b"],
    "i2v-2.2-a14b": ["trainer=wan", "trainer.variant=i2v-2.2-a14b", "trainer.experts=high"],
}
COMMON = ["data.frames=5", "train.device=cpu", "train.progress=false", "data.demo_size=2"]


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def fresh(variant: str, *overrides: str):
    """(trainer, models) built as a run builds them (same seed)."""
    cfg = compose_config([*VARIANTS[variant], *COMMON, *overrides])
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    set_seed(run.seed)
    return trainer, prepare_models(trainer.build_models("cpu"), cfg.model, run)


def train(out: Path, variant: str, *overrides: str) -> list[dict]:
    task(compose_config([*VARIANTS[variant], *COMMON, f"output_dir={out}", *overrides]))
    return read_metrics(out / "metrics.jsonl")


def clip_batch(trainer) -> dict:
    """A raw batch of the demo data's first clip, as the loader gives it."""
    sample = trainer.dataset()[0]
    return {"pixel_values": sample["pixel_values"][None], "caption": [sample["caption"]],
            "sample_seed": torch.zeros(1, dtype=torch.long), "index": torch.zeros(1, dtype=torch.long)}


def pipeline_call(trainer, pipe, raw: dict, batch: dict, latents: torch.Tensor) -> dict:
    """The keyword arguments and output of the transformer's call in one pipeline step from the clip's
    first frame (as an image file would give it), with these noisy latents and the run's prompt states."""
    seen: dict = {}

    def pre(module, args, kwargs):
        seen.update({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})

    def post(module, args, kwargs, output):
        seen["output"] = output[0]

    pre_h = pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True)
    post_h = pipe.transformer.register_forward_hook(post, with_kwargs=True)
    c = trainer.clips
    try:
        pipe.set_progress_bar_config(disable=True)
        pipe(image=to_pil(raw["pixel_values"][0, :, 0]), prompt_embeds=batch["prompt_embeds"], guidance_scale=1.0,
             num_inference_steps=1, num_frames=c.frames, height=c.height, width=c.width, latents=latents,
             output_type="latent")
    finally:
        pre_h.remove()
        post_h.remove()
    return seen


# ---- the conditioning ---------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_transformer_call_equals_the_pipelines_for_the_clips_first_frame(variant):
    """The condition (mask + VAE mode of first frame and zero frames, normalised), the CLIP tokens (Wan
    2.1) and the 36-channel input are what WanImageToVideoPipeline computes from the same image."""
    trainer, models = fresh(variant)
    raw = clip_batch(trainer)
    batch = trainer.encode(models, raw)
    assert batch["condition"].shape[1] == 20 and ("image_embeds" in batch) == (variant == "i2v-2.1-14b")
    assert torch.equal(batch["condition"][:, :4, 0], torch.ones_like(batch["condition"][:, :4, 0]))
    assert not batch["condition"][:, :4, 1:].any()  # the mask: the first latent frame only
    pipe = trainer.pipeline(models)
    assert type(pipe).__name__ == "WanImageToVideoPipeline"
    noisy = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    theirs = pipeline_call(trainer, pipe, raw, batch, noisy)
    transformer = models["transformer"]
    t = theirs["timestep"].float() / 1000  # the pipeline's scheduler timestep (an integer tensor) as our t
    ours = trainer.transformer_inputs(noisy, t, batch, torch.float32)
    assert ours["hidden_states"].shape[1] == transformer.config.in_channels == 36
    assert ours.keys() == {k for k in theirs if k != "output"}
    for key, value in ours.items():
        torch.testing.assert_close(value, theirs[key], rtol=1e-5, atol=1e-5, check_dtype=key != "timestep", msg=key)
    with torch.no_grad():
        out = trainer.predict(models, noisy, t, batch)
    torch.testing.assert_close(out, theirs["output"], rtol=1e-4, atol=1e-5)
    # the condition is the start image's: another first frame changes it
    other = clip_batch(trainer)
    other["pixel_values"] = -other["pixel_values"]  # the negative
    assert not torch.allclose(trainer.encode(models, other)["condition"], batch["condition"])


# ---- training and export ------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_tiny_lora_trains_and_loads_into_wan_image_to_video_pipeline(tmp_path, variant):
    lora = ["model.train=lora", "model.lora_rank=4", "model.lora_alpha=8"]
    rows = train(tmp_path, variant, "train.steps=3", "optimizer.lr=0.01", "train.batch_size=1", *lora)
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)
    ckpt = tmp_path / "checkpoints" / "step-00000003"
    path = ckpt / EXPORT_DIR / DIFFUSERS_FILE
    assert path.is_file()
    from safetensors import safe_open

    with safe_open(str(ckpt / EXPORT_DIR / "lora_comfy.safetensors"), "pt") as f:  # ComfyUI's Wan layout
        keys = list(f.keys())
    assert keys and all(k.startswith("diffusion_model.blocks.") for k in keys)
    assert any(".cross_attn.k.lora_A" in k for k in keys)

    trainer, trained = fresh(variant, *lora)
    load_trainable_weights(ckpt, trained)
    batch = trainer.example_batch(1, "cpu")
    t = torch.tensor([0.95])

    def denoise(transformer):
        with torch.no_grad():
            return trainer.predict({"transformer": transformer}, batch["latents"], t, batch)

    expected = denoise(trained["transformer"])
    _, base = fresh(variant)
    pipe = trainer.pipeline(base)
    before = denoise(pipe.transformer)
    pipe.load_lora_weights(str(path))
    after = denoise(pipe.transformer)
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-5)

    pipe.set_progress_bar_config(disable=True)
    start = Image.new("RGB", (32, 32), (200, 40, 40))
    # the run's own prompt states (the pipeline's prompt cleaning needs ftfy, which this runner does not)
    embeds = trainer.encode_part(base, "text", {"caption": ["a red square moving left"],
                                                "sample_seed": torch.zeros(1, dtype=torch.long)})["prompt_embeds"]
    out = pipe(image=start, prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), num_frames=5, height=32, width=32,
               num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt").frames
    assert out.shape == (1, 5, 3, 32, 32) and torch.isfinite(out).all()


def test_the_high_noise_expert_trains_at_the_i2v_boundary():
    trainer, _ = fresh("i2v-2.2-a14b")
    assert trainer.boundary == 0.9  # Wan2.2-I2V-A14B's boundary_ratio (the T2V A14B's is 0.875)
    assert bool((trainer.timesteps(torch.arange(64)) >= 0.9).all())
    assert "image_encoder" not in trainer.module_classes()


# ---- sampling -----------------------------------------------------------------------------------------
def test_samples_start_from_a_clips_first_frame_or_a_given_image(tmp_path):
    sample = ["sample.every=1", "sample.steps=2", "sample.prompts=[a red circle]", "train.steps=1",
              "export.enabled=false", "sample.guidance=1.0"]
    train(tmp_path / "first", "i2v-2.1-14b", *sample)
    step = tmp_path / "first" / "samples" / "step-1"
    assert {p.suffix for p in step.iterdir()} >= {".png", ".gif"}
    with Image.open(next(step.glob("*.gif"))) as im:
        assert im.n_frames == 5 and im.size == (64, 64)
    start = tmp_path / "start.png"
    Image.new("RGB", (96, 64), (20, 200, 20)).save(start)
    train(tmp_path / "file", "i2v-2.1-14b", *sample, f"sample.references=[{start}]")
    a = Image.open(next(step.glob("*.png"))).convert("RGB")
    b = Image.open(next((tmp_path / "file" / "samples" / "step-1").glob("*.png"))).convert("RGB")
    assert a.size == b.size == (64, 64) and a.tobytes() != b.tobytes()  # another start image, another clip
    with pytest.raises(UserError, match="one reference image per prompt"):
        train(tmp_path / "two", "i2v-2.1-14b", *sample, f"sample.references=[{start},{start}]")


# ---- settings -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("overrides", "match"), [
    (["trainer=wan", "trainer.variant=i2v"], r"Unknown trainer.variant 'i2v'.*i2v-2.1-14b.*i2v-2.2-a14b"),
    (["trainer=wan", "trainer.variant=i2v-2.1-14b", "trainer.experts=high"],
     r"trainer.experts=high applies to trainer.variant=i2v-2.2-a14b"),
    (["trainer=wan", "trainer.variant=i2v-2.2-a14b"], r"i2v-2.2-a14b needs trainer.experts=high or low"),
    (["trainer=wan", "trainer.variant=i2v-2.2-a14b", "trainer.experts=both"], r"not 'both'"),
])
def test_bad_i2v_settings_are_user_errors(overrides, match):
    with pytest.raises(UserError, match=match):
        build_trainer(compose_config([*overrides, "train.device=cpu"]))


# ---- the planner --------------------------------------------------------------------------------------
def test_a_full_size_plan_counts_the_condition_channels_and_the_image_encoder():
    """At full size the I2V transformer takes 36 channels and the plan holds the CLIP ViT-H/14 tower
    (632 M parameters, built on meta from its published config) besides Wan 2.1 14B's modules."""
    cfg = compose_config([*VARIANTS["i2v-2.1-14b"], "model.size=full", "model.train=lora", "train.device=cpu"])
    trainer = build_trainer(cfg, resolve(cfg))
    models = trainer.build_models("meta")
    assert models["transformer"].config.in_channels == 36 and models["transformer"].config.image_dim == 1280
    clip = sum(p.numel() for p in models["image_encoder"].parameters())
    assert 0.6e9 < clip < 0.65e9
    batch = trainer.example_batch(1, "meta")
    c, f, h, w = trainer.latent_shape()
    assert batch["condition"].shape == (1, 4 + c, f, h, w) and batch["image_embeds"].shape == (1, 257, 1280)


def test_flipped_visits_flip_the_condition_cached_or_not(tmp_path):
    """data.random_flip mirrors the clip before the encode, so the condition and CLIP tokens are the
    flipped first frame's; the cache keeps both orientations of every part (CLIP tokens included)."""
    common = ["train.steps=4", "export.enabled=false", "data.random_flip=true", "train.batch_size=2"]
    park = ["offload=park", f"offload.park.cache_dir={tmp_path / 'cache'}"]
    base = [r["loss"] for r in train(tmp_path / "base", "i2v-2.1-14b", *common)]
    first = [r["loss"] for r in train(tmp_path / "first", "i2v-2.1-14b", *common, *park)]
    second = [r["loss"] for r in train(tmp_path / "second", "i2v-2.1-14b", *common, *park)]
    assert base == first == second, (base, first, second)


@pytest.mark.parametrize(("variant", "transformer", "match"), [
    ("i2v-2.1-14b", {"in_channels": 16, "image_dim": None}, r"takes 16 input channels, where image-to-video takes 36"),
    ("i2v-2.1-14b", {"in_channels": 36, "image_dim": None}, r"no image cross-attention.*i2v-2.2-a14b"),
    ("i2v-2.2-a14b", {"in_channels": 36, "image_dim": 32}, r"image_dim=32.*i2v-2.1-14b"),
])
def test_a_folder_of_another_wan_model_is_refused_before_step_1(tmp_path, variant, transformer, match):
    """A text-to-video folder (16 channels) or the other I2V model's transformer: named before anything is built."""
    import json

    from runner.families.wan.architecture import i2v_configs

    folder = tmp_path / "Wan"
    (folder / "transformer").mkdir(parents=True)
    (folder / "transformer_2").mkdir()
    config = {**i2v_configs("tiny", variant)["transformer"], **transformer}
    for sub in ("transformer", "transformer_2"):
        (folder / sub / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=match):
        build_trainer(compose_config([*VARIANTS[variant], "train.device=cpu", f"model.path={folder}"]))


def test_the_a14b_expert_samples_without_an_image_encoder(tmp_path):
    """Wan 2.2 I2V A14B: the start image's condition alone (no CLIP tokens), a clip of the training size."""
    train(tmp_path, "i2v-2.2-a14b", "sample.every=1", "sample.steps=2", "sample.prompts=[a red circle]",
          "train.steps=1", "export.enabled=false", "sample.guidance=2.0")
    with Image.open(next((tmp_path / "samples" / "step-1").glob("*.gif"))) as im:
        assert im.n_frames == 5 and im.size == (64, 64)


def test_a_prompts_start_image_is_its_clips_first_frame_or_the_file_fitted_to_the_clip(tmp_path):
    from runner.families.wan.i2v_sampling import WanI2VSampling

    trainer, _ = fresh("i2v-2.1-14b", "data.width=64", "data.height=32")
    family = trainer.sampling_family()
    assert isinstance(family, WanI2VSampling)
    data = trainer.dataset()
    starts = family.reference_pixels(trainer, [], 3, 64)
    assert [tuple(s.shape) for s in starts] == [(1, 1, 3, 32, 64)] * 3
    for i, s in enumerate(starts):  # prompt i: clip i's first frame (modulo the two demo clips)
        assert torch.equal(s[0, 0], data[i % len(data)]["pixel_values"][:, 0])
    image = Image.new("RGB", (100, 100), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 100, 50))  # white top half: a 64x32 crop of the middle is half white
    image.save(tmp_path / "start.png")
    (start,) = family.reference_pixels(trainer, [str(tmp_path / "start.png")], 1, 64)
    assert start.shape == (1, 1, 3, 32, 64)
    # covered (100 px -> 64 x 64, Lanczos) and centre-cropped to 32 rows: 16 white rows, then 16 black ones
    assert bool((start[0, 0, :, :12] > 0.95).all()) and bool((start[0, 0, :, -12:] < -0.95).all())


@pytest.mark.parametrize("plugins", [["checkpoint=blocks"],
                                     ["offload=stream", "offload.stream.device_fraction=0.9", "offload.stream.prefetch=0"]],
                         ids=["checkpoint", "stream"])
def test_checkpointing_and_streaming_keep_the_losses_bit_identical(tmp_path, caplog, plugins):
    """The 36-channel input and the image cross-attention through the block plugins: the same losses."""
    import logging
    import re

    steps = ["train.steps=2", "export.enabled=false"]
    base = [r["loss"] for r in train(tmp_path / "base", "i2v-2.1-14b", *steps)]
    with caplog.at_level(logging.INFO, logger="runner"):
        assert [r["loss"] for r in train(tmp_path / "with", "i2v-2.1-14b", *steps, *plugins)] == base
    done = (r"stream: \w+: ([1-9]\d*) of \d+ blocks streamed" if "offload=stream" in plugins
            else r"checkpoint: \w+: (\d+) of \1 trainer blocks wrapped")
    assert re.search(done, caplog.text), caplog.text[-2000:]


@pytest.mark.slow
def test_wan_24gb_with_the_i2v_variant_plans_more_than_text_to_video_and_fits():
    """wan_24gb at full size with i2v-2.1-14b: the image cross-attention (2.1 B parameters, nf4 on the
    device) and the 36-channel input cost device bytes the text-to-video plan does not hold; it still fits."""
    from runner.checks import validate
    from runner.plan import plan_step

    plans = {}
    for name, extra in (("t2v", []), ("i2v", ["trainer.variant=i2v-2.1-14b"])):
        cfg = compose_config(["+preset=wan_24gb", "model.size=full", *extra])
        validate(cfg)
        plans[name] = plan_step(cfg)
    assert plans["i2v"].fits, "\n" + plans["i2v"].format_table()
    assert plans["i2v"].peak_bytes > plans["t2v"].peak_bytes
