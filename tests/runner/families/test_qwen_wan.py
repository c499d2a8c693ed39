"""The Qwen-Image and Wan families at tiny size on CPU: the issue's four checks, and what they rest on.

For each family: the loss goes down over a short run; the planner agrees with a real CPU step within
5 % (tests/planner_truth.py, the bar of every other trainer); cached and uncached runs give the same
losses bit for bit; the exported LoRA loads into the family's diffusers pipeline, makes its denoiser
compute what training left, and generates without NaN. Besides: the prompt embeddings equal the
pipelines' own, the full-size configs have the published parameter counts, the presets train their
own family at tiny size, and an out-of-memory split gives the losses of a run configured that way.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed
from planner_truth import assert_plan_matches_a_real_cpu_step

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.errors import UserError
from runner.export.checkpoint import EXPORT_DIR
from runner.export.lora import DIFFUSERS_FILE
from runner.families.qwen_image.trainer import PROMPT_TEMPLATE
from runner.output.report import read_metrics
from runner.plugin import Plugin, PluginConfig
from runner.registry import register_plugin
from runner.resolved import resolve
from runner.state.checkpoint import load_trainable_weights

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = {
    "qwen_image": ["trainer=qwen_image"],
    "wan": ["trainer=wan", "data.frames=5"],  # 2 latent frames: a clip, at a CPU-friendly length
    # image-to-video (test_wan_i2v.py has its own checks): the family-wide ones below, where marked
    "wan_i2v": ["trainer=wan", "trainer.variant=i2v-2.1-14b", "data.frames=5"],
}
T2X = ["qwen_image", "wan"]  # the checks whose pipeline calls are text-to-X (test_wan_i2v.py covers I2V's)
COMMON = ["train.device=cpu", "train.progress=false", "data.demo_size=2"]


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # offload=park's default cache stays in tmp


def train(out: Path, family: str, *overrides: str) -> list[dict]:
    task(compose_config([*FAMILIES[family], *COMMON, f"output_dir={out}", *overrides]))
    return read_metrics(out / "metrics.jsonl")


def fresh(family: str, *overrides: str):
    """(trainer, models) built as a run builds them (same seed)."""
    cfg = compose_config([*FAMILIES[family], *COMMON, *overrides])
    run_ = resolve(cfg)
    trainer = build_trainer(cfg, run_)
    set_seed(run_.seed)
    return trainer, prepare_models(trainer.build_models("cpu"), cfg.model, run_)


# ---- the architectures -------------------------------------------------------------------------------
def test_full_size_configs_have_the_published_parameter_counts():
    from runner.families.common.loading import build_module

    def count(trainer, name):
        cls = trainer.module_classes()[name]
        return sum(p.numel() for p in build_module(cls, trainer.size_configs()[name], "meta", torch.bfloat16).parameters())

    qwen = build_trainer(compose_config(["trainer=qwen_image", "model.size=full"]))
    assert count(qwen, "transformer") == 20_430_401_088  # Qwen-Image: "20 B"
    assert count(qwen, "text_encoder") == 8_292_166_656  # Qwen2.5-VL-7B-Instruct with its vision tower
    assert count(qwen, "vae") == 126_892_531
    expected = {"14b": 14_288_491_584, "1.3b": 1_418_996_800, "2.2-5b": 4_999_787_712}
    for variant, n in expected.items():
        wan = build_trainer(compose_config(["trainer=wan", "model.size=full", f"trainer.variant={variant}"]))
        assert count(wan, "transformer") == n, variant
    assert count(wan, "text_encoder") == 5_680_910_336  # UMT5-XXL encoder
    assert count(wan, "vae") == 704_688_668  # the Wan 2.2 VAE (48 channels, 16x)


def test_prompt_embeddings_equal_the_pipelines():
    """Each caption encoded alone and zero-padded equals what the pipeline computes for a padded,
    masked batch, on the caption's tokens (the rest is zero / masked out)."""
    captions = ["a red circle on a blue background", "stripes"]
    trainer, models = fresh("qwen_image")
    ours = trainer.encode_part(models, "text", {"caption": captions, "sample_seed": torch.zeros(2, dtype=torch.long)})
    pipe = trainer.pipeline(models)
    # The pipeline's count of template tokens to drop (34) is its tokenizer's; ours is counted.
    pipe.prompt_template_encode_start_idx = trainer.template_tokens()
    theirs, mask = pipe._get_qwen_prompt_embeds(captions, device=torch.device("cpu"))
    n = theirs.shape[1]
    assert torch.equal(ours["prompt_embeds_mask"][:, :n], mask.bool()) and not ours["prompt_embeds_mask"][:, n:].any()
    torch.testing.assert_close(ours["prompt_embeds"][:, :n] * mask[..., None], theirs * mask[..., None],
                               rtol=1e-5, atol=1e-6)
    assert PROMPT_TEMPLATE == pipe.prompt_template_encode  # the template diffusers' pipeline uses

    trainer, models = fresh("wan")
    ours = trainer.encode_part(models, "text", {"caption": captions, "sample_seed": torch.zeros(2, dtype=torch.long)})
    pipe = trainer.pipeline(models)
    theirs = pipe._get_t5_prompt_embeds(captions, max_sequence_length=trainer.max_sequence_length,
                                        device=torch.device("cpu"))
    assert ours["prompt_embeds"].shape == theirs.shape
    torch.testing.assert_close(ours["prompt_embeds"], theirs, rtol=1e-5, atol=1e-6)


