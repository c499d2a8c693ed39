"""Chroma (runner/families/chroma/trainer.py) against diffusers' ``ChromaPipeline``, on the tiny model (CPU, offline).

* the text conditioning is what the pipeline's ``encode_prompt`` computes: T5 run with the
  tokenizer's mask, and Chroma's text mask (the caption plus its first padding token);
* the denoiser call is the pipeline's: one pipeline step with the trainer's embeddings gives the
  velocity ``predict`` gives for the same latents and timestep;
* a LoRA trains on the demo set with finite losses and exports the diffusers and kohya (ComfyUI) files;
* Chroma's original single file is recognised (not taken for Flux) and refused with what to give instead.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from accelerate.utils import set_seed
from safetensors.torch import save_file

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.export.checkpoint import EXPORT_DIR, INFO_FILE
from runner.export.lora import DIFFUSERS_FILE, KOHYA_FILE
from runner.families.chroma.trainer import ChromaTrainer
from runner.output.report import read_metrics
from runner.resolved import resolve

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTIONS = ["a photo of a cat", "a red bicycle leaning on a wall, oil painting"]


@pytest.fixture(scope="module")
def built():
    cfg = compose_config(["trainer=chroma", "train.device=cpu"])
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    assert isinstance(trainer, ChromaTrainer)
    set_seed(run.seed)
    models = prepare_models(trainer.build_models("cpu"), cfg.model, run)
    for m in models.modules.values():
        m.requires_grad_(False)
    return trainer, models


def test_text_conditioning_is_the_pipelines(built):
    trainer, models = built
    pipe = trainer.pipeline(models)
    ours = trainer.encode_part(models, "text", {"caption": CAPTIONS, "sample_seed": torch.zeros(2, dtype=torch.int64)})
    with torch.no_grad():
        embeds, _, mask, *_ = pipe.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                                 max_sequence_length=trainer.t5_max_length(), device="cpu")
    torch.testing.assert_close(ours["prompt_embeds"], embeds, rtol=0, atol=0)
    assert torch.equal(ours["prompt_attention_mask"], mask.bool())
    lengths = ours["prompt_attention_mask"].sum(dim=1)
    assert lengths[0] < lengths[1] < trainer.t5_max_length()  # caption + one padding token, not the padding


def test_predict_is_the_pipelines_transformer_call(built):
    """The velocity of one pipeline step (captured at the transformer's output) equals ``predict``
    on the same latents, timestep and embeddings: same packing, ids, mask and timestep scale."""
    trainer, models = built
    pipe = trainer.pipeline(models)
    cond = trainer.encode_part(models, "text", {"caption": CAPTIONS[:1], "sample_seed": torch.zeros(1, dtype=torch.int64)})
    seen = {}

    def capture(module, args, kwargs, out):
        seen.update(hidden=kwargs["hidden_states"], t=kwargs["timestep"], out=out[0])

    handle = models["transformer"].register_forward_hook(capture, with_kwargs=True)
    try:
        pipe(prompt_embeds=cond["prompt_embeds"], prompt_attention_mask=cond["prompt_attention_mask"].float(),
             num_inference_steps=1, guidance_scale=1.0, height=64, width=64, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    latents = pipe._unpack_latents(seen["hidden"], 64, 64, pipe.vae_scale_factor)
    with torch.no_grad():
        ours = trainer.predict(models, latents, seen["t"], cond)
    torch.testing.assert_close(ours, seen["out"], rtol=1e-5, atol=1e-6)


def test_a_lora_trains_on_the_demo_set_and_exports_both_files(tmp_path):
    task(compose_config([f"output_dir={tmp_path}", "trainer=chroma", "model.train=lora", "model.lora_rank=4",
                         "train.steps=4", "train.device=cpu", "train.progress=false", "train.batch_size=2",
                         "data.demo_size=4", "optimizer.lr=1e-2"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["nonfinite_skips"] == 0 for r in rows)
    export = tmp_path / "checkpoints" / "step-00000004" / EXPORT_DIR
    assert json.loads((export / INFO_FILE).read_text())["files"] == [DIFFUSERS_FILE, KOHYA_FILE]


def test_an_original_chroma_file_is_refused_naming_what_loads(tmp_path):
    file = tmp_path / "chroma-unlocked-v50.safetensors"
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2),
               "distilled_guidance_layer.in_proj.bias": torch.zeros(2)}, str(file))
    with pytest.raises(UserError, match=r"original Chroma layout.*trainer=chroma does not read.*diffusers folder"):
        build_trainer(compose_config(["trainer=chroma", f"model.path={file}", "train.device=cpu"]))
    with pytest.raises(UserError, match=r"original Chroma layout.*not a flux checkpoint"):
        build_trainer(compose_config(["trainer=flux", f"model.path={file}", "train.device=cpu"]))
