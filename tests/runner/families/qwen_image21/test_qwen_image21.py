"""Qwen-Image 2.1 (runner/families/qwen_image21/trainer.py) against diffusers' ``QwenImage21Pipeline``, on the tiny
model (CPU, offline).

* the text conditioning is the pipeline's ``encode_prompt`` (template, Qwen3-VL's pre-norm last hidden state,
  the system line dropped), bit for bit for one prompt;
* ``predict`` is the pipeline's transformer call (unpacked tokens, ``t / 1000``, the target's tokens of the
  joint output): one pipeline step's prediction equals ``predict``, bit for bit, also inside a batch whose
  captions differ in length (the padding is cut per caption length);
* 2 steps train; the exported LoRA loads into ``QwenImage21Pipeline`` (``load_lora_weights``) and its fused
  prediction equals the runner's trained model's; samples during training; the preset trains at tiny size.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed
from safetensors.torch import load_file

from runner_setup import prepared_context

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.loop import train as train_loop
from runner.export.checkpoint import EXPORT_DIR
from runner.export.comfy import COMFY_FILE
from runner.export.lora import DIFFUSERS_FILE
from runner.families.qwen_image21.trainer import QwenImage21Trainer
from runner.output.report import read_metrics
from runner.resolved import resolve
from runner.state.checkpoint import load_trainable_weights

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTIONS = ["a photo of a cat", "a red bicycle leaning on a wall, oil painting"]
# The ComfyUI file's layout (runner/export/comfy.py "qwen_image"): ComfyUI's generic diffusion_model.<module>
# keys with diffusers' module names and .alpha (None: present, any value). The ComfyUI source read here (Oct
# 2025) has no Qwen-Image 2.1 model, so that its module names are diffusers' is assumed, as for Qwen-Image.
COMFY_KEYS = {"diffusion_model.transformer_blocks.0.attn.to_q.lora_A.weight": None,
              "diffusion_model.transformer_blocks.2.attn.to_out.0.lora_B.weight": None,
              "diffusion_model.transformer_blocks.1.attn.to_k.alpha": 8.0}
COMMON = ["trainer=qwen_image21", "train.device=cpu", "train.progress=false", "data.demo_size=2"]


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
    assert isinstance(trainer, QwenImage21Trainer)
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
    pipe = trainer.pipeline(models)
    assert pipe._drop_idx == trainer.system_tokens()
    counts = ours["prompt_embeds_mask"].sum(dim=1).tolist()
    assert counts[0] < counts[1] < trainer.max_sequence_length
    for i, caption in enumerate(CAPTIONS):
        with torch.no_grad():
            embeds, mask, image_slots = pipe.encode_prompt(caption, device="cpu")
        assert mask is None and not image_slots.any()  # one prompt: nothing padded, no image
        assert embeds.shape[1] == counts[i]
        torch.testing.assert_close(ours["prompt_embeds"][i, :counts[i]], embeds[0], rtol=0, atol=0)
        assert not ours["prompt_embeds"][i, counts[i]:].any()


def pipeline_step(trainer, models, embeds):
    """The pipeline's second step on ``embeds`` (one unpadded prompt; t < 1), its KV cache off (training runs the whole
    sequence): the transformer's input and its prediction of the target's tokens."""
    pipe = trainer.pipeline(models)
    seen = {}

    def capture(module, args, kwargs, out):
        seen.update(x=kwargs["hidden_states"], t=kwargs["timestep"], out=out[0][:, -kwargs["hidden_states"].shape[1]:])

    handle = models["transformer"].register_forward_hook(capture, with_kwargs=True)
    try:
        pipe(prompt_embeds=embeds, num_inference_steps=2, height=64, width=96, output_type="latent",
             use_kv_cache=False, generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    return seen


def test_predict_is_the_pipelines_transformer_call_also_in_a_batch_of_two_lengths(built):
    trainer, models = built
    cond = encode_text(trainer, models, CAPTIONS)
    counts = cond["prompt_embeds_mask"].sum(dim=1).tolist()
    steps = [pipeline_step(trainer, models, cond["prompt_embeds"][i:i + 1, :counts[i]]) for i in range(2)]
    h, w = 64 // 16, 96 // 16
    noisy = torch.cat([s["x"] for s in steps]).transpose(1, 2).reshape(2, -1, h, w)
    t = torch.cat([s["t"] for s in steps])
    assert 0.0 < float(t[0]) < 1.0
    with torch.no_grad():
        alone = [trainer.predict(models, noisy[i:i + 1], t[i:i + 1],
                                 {k: v[i:i + 1] for k, v in cond.items()}) for i in range(2)]
        together = trainer.predict(models, noisy, t, cond)
    for i in range(2):
        torch.testing.assert_close(alone[i], steps[i]["out"], rtol=0, atol=0)
        torch.testing.assert_close(together[i:i + 1], steps[i]["out"], rtol=0, atol=0)


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
    # The ComfyUI file: diffusers' names under diffusion_model. with the trained alpha (COMFY_KEYS); diffusers'
    # own reader of that layout (QwenImageLoraLoaderMixin's, which QwenImage21Pipeline has) gives the same model.
    comfy = load_file(str(export / COMFY_FILE))
    for key, value in COMFY_KEYS.items():
        assert key in comfy, key
        if value is not None:
            assert float(comfy[key]) == value
    _, base = fresh()
    pipe = trainer.pipeline(base)
    pipe.load_lora_weights(str(export / COMFY_FILE))
    torch.testing.assert_close(denoise(pipe.transformer), expected, rtol=1e-4, atol=1e-5)


def test_samples_during_training(tmp_path):
    train(tmp_path, "sample.every=1", "sample.steps=2", "sample.prompts=[a red circle]", "train.steps=1",
          "export.enabled=false")
    from PIL import Image

    with Image.open(next((tmp_path / "samples" / "step-1").glob("*.png"))) as im:
        assert im.size == (64, 64) and im.mode == "RGB"


@pytest.mark.parametrize("value", ["0", "5000"])
def test_a_bad_max_sequence_length_is_a_user_error(value):
    with pytest.raises(UserError, match=rf"trainer.max_sequence_length={value} is not valid"):
        build_trainer(compose_config(["trainer=qwen_image21", f"trainer.max_sequence_length={value}",
                                      "train.device=cpu"]))


def test_an_out_of_memory_step_retried_in_halves_equals_a_run_configured_so(tmp_path):
    """A real ``torch.OutOfMemoryError`` while the step's micro-batch holds 2 samples (raised in ``predict``: the
    transformer itself sees one caption length per call), retried in halves: the losses of a run with
    ``train.grad_accum=2`` from the start, bit for bit."""
    def run_with(out: Path, *overrides: str, oom: bool) -> list[float]:
        ctx = prepared_context(out, *COMMON, "train.steps=2", "train.preflight=false", "export.enabled=false",
                               *overrides)
        ctx.apply_setup_phases()
        predict = ctx.trainer.predict

        def raise_while_two(models, noisy, t, batch):
            if len(noisy) > 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            return predict(models, noisy, t, batch)

        if oom:
            ctx.trainer.predict = raise_while_two
        try:
            return train_loop(ctx).losses
        finally:
            ctx.teardown()

    split = run_with(tmp_path / "oom", oom=True)
    assert split == run_with(tmp_path / "accum", "train.grad_accum=2", oom=False) and len(split) == 2
    rows = read_metrics(tmp_path / "oom" / "metrics.jsonl")
    assert rows[0]["micro_batch_size"] == 1 and rows[0]["oom_retries"] == 1
