"""HiDream-I1 (runner/families/hidream/trainer.py) against diffusers' ``HiDreamImagePipeline``, on the tiny model (CPU, offline).

* the text conditioning is the pipeline's ``encode_prompt`` (pooled CLIP pair, T5, every Llama layer), bit for bit;
* ``predict`` is the pipeline's transformer call with its conventions (timestep ``1000 t``, output the
  negative velocity), in eval mode and in train mode (the experts' training path, the patch layout);
* a 2-step LoRA run exports a file that ``HiDreamImagePipeline.load_lora_weights`` loads (the diffusers
  file) with the trained LoRA's fused weights; the planner's peak agrees with a real CPU step; the
  full-size configs have the published sizes; the preset trains at tiny size.
"""
from __future__ import annotations

import math

import pytest
import torch
from accelerate.utils import set_seed
from peft.tuners.lora import LoraLayer
from planner_truth import assert_plan_matches_a_real_cpu_step

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.errors import UserError
from runner.export.checkpoint import EXPORT_DIR
from runner.export.comfy import COMFY_FILE
from runner.export.lora import DIFFUSERS_FILE
from runner.families.hidream.trainer import HiDreamTrainer
from runner.output.report import read_metrics
from runner.resolved import resolve
from runner.state.checkpoint import load_trainable_weights

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTIONS = ["a photo of a cat", "a red bicycle leaning on a wall, oil painting"]
COMMON = ["trainer=hidream", "train.device=cpu", "train.progress=false", "data.demo_size=2"]
LORA = ["model.train=lora", "model.lora_rank=4", "model.lora_alpha=8",
        "model.lora_targets=[to_q,to_k,to_v,to_out,to_q_t,to_out_t]"]


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def fresh(*overrides: str, frozen: bool = True):
    """(trainer, models) built as a run builds them (same seed); ``frozen``: no gradients anywhere."""
    cfg = compose_config([*COMMON, *overrides])
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    assert isinstance(trainer, HiDreamTrainer)
    set_seed(run.seed)
    models = prepare_models(trainer.build_models("cpu"), cfg.model, run)
    for m in models.modules.values() if frozen else ():
        m.requires_grad_(False)
    return trainer, models


@pytest.fixture(scope="module")
def built():
    return fresh()


def text(trainer, models):
    return trainer.encode_part(models, "text", {"caption": list(CAPTIONS), "sample_seed": torch.zeros(2, dtype=torch.int64)})


def test_full_size_configs_have_the_published_sizes():
    from runner.families.common.loading import build_module

    trainer = build_trainer(compose_config(["trainer=hidream", "model.size=full"]))

    def count(name):
        cls = trainer.module_classes()[name]
        return sum(p.numel() for p in build_module(cls, trainer.size_configs()[name], "meta", torch.bfloat16).parameters())

    assert 16.5e9 < count("transformer") < 17.5e9  # HiDream-I1: "17 B"
    assert count("text_encoder_4") == 8_030_261_248  # Llama-3.1-8B
    assert count("vae") == 83_819_683  # FLUX.1's VAE


