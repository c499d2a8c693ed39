"""Krea 2 (runner/families/krea2/trainer.py) against diffusers' ``Krea2Pipeline``, on the tiny model (CPU, offline).

* the text conditioning is the pipeline's ``encode_prompt`` (fixed-length layout, real-token positions, the
  tapped layers stacked), bit for bit for a batch of captions of different lengths;
* ``predict`` is the pipeline's transformer call (2x2 packing, position ids, ``t / 1000``, the mask), bit for bit;
* 2 steps train; the exported LoRA loads into ``Krea2Pipeline`` (``load_lora_weights``) and its prediction, also
  fused, equals the runner's trained model's; the ComfyUI file's keys (as data) and its load through diffusers'
  reader of that layout; samples during training; the preset trains at tiny size.
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
from runner.families.krea2.trainer import Krea2Trainer
from runner.output.report import read_metrics
from runner.resolved import resolve
from runner.state.checkpoint import load_trainable_weights

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTIONS = ["a photo of a cat", "a red bicycle leaning on a wall, oil painting"]
# The ComfyUI file (runner/export/comfy.py "krea2"): the original krea-ai/krea-2 module names under diffusion_model.
# (diffusers' _convert_non_diffusers_krea2_lora_to_diffusers documents them as the reference trainer's and
# ComfyUI's layout; the ComfyUI source read here, Oct 2025, has no Krea 2 model), alpha / rank folded into B
# and no .alpha key (that reader refuses one). diffusers module -> key.
COMFY_KEYS = {"transformer_blocks.0.attn.to_q": "diffusion_model.blocks.0.attn.wq",
              "transformer_blocks.2.attn.to_out.0": "diffusion_model.blocks.2.attn.wo",
              "text_fusion.layerwise_blocks.0.attn.to_k": "diffusion_model.txtfusion.layerwise_blocks.0.attn.wk",
              "text_fusion.refiner_blocks.0.attn.to_v": "diffusion_model.txtfusion.refiner_blocks.0.attn.wv"}
COMMON = ["trainer=krea2", "train.device=cpu", "train.progress=false", "data.demo_size=2"]


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
    assert isinstance(trainer, Krea2Trainer)
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
        embeds, mask = trainer.pipeline(models).encode_prompt(CAPTIONS, device="cpu",
                                                              max_sequence_length=trainer.max_sequence_length)
    assert embeds.shape == (2, trainer.max_sequence_length, 2, 32)
    torch.testing.assert_close(ours["prompt_embeds"], embeds, rtol=0, atol=0)
    assert torch.equal(ours["prompt_embeds_mask"], mask)
    counts = mask.sum(dim=1).tolist()
    assert counts[0] < counts[1] < trainer.max_sequence_length and bool(mask[:, -1].all())  # the suffix is last


def test_predict_is_the_pipelines_transformer_call(built):
    trainer, models = built
    cond = encode_text(trainer, models, CAPTIONS[:1])
    pipe = trainer.pipeline(models)
    seen = {}

    def capture(module, args, kwargs, out):
        seen.update(x=kwargs["hidden_states"], t=kwargs["timestep"], out=out[0])

    handle = models["transformer"].register_forward_hook(capture, with_kwargs=True)
    try:
        pipe(prompt_embeds=cond["prompt_embeds"], prompt_embeds_mask=cond["prompt_embeds_mask"], guidance_scale=0.0,
             num_inference_steps=2, height=64, width=96, output_type="latent", generator=torch.Generator().manual_seed(0),
             max_sequence_length=trainer.max_sequence_length)
    finally:
        handle.remove()
    assert 0.0 < float(seen["t"][0]) < 1.0  # the second step
    latents = pipe._unpack_latents(seen["x"], 64, 96)[:, :, 0]
    assert torch.equal(trainer.pack(latents), seen["x"])
    with torch.no_grad():
        ours = trainer.predict(models, latents, seen["t"], cond)
    torch.testing.assert_close(ours, seen["out"], rtol=0, atol=0)


def test_two_steps_train_and_the_lora_loads_into_the_pipeline_with_the_runners_weights(tmp_path):
    lora = ["model.train=lora", "model.lora_rank=4", "model.lora_alpha=8"]
    rows = train(tmp_path, "train.steps=2", "optimizer.lr=0.01", "train.batch_size=1", *lora)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
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
    pipe.fuse_lora()
    torch.testing.assert_close(denoise(pipe.transformer), expected, rtol=1e-4, atol=1e-5)
    comfy = load_file(str(export / COMFY_FILE))
    peft = load_file(str(export / DIFFUSERS_FILE))
    assert not any(k.endswith(".alpha") for k in comfy)
    for module, key in COMFY_KEYS.items():
        a, b = peft[f"transformer.{module}.lora_A.weight"], peft[f"transformer.{module}.lora_B.weight"]
        assert torch.equal(comfy[f"{key}.lora_A.weight"], a)
        assert torch.equal(comfy[f"{key}.lora_B.weight"], b * (8 / 4))  # alpha 8 / rank 4 in B
    _, base = fresh()
    pipe = trainer.pipeline(base)
    pipe.load_lora_weights(str(export / COMFY_FILE))
    torch.testing.assert_close(denoise(pipe.transformer), expected, rtol=1e-4, atol=1e-5)


def test_samples_during_training(tmp_path):
    train(tmp_path, "sample.every=1", "sample.steps=2", "sample.prompts=[a red circle]", "train.steps=1",
          "export.enabled=false")
    from PIL import Image

    with Image.open(next((tmp_path / "samples" / "step-1").glob("*.png"))) as im:
        assert im.size == (64, 64)


@pytest.mark.parametrize("value", ["0", "5000"])
def test_a_bad_max_sequence_length_is_a_user_error(value):
    from runner.errors import UserError

    with pytest.raises(UserError, match=rf"trainer.max_sequence_length={value} is not valid"):
        build_trainer(compose_config(["trainer=krea2", f"trainer.max_sequence_length={value}", "train.device=cpu"]))
