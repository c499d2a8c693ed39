"""HunyuanVideo 1.5 (runner/families/hunyuan_video15/trainer.py) against diffusers' ``HunyuanVideo15Pipeline``, on the
tiny model (CPU, offline).

* the text conditioning is the pipeline's ``encode_prompt`` (Qwen2.5-VL in the system template, the glyph ByT5 of
  quoted text, both masks), bit for bit for a batch of captions with and without quoted text;
* ``predict`` is the pipeline's transformer call (65 input channels, zero image embedding, ``1000 t``), bit for bit;
* the latents are the VAE's posterior times ``scaling_factor``, the loss the flow-matching family's with the fixed
  shift; the planner answers the transformer's zero-image read;
* 2 steps train; the exported LoRA loads into the pipeline (``load_lora_weights``) with the runner's weights, also
  fused; the ComfyUI file's keys (as data); samples during training; the preset trains at tiny size.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed
from safetensors.torch import load_file

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.export.checkpoint import EXPORT_DIR
from runner.export.comfy import COMFY_FILE
from runner.export.lora import DIFFUSERS_FILE
from runner.families.hunyuan_video15.trainer import HunyuanVideo15Trainer
from runner.families.hunyuan_video15.vae_mask import frame_causal_mask, use_frame_causal_masks
from runner.output.report import read_metrics
from runner.resolved import resolve
from runner.state.checkpoint import load_trainable_weights

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTIONS = ["a photo of a cat", 'a shop door with a sign that reads "OPEN", oil painting']
COMMON = ["trainer=hunyuan_video15", "train.device=cpu", "train.progress=false", "data.demo_size=2"]


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def train(out: Path, *overrides: str) -> list[dict]:
    task(compose_config([*COMMON, f"output_dir={out}", *overrides]))
    return read_metrics(out / "metrics.jsonl")


def fresh(*overrides: str, frozen: bool = True):
    cfg = compose_config([*COMMON, *overrides])
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    assert isinstance(trainer, HunyuanVideo15Trainer)
    set_seed(run.seed)
    models = prepare_models(trainer.build_models("cpu"), cfg.model, run)
    for m in models.modules.values() if frozen else ():
        m.requires_grad_(False)
    return trainer, models


@pytest.fixture(scope="module")
def built():
    return fresh()


def encode_text(trainer, models, captions):
    return trainer.encode_part(models, "text", {"caption": list(captions),
                                                "sample_seed": torch.zeros(len(captions), dtype=torch.int64)})


def test_text_conditioning_is_the_pipelines(built):
    trainer, models = built
    ours = encode_text(trainer, models, CAPTIONS)
    with torch.no_grad():
        embeds, mask, embeds_2, mask_2 = trainer.pipeline(models).encode_prompt(CAPTIONS, device="cpu", batch_size=2)
    assert embeds.shape == (2, trainer.max_sequence_length, 32) and embeds_2.shape == (2, 256, 32)
    for key, theirs in (("prompt_embeds", embeds), ("prompt_embeds_2", embeds_2)):
        torch.testing.assert_close(ours[key], theirs, rtol=0, atol=0)
    assert torch.equal(ours["prompt_embeds_mask"], mask.bool())
    assert torch.equal(ours["prompt_embeds_mask_2"], mask_2.bool())
    counts = mask.sum(dim=1).tolist()
    assert 0 < counts[0] < counts[1] < trainer.max_sequence_length
    glyphs = mask_2.sum(dim=1).tolist()  # ByT5 reads only quoted text: none in the first caption
    assert glyphs[0] == 0 and glyphs[1] > 0 and not ours["prompt_embeds_2"][0].any()


def test_predict_is_the_pipelines_transformer_call(built):
    from diffusers import FlowMatchEulerDiscreteScheduler

    trainer, models = built
    cond = encode_text(trainer, models, CAPTIONS)
    pipe = trainer.pipeline(models)
    # shift 1 and sigma 0.75: the pipeline's timestep is 750 exactly, which t = 0.75 gives back as 1000 t
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    seen = {}

    def capture(module, args, kwargs, out):
        seen.update(x=kwargs["hidden_states"], t=kwargs["timestep"], out=out[0])

    handle = models["transformer"].register_forward_hook(capture, with_kwargs=True)
    try:
        pipe.guider.disable()
        pipe(**{k: v for k, v in cond.items()}, sigmas=[0.75], num_inference_steps=1, height=32, width=48,
             num_frames=5, output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    assert seen["x"].shape == (2, 9, 2, 2, 3) and float(seen["t"][0]) == 750.0
    latents = seen["x"][:, :4]
    with torch.no_grad():
        ours = trainer.predict(models, latents, torch.full((2,), 0.75), cond)
    torch.testing.assert_close(ours, seen["out"], rtol=0, atol=0)


def test_latents_and_loss(built):
    trainer, models = built
    pixels = torch.rand(1, 3, 5, 32, 48) * 2 - 1
    batch = {"pixel_values": pixels, "caption": CAPTIONS[:1], "sample_seed": torch.tensor([3])}
    encoded = trainer.encode(models, batch)
    dist = models["vae"].encode(pixels).latent_dist
    assert encoded["latents"].shape == (1, 4, 2, 2, 3)
    torch.testing.assert_close(encoded["latents"] / 1.03682, dist.mean, rtol=0, atol=float(dist.std.max()) * 6)
    assert trainer.loss_options.shift == 5.0  # loss.shift left unset: the 480p model's shift, not the schema's 3.0
    t = trainer.timesteps(torch.arange(4096))  # logit-normal, then the fixed shift s t / (1 + (s - 1) t), s = 5
    assert 0.5 < float(t.median()) < 0.9
    loss = trainer.loss(models, encoded)
    assert loss.ndim == 0 and math.isfinite(float(loss))


@pytest.mark.parametrize("n_frame,n_hw,batch", [(1, 6, None), (2, 5, 2), (4, 12, None)])
def test_the_frame_causal_mask_is_diffusers_mask(n_frame, n_hw, batch):
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock

    ours = frame_causal_mask(n_frame, n_hw, torch.bfloat16, "cpu", batch)
    theirs = HunyuanVideo15AttnBlock.prepare_causal_attention_mask(n_frame, n_hw, torch.bfloat16, "cpu", batch)
    assert torch.equal(ours, theirs) and ours.stride() == theirs.stride()


def test_the_built_vae_uses_it_and_encodes_as_diffusers_class_does(built):
    """Every attention block of the built VAE makes its mask a frame at a time; the posterior is bit for bit the
    one the class's own per-row mask gives."""
    _, models = built
    vae = models["vae"]
    blocks = [m for m in vae.modules() if hasattr(type(m), "prepare_causal_attention_mask")]
    assert blocks and all(m.prepare_causal_attention_mask is frame_causal_mask for m in blocks)
    pixels = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    ours = vae.encode(pixels).latent_dist.mean
    for m in blocks:
        del m.prepare_causal_attention_mask
    try:
        theirs = vae.encode(pixels).latent_dist.mean
    finally:
        use_frame_causal_masks(vae)
    assert torch.equal(ours, theirs)