def test_text_conditioning_is_the_pipelines(built):
    trainer, models = built
    ours = text(trainer, models)
    with torch.no_grad():
        t5, _, llama, _, pooled, _ = trainer.pipeline(models).encode_prompt(
            prompt=list(CAPTIONS), prompt_2=None, prompt_3=None, prompt_4=None, do_classifier_free_guidance=False,
            device="cpu")
    torch.testing.assert_close(ours["pooled_prompt_embeds"], pooled, rtol=0, atol=0)
    torch.testing.assert_close(ours["prompt_embeds_t5"], t5, rtol=0, atol=0)
    torch.testing.assert_close(ours["prompt_embeds_llama3"].transpose(0, 1), llama, rtol=0, atol=0)
    assert llama.shape[0] == 2 and ours["prompt_embeds_t5"].shape[1] == 128  # every Llama layer; 128 tokens


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_predict_is_the_pipelines_transformer_call(built, mode):
    trainer, models = built
    cond = text(trainer, models)
    transformer = models["transformer"].eval()
    pipe = trainer.pipeline(models)
    pipe.default_sample_size = 64 // pipe.vae_scale_factor  # the pipeline rescales any size to this area
    seen = {}

    def capture(module, args, kwargs, out):
        seen.update(x=kwargs["hidden_states"], t=kwargs["timesteps"], out=out[0])

    handle = transformer.register_forward_hook(capture, with_kwargs=True)
    try:
        pipe(pooled_prompt_embeds=cond["pooled_prompt_embeds"], prompt_embeds_t5=cond["prompt_embeds_t5"],
             prompt_embeds_llama3=cond["prompt_embeds_llama3"].transpose(0, 1), guidance_scale=1.0,
             num_inference_steps=2, height=64, width=64, output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    sigma = seen["t"] / 1000  # the pipeline passes the scheduler's timesteps
    assert seen["x"].shape[-2:] == (8, 8)
    assert 0.0 < float(sigma[0]) < 1.0
    transformer.train(mode == "train")
    try:
        with torch.no_grad():
            ours = trainer.predict(models, seen["x"], sigma, cond)
    finally:
        transformer.eval()
    exact = {"rtol": 1e-5, "atol": 1e-6} if mode == "eval" else {"rtol": 1e-4, "atol": 1e-5}  # experts summed in another order
    torch.testing.assert_close(ours, -seen["out"], **exact)


def test_a_lora_trains_two_steps_and_loads_into_the_pipeline_with_its_fused_weights(tmp_path):
    task(compose_config([*COMMON, f"output_dir={tmp_path}", "train.steps=2", "optimizer.lr=0.01",
                         "train.batch_size=1", *LORA]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    trainer, trained = fresh(*LORA, frozen=False)
    load_trainable_weights(ckpt, trained)
    layers = {n: m for n, m in trained["transformer"].named_modules() if isinstance(m, LoraLayer)}
    fused = {n: (m.get_base_layer().weight + m.get_delta_weight("default")).detach() for n, m in layers.items()}
    assert max(float(m.lora_B["default"].weight.detach().abs().max()) for m in layers.values()) > 0  # trained
    # The ComfyUI file (.alpha keys, which diffusers' HiDream reader refuses) is applied as ComfyUI does in
    # tests/runner/export/test_comfy_apply.py.
    assert (ckpt / EXPORT_DIR / COMFY_FILE).is_file()
    _, base = fresh()
    pipe = trainer.pipeline(base)
    pipe.load_lora_weights(str(ckpt / EXPORT_DIR / DIFFUSERS_FILE), adapter_name="x")
    pipe.fuse_lora(components=["transformer"], adapter_names=["x"])
    got = dict(pipe.transformer.named_modules())
    assert set(layers) <= set(got) and len(layers) == 2 * 6 + 2 * 4  # double blocks: 6 targets; single: q, k, v, out
    for name, weight in fused.items():
        module = got[name]
        w = module.get_base_layer().weight if isinstance(module, LoraLayer) else module.weight
        torch.testing.assert_close(w, weight, rtol=1e-5, atol=1e-6, msg=name)


def test_samples_during_training(tmp_path):
    """HiDreamImagePipeline fed the trainer's embeddings (and an empty negative prompt's: CFG 5.0)."""
    task(compose_config([*COMMON, f"output_dir={tmp_path}", "sample.every=1", "sample.steps=2",
                         "sample.prompts=[a red circle]", "train.steps=1", "export.enabled=false"]))
    from PIL import Image

    with Image.open(next((tmp_path / "samples" / "step-1").glob("*.png"))) as im:
        assert im.size == (64, 64) and len(set(im.getdata())) > 1  # decoded, not a blank image


@pytest.mark.parametrize("extra", [[], ["model.train=lora", "checkpoint=blocks"]], ids=["full", "lora-ckpt"])
def test_planned_peak_matches_a_real_cpu_step(extra):
    """The planner runs the experts' balanced split (runner/families/hidream/experts.py); the real step
    routes by the gate's values: the same routed-token total, so the peak agrees within 5 %."""
    cfg = compose_config([*COMMON, "data.resolution=128", *extra])
    validate(cfg)
    assert_plan_matches_a_real_cpu_step(cfg)


def test_buckets_above_the_transformers_padded_size_are_refused():
    """A non-square image is padded to max_resolution's tokens (tiny: 32 latent px, 256 px): larger buckets
    would not fit, so they are refused before step 1, naming the keys."""
    with pytest.raises(UserError, match=r"data.resolution=512 with data.buckets=true .*data.resolution<=256"):
        build_trainer(compose_config([*COMMON, "data.resolution=512", "data.buckets=true"]))
    build_trainer(compose_config([*COMMON, "data.resolution=256", "data.buckets=true"]))
    build_trainer(compose_config([*COMMON, "data.resolution=512"]))  # square crops: no padding


def test_the_preset_trains_at_tiny_size(tmp_path):
    task(compose_config(["+preset=hidream_24gb", *COMMON[1:], "train.steps=2", f"output_dir={tmp_path}"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    export = tmp_path / "checkpoints" / "step-00000002" / EXPORT_DIR
    assert (export / DIFFUSERS_FILE).is_file() and (export / COMFY_FILE).is_file()