# ---- the checks ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_goes_down_over_a_short_run(tmp_path, family):
    rows = train(tmp_path, family, "train.steps=10", "optimizer.lr=3e-3", "export.enabled=false")
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.9 * first, losses


# The presets with latents encoded on the device: planner_truth's real step feeds the raw batch, whose
# pixels a fully cached run (and its plan) never holds, so at tiny size they would be most of the peak.
TRUTH = {
    "qwen_image": ["trainer=qwen_image", "data.resolution=128"],
    "qwen_image_24gb": ["+preset=qwen_image_24gb", "data.resolution=128", "offload.park.cache_latents=false"],
    "wan": ["trainer=wan"],
    "wan_i2v": ["trainer=wan", "trainer.variant=i2v-2.1-14b"],  # + the condition channels and the CLIP tower
    "wan_24gb": ["+preset=wan_24gb", "data.width=64", "data.height=48", "data.frames=5",
                 "offload.park.cache_latents=false"],
}


@pytest.mark.parametrize("case", list(TRUTH))
def test_planned_peak_matches_a_real_cpu_step(case):
    cfg = compose_config([*TRUTH[case], "train.device=cpu"])
    validate(cfg)
    assert_plan_matches_a_real_cpu_step(cfg)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cached_and_uncached_losses_are_equal(tmp_path, family):
    park = ["offload=park", f"offload.park.cache_dir={tmp_path / 'cache'}"]
    steps = ["train.steps=3", "export.enabled=false"]
    base = [r["loss"] for r in train(tmp_path / "base", family, *steps)]
    first = [r["loss"] for r in train(tmp_path / "first", family, *steps, *park)]
    second = [r["loss"] for r in train(tmp_path / "second", family, *steps, *park)]
    assert base == first == second, (base, first, second)
    entries = list((tmp_path / "cache").rglob("*.safetensors"))
    assert len(entries) == 2 * (3 if family == "wan_i2v" else 2)  # two samples: latents and text (and CLIP tokens) each
    if family != "qwen_image":
        from safetensors.torch import load_file

        latents = [e for p in (tmp_path / "cache" / "latents").rglob("*.safetensors") if "latent_mean" in (e := load_file(str(p)))]
        assert len(latents) == 2 and latents[0]["latent_mean"].shape == (16, 2, 8, 8)  # a video latent: channels, frames, h, w
        if family == "wan_i2v":  # the first frame's condition is cached with the clip's latents
            assert all(e["condition_mean"].shape == (16, 2, 8, 8) for e in latents)