def test_two_steps_train_and_the_lora_loads_into_diffusers_with_the_runners_weights(tmp_path):
    """HunyuanVideo15Pipeline has no load_lora_weights in diffusers 0.42.1: the file is read as a transformer-only
    pipeline's loader reads it (``lora_state_dict`` with its adapter metadata, then the transformer's own
    ``load_lora_adapter``), then fused (``fuse_lora``)."""
    from diffusers.loaders.lora_pipeline import HunyuanVideoLoraLoaderMixin

    lora = ["model.train=lora", "model.lora_rank=4", "model.lora_alpha=8"]
    rows = train(tmp_path, "train.steps=2", "optimizer.lr=0.01", "train.batch_size=1", *lora)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    step = tmp_path / "checkpoints" / "step-00000002"
    trainer, trained = fresh(*lora, frozen=False)
    load_trainable_weights(step, trained)
    batch = trainer.example_batch(1, "cpu")
    t = torch.tensor([0.5])

    def denoise(transformer):
        with torch.no_grad():
            return trainer.predict({"transformer": transformer}, batch["latents"], t, batch)

    expected = denoise(trained["transformer"])
    _, base = fresh()
    transformer = base["transformer"]
    before = denoise(transformer)
    state, metadata = HunyuanVideoLoraLoaderMixin.lora_state_dict(str(step / EXPORT_DIR / DIFFUSERS_FILE),
                                                                   return_lora_metadata=True)
    transformer.load_lora_adapter(state, prefix="transformer", metadata=metadata)
    after = denoise(transformer)
    assert (after - before).abs().max() > 1e-4
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-5)
    transformer.fuse_lora()
    torch.testing.assert_close(denoise(transformer), expected, rtol=1e-4, atol=1e-5)
    comfy = load_file(str(step / EXPORT_DIR / COMFY_FILE))
    assert "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight" in comfy  # q/k/v fused (test_comfy_apply.py)


