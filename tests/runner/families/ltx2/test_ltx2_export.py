"""LTX-2's exported LoRAs: the diffusers file loads into ``LTX2Pipeline`` (``load_lora_weights``) and its fused
weights and prediction equal the runner's trained model's; the ComfyUI file has the original LTX-2 keys (as data)
and loads through diffusers' reader of that layout with the same result."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.export.checkpoint import EXPORT_DIR
from runner.export.comfy import COMFY_FILE
from runner.export.lora import DIFFUSERS_FILE
from runner.output.report import read_metrics
from runner.state.checkpoint import load_trainable_weights
from tests.runner.families.ltx2.test_ltx2 import fresh

pytestmark = pytest.mark.usefixtures("one_thread")
LORA = ["model.train=lora", "model.lora_rank=4", "model.lora_alpha=8"]
# The ComfyUI file (runner/export/comfy.py "ltx2"): ComfyUI's LTX-2 model has the original (ltx-core) module names,
# under diffusion_model.; diffusers' _convert_non_diffusers_ltx2_lora_to_diffusers documents them. diffusers module
# -> key. Block modules keep their names; alpha / rank is folded into B (that reader keeps no .alpha).
COMFY_KEYS = {"transformer_blocks.0.attn1.to_q": "diffusion_model.transformer_blocks.0.attn1.to_q",
              "transformer_blocks.1.audio_attn2.to_k": "diffusion_model.transformer_blocks.1.audio_attn2.to_k",
              "transformer_blocks.2.audio_to_video_attn.to_v":
                  "diffusion_model.transformer_blocks.2.audio_to_video_attn.to_v",
              "transformer_blocks.2.video_to_audio_attn.to_out.0":
                  "diffusion_model.transformer_blocks.2.video_to_audio_attn.to_out.0"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("ltx2_lora")
    task(compose_config(["trainer=ltx2", "train.device=cpu", "train.progress=false", "data.demo_size=2",
                         "train.steps=2", "optimizer.lr=0.01", "train.batch_size=1", "train.preflight=false",
                         f"output_dir={out}", *LORA]))
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    return out / "checkpoints" / "step-00000002"


def test_the_lora_loads_into_the_pipeline_with_the_runners_weights(trained: Path):
    trainer, models = fresh(*LORA, frozen=False)
    load_trainable_weights(trained, models)
    batch = trainer.example_batch(1, "cpu")
    t = torch.tensor([0.5])

    def denoise(transformer):
        with torch.no_grad():
            return trainer.predict_av({"transformer": transformer}, batch["latents"], batch["audio_latents"], t, batch)

    expected = denoise(models["transformer"])
    _, base = fresh()
    pipe = trainer.pipeline(base)
    before = denoise(pipe.transformer)
    pipe.load_lora_weights(str(trained / EXPORT_DIR / DIFFUSERS_FILE))
    after = denoise(pipe.transformer)
    assert (after[0] - before[0]).abs().max() > 1e-4 and (after[1] - before[1]).abs().max() > 1e-4
    for ours, theirs in zip(after, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    lora = models["transformer"].transformer_blocks[0].attn1.to_q
    merged = lora.base_layer.weight + lora.scaling["default"] * lora.lora_B["default"].weight @ lora.lora_A["default"].weight
    torch.testing.assert_close(pipe.transformer.transformer_blocks[0].attn1.to_q.weight, merged, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(denoise(pipe.transformer), expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_the_comfy_file_has_the_original_ltx2_keys_and_loads_alike(trained: Path):
    comfy = load_file(str(trained / EXPORT_DIR / COMFY_FILE))
    peft = load_file(str(trained / EXPORT_DIR / DIFFUSERS_FILE))
    assert not any(k.endswith(".alpha") for k in comfy) and all(k.startswith("diffusion_model.") for k in comfy)
    assert len(comfy) == len(peft)
    for module, key in COMFY_KEYS.items():
        a, b = peft[f"transformer.{module}.lora_A.weight"], peft[f"transformer.{module}.lora_B.weight"]
        assert torch.equal(comfy[f"{key}.lora_A.weight"], a)
        assert torch.equal(comfy[f"{key}.lora_B.weight"], b * (8 / 4))  # alpha 8 / rank 4 in B
    trainer, models = fresh(*LORA, frozen=False)
    load_trainable_weights(trained, models)
    batch = trainer.example_batch(1, "cpu")
    t = torch.tensor([0.5])
    with torch.no_grad():
        expected = trainer.predict_av(models, batch["latents"], batch["audio_latents"], t, batch)
        _, base = fresh()
        pipe = trainer.pipeline(base)
        pipe.load_lora_weights(str(trained / EXPORT_DIR / COMFY_FILE))
        got = trainer.predict_av({"transformer": pipe.transformer}, batch["latents"], batch["audio_latents"], t, batch)
    for ours, theirs in zip(got, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