@pytest.mark.parametrize("family", T2X)
def test_exported_lora_loads_into_the_pipeline_and_generates(tmp_path, family):
    lora = ["model.train=lora", "model.lora_rank=4", "model.lora_alpha=8"]
    train(tmp_path, family, "train.steps=2", "optimizer.lr=0.01", "train.batch_size=1", *lora)
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    path = ckpt / EXPORT_DIR / DIFFUSERS_FILE
    assert path.is_file() and not (ckpt / EXPORT_DIR / "lora_kohya.safetensors").exists()
    assert json.loads((ckpt / EXPORT_DIR / "export.json").read_text())["pipeline"] in ("QwenImagePipeline",
                                                                                         "WanPipeline")

    trainer, trained = fresh(family, *lora)
    load_trainable_weights(ckpt, trained)
    batch = trainer.example_batch(1, "cpu")
    t = torch.tensor([0.5])

    def denoise(transformer):
        with torch.no_grad():
            return trainer.predict({"transformer": transformer}, batch["latents"], t, batch)

    expected = denoise(trained["transformer"])
    _, base = fresh(family)  # no adapters: a pipeline as a user builds it
    pipe = trainer.pipeline(base)
    before = denoise(pipe.transformer)
    pipe.load_lora_weights(str(path))
    after = denoise(pipe.transformer)
    assert (after - before).abs().max() > 1e-4  # the LoRA changes the output ...
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-5)  # ... exactly as training left it

    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    if family == "wan":
        out = pipe(prompt="a red circle moving left", num_frames=5, height=32, width=32, num_inference_steps=2,
                   generator=g, output_type="pt").frames
        assert out.shape == (1, 5, 3, 32, 32)
    else:
        out = pipe(prompt="a red circle", negative_prompt=" ", height=32, width=32, num_inference_steps=2,
                   generator=g, output_type="pt").images
        assert out.shape == (1, 3, 32, 32)
    assert torch.isfinite(out).all()


# ---- the rest of "everything works" -------------------------------------------------------------------
def test_wan_samples_are_clips_and_qwen_samples_are_images(tmp_path):
    sample = ["sample.every=1", "sample.steps=2", "sample.prompts=[a red circle]", "train.steps=1",
              "export.enabled=false"]
    train(tmp_path / "wan", "wan", *sample, "sample.guidance=1.0")
    step = tmp_path / "wan" / "samples" / "step-1"
    assert {p.suffix for p in step.iterdir()} >= {".png", ".gif", ".mp4"}
    from PIL import Image

    with Image.open(next(step.glob("*.gif"))) as im:
        assert im.n_frames == 5 and im.size == (64, 64)
    train(tmp_path / "qwen", "qwen_image", *sample)
    with Image.open(next((tmp_path / "qwen" / "samples" / "step-1").glob("*.png"))) as im:
        assert im.size == (64, 64)