@pytest.mark.parametrize("override,match", [("data.frames=6", "data.frames=6 is not usable"),
                                            ("data.width=40", "data.width=40 is not usable"),
                                            ("trainer.max_sequence_length=0", "trainer.max_sequence_length=0 is not")])
def test_bad_settings_are_user_errors(override, match):
    from runner.errors import UserError

    with pytest.raises(UserError, match=match):
        build_trainer(compose_config([*COMMON, override]))


def test_tiling_vae_tiles_the_hunyuan_video15_vae(built):
    """tiling=vae sets HunyuanVideo 1.5's own tiling attributes (tile sides, latent twins, overlap factor); the tiled
    encode gives the whole encode's shape, and restore puts the VAE back."""
    from runner.plugins.tiling import apply_vae_tiling, is_tileable_vae

    vae = built[1]["vae"]
    assert is_tileable_vae(vae)
    pixels = torch.rand(1, 3, 5, 64, 64) * 2 - 1
    with torch.no_grad():
        whole = vae.encode(pixels).latent_dist.mean
        restore = apply_vae_tiling(vae, tile_size=32, overlap=16)
        try:
            assert (vae.use_tiling, vae.tile_sample_min_height, vae.tile_latent_min_width) == (True, 32, 2)
            assert vae.tile_overlap_factor == 0.5
            tiled = vae.encode(pixels).latent_dist.mean
        finally:
            restore()
    assert tiled.shape == whole.shape and not torch.equal(tiled, whole)  # tiles normalise on their own
    assert not vae.use_tiling and vae.tile_sample_min_height == 256


def test_samples_during_training(tmp_path):
    train(tmp_path, "sample.every=1", "sample.steps=2", 'sample.prompts=["a sign that reads \\"hi\\""]',
          "train.steps=1",
          "export.enabled=false")
    from PIL import Image

    png = next((tmp_path / "samples" / "step-1").glob("*.png"))
    with Image.open(png) as im, Image.open(png.with_suffix(".gif")) as gif:
        assert im.size == (64, 64) and gif.n_frames == 5  # the training clip's size and frames


def test_the_preset_trains_two_tiny_steps(tmp_path):
    """hunyuan_video15_24gb at model.size=tiny (its clip shape is full-size only): nf4 base, park, offloaded block
    inputs, block checkpointing and the tiled VAE together, 2 steps."""
    task(compose_config(["+preset=hunyuan_video15_24gb", "train.device=cpu", "train.progress=false", "train.steps=2",
                         "data.demo_size=2", f"output_dir={tmp_path}"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)


def test_planned_peak_of_the_tiny_lora_matches_a_real_cpu_step():
    """The joint attention's (B, 1, L, L) boolean mask reaches the CPU's flash kernel as the float mask SDPA's entry
    makes of it, kept for backward in each block (runner/memory/semantics.py): planned as a boolean one, the plan
    was 1.5x under the real step."""
    from planner_truth import assert_plan_matches_a_real_cpu_step

    assert_plan_matches_a_real_cpu_step(compose_config(["trainer=hunyuan_video15", "model.train=lora",
                                                        "train.device=cpu"]))