@pytest.mark.parametrize("preset, extra", [
    ("qwen_image_24gb", []),
    ("wan_24gb", ["data.width=64", "data.height=48", "data.frames=5"]),
])
def test_presets_train_their_family_at_tiny_size(tmp_path, preset, extra):
    """nf4 base + LoRA, park with both caches, block checkpointing (and Wan's activation offload,
    a no-op on a CPU run): finite losses, an exported LoRA."""
    task(compose_config([f"+preset={preset}", *extra, *COMMON, "train.steps=2", f"output_dir={tmp_path}"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert (tmp_path / "checkpoints" / "step-00000002" / EXPORT_DIR / DIFFUSERS_FILE).is_file()


@pytest.mark.parametrize("overrides, match", [
    (["trainer=wan", "trainer.variant=14B"], r"Unknown trainer.variant '14B'.*14b"),
    (["trainer=wan", "data.frames=8"], r"data.frames=8 is not usable for Wan.*4k\+1.*5 or 9"),
    (["trainer=wan", "data.width=40"], r"data.width=40 is not usable for Wan 14b: .*multiple of 16"),
    (["trainer=wan", "trainer.variant=2.2-5b", "data.height=48"], r"data.height=48 .*multiple of 32"),
    (["trainer=wan", "sample.every=5", "sample.prompts=[a]", "sample.resolution=64"], r"Wan samples clips at"),
    (["trainer=qwen_image", "trainer.max_sequence_length=2000"], r"trainer.max_sequence_length=2000 is not valid"),
])
def test_bad_family_settings_are_user_errors(overrides, match):
    with pytest.raises(UserError, match=match):
        build_trainer(compose_config([*overrides, "train.device=cpu"]))


# ---- out of memory ------------------------------------------------------------------------------------
@dataclass
class _OneOOMConfig(PluginConfig):
    name: str = "test_family_oom"


@register_plugin
class _OneOOM(Plugin):
    """test only: the denoiser's first call with more than one sample raises a real OutOfMemoryError."""

    kind = "tiling"
    name = "test_family_oom"
    Config = _OneOOMConfig
    description = "test only"
    raised = 0

    def wrap_execution(self, ctx):
        module = ctx.models["transformer"]

        def maybe_raise(mod, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            if x.shape[0] > 1 and not type(self).raised:
                type(self).raised += 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

        handle = module.register_forward_pre_hook(maybe_raise, with_kwargs=True)
        ctx.hooks.add(module, "test_family_oom", self.key, handle=handle, undo=handle.remove)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_out_of_memory_split_equals_a_run_configured_that_way(tmp_path, family):
    """An OOM at micro-batch 2 in step 1 halves it and retries the step: the losses and trained weights
    are those of a run configured with micro-batch 1 from the start, bit for bit."""
    from safetensors.torch import load_file

    common = ["train.steps=2", "train.batch_size=2", "export.enabled=false", "train.preflight=false"]
    _OneOOM.raised = 0
    split = train(tmp_path / "split", family, *common, "tiling=test_family_oom")
    assert _OneOOM.raised == 1
    assert [r["micro_batch_size"] for r in split] == [1, 1] and split[0]["oom_retries"] == 1
    configured = train(tmp_path / "configured", family, *common, "train.grad_accum=2")
    assert [r["loss"] for r in split] == [r["loss"] for r in configured]
    ckpt = Path("checkpoints") / "step-00000002" / "trainable.safetensors"
    a, b = load_file(str(tmp_path / "split" / ckpt)), load_file(str(tmp_path / "configured" / ckpt))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_finetune_exports_a_pipeline_folder_diffusers_loads(tmp_path, family):
    """model.train=full with park dropping the encoders: export/diffusers is the family's pipeline with the
    trained transformer, the run's frozen modules (rebuilt) and its tokenizer."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    train(tmp_path, family, "train.steps=1", "offload=park")
    ckpt = tmp_path / "checkpoints" / "step-00000001"
    pipe = DiffusionPipeline.from_pretrained(str(ckpt / EXPORT_DIR / "diffusers"))
    trainer, base = fresh(family)
    assert type(pipe) is trainer.pipeline_class()
    trained = load_file(str(ckpt / "trainable.safetensors"))
    loaded = pipe.transformer.state_dict()
    for k, v in trained.items():
        torch.testing.assert_close(loaded[k.removeprefix("transformer.")], v, rtol=0, atol=0)
    for frozen in ("vae", "text_encoder"):
        for k, v in base[frozen].state_dict().items():
            torch.testing.assert_close(getattr(pipe, frozen).state_dict()[k], v, rtol=0, atol=0)
    assert pipe.tokenizer("a cat").input_ids == trainer.tokenizer("tokenizer")("a cat").input_ids
