"""What the EMA gives a user: export files beside the trained ones, and samples drawn with it.

Tiny SDXL on CPU. The exported EMA files must load in diffusers (LoRA: ``load_lora_weights`` of
both layouts; full: ``DiffusionPipeline.from_pretrained``) and hold exactly the checkpoint's
``ema.safetensors`` values; ``mode=export`` of the checkpoint writes the same. Sampling with the
EMA weights must leave training bit-identical to a run that never sampled.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.utils import set_seed
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.ema.average import FILE
from runner.export.checkpoint import EXPORT_DIR, FULL_DIR
from runner.export.ema import FULL_EMA_DIR
from runner.export.lora import DIFFUSERS_EMA_FILE, DIFFUSERS_FILE, KOHYA_EMA_FILE
from runner.output.report import read_metrics
from runner.resolved import resolve

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = ["train.steps=2", "train.device=cpu", "train.progress=false", "train.preflight=false", "train.batch_size=1",
          "data.demo_size=2", "optimizer.lr=0.01", "ema.enabled=true", "ema.decay=0.5"]
LORA = ["model.train=lora", "model.lora_rank=4", "model.lora_alpha=8"]
CKPT = Path("checkpoints") / "step-00000002"


def train(out: Path, *overrides: str) -> list[dict]:
    task(compose_config([f"output_dir={out}", *COMMON, *overrides]))
    return read_metrics(out / "metrics.jsonl")


def fresh(*overrides: str):
    cfg = compose_config([*COMMON, *overrides])
    r = resolve(cfg)
    trainer = build_trainer(cfg, r)
    set_seed(r.seed)
    return trainer, prepare_models(trainer.build_models("cpu"), cfg.model, r)


def adapters(module) -> dict[str, torch.Tensor]:
    """lora_A/lora_B weights by module path, the adapter name dropped."""
    out = {}
    for name, p in module.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            parts = name.split(".")
            out[".".join(parts[:-2] + parts[-1:])] = p.detach().clone()
    return out


def unet_output(trainer, unet) -> torch.Tensor:
    b = trainer.example_batch(1, "cpu")
    with torch.no_grad():
        return unet(b["latents"], torch.tensor([500]), encoder_hidden_states=b["prompt_embeds"],
                    added_cond_kwargs={"text_embeds": b["pooled_prompt_embeds"], "time_ids": b["time_ids"]},
                    return_dict=False)[0]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ema-lora")
    train(out, *LORA)
    return out / CKPT


def test_lora_ema_files_load_in_diffusers_and_hold_the_average(lora_run):
    export = lora_run / EXPORT_DIR
    ema = {k.removeprefix("unet.").replace(".default.", "."): v for k, v in load_file(str(lora_run / FILE)).items()}
    trained = {k.removeprefix("unet.").replace(".default.", "."): v
               for k, v in load_file(str(lora_run / "trainable.safetensors")).items()}
    assert any(not torch.equal(ema[k], trained[k]) for k in ema)  # the average is not the weights
    trainer, base = fresh()
    pipe = trainer.pipeline(base)
    pipe.load_lora_weights(str(export / DIFFUSERS_EMA_FILE), adapter_name="ema")
    loaded = adapters(pipe.unet)
    assert loaded.keys() == ema.keys()
    assert all(torch.equal(loaded[k], ema[k]) for k in ema)
    with_ema = unet_output(trainer, pipe.unet)

    _, base2 = fresh()
    pipe2 = trainer.pipeline(base2)
    pipe2.load_lora_weights(str(export / KOHYA_EMA_FILE), adapter_name="ema_kohya")
    torch.testing.assert_close(unet_output(trainer, pipe2.unet), with_ema, rtol=1e-4, atol=1e-5)

    _, base3 = fresh()
    pipe3 = trainer.pipeline(base3)
    pipe3.load_lora_weights(str(export / DIFFUSERS_FILE), adapter_name="trained")
    assert (unet_output(trainer, pipe3.unet) - with_ema).abs().max() > 1e-6  # not the trained LoRA
    for name in (DIFFUSERS_EMA_FILE, KOHYA_EMA_FILE):
        with safe_open(str(export / name), framework="pt") as f:
            assert f.metadata()["weights"] == "ema" and f.metadata()["lora_alpha"] == "8.0"


def test_mode_export_of_the_checkpoint_writes_the_same_ema_files(lora_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(lora_run.parent.parent, copy)
    shutil.rmtree(copy / CKPT / EXPORT_DIR)
    task(compose_config([f"output_dir={tmp_path / 'job'}", "mode=export", f"train.resume={copy}", "train.device=cpu"]))
    for name in (DIFFUSERS_EMA_FILE, KOHYA_EMA_FILE):
        again, first = load_file(str(copy / CKPT / EXPORT_DIR / name)), load_file(str(lora_run / EXPORT_DIR / name))
        assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)


def test_full_finetune_exports_an_ema_pipeline_folder(tmp_path):
    from diffusers import DiffusionPipeline

    train(tmp_path)
    export = tmp_path / CKPT / EXPORT_DIR
    pipe = DiffusionPipeline.from_pretrained(str(export / FULL_EMA_DIR))
    ema = load_file(str(tmp_path / CKPT / FILE))
    unet = pipe.unet.state_dict()
    assert len(unet) == len(ema) and all(torch.equal(unet[k.removeprefix("unet.")], v) for k, v in ema.items())
    trained = DiffusionPipeline.from_pretrained(str(export / FULL_DIR))
    assert any(not torch.equal(trained.unet.state_dict()[k], v) for k, v in unet.items())
    for k, v in trained.vae.state_dict().items():  # the frozen modules are the same files, linked
        assert torch.equal(pipe.vae.state_dict()[k], v)
    a, b = export / FULL_DIR / "vae" / "config.json", export / FULL_EMA_DIR / "vae" / "config.json"
    assert os.stat(a).st_ino == os.stat(b).st_ino  # a hard link: no second copy on disk


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def test_sampling_with_the_average_leaves_training_bit_identical(tmp_path):
    sample = ["sample.every=1", "sample.prompts=[a cat]", "sample.steps=2", "sample.resolution=32"]
    plain = train(tmp_path / "plain")
    ema_samples = train(tmp_path / "ema", *sample, "sample.use_ema=true")
    trained_samples = train(tmp_path / "trained", *sample)
    assert [r["loss"] for r in ema_samples] == [r["loss"] for r in plain] == [r["loss"] for r in trained_samples]
    for name in ("trainable.safetensors", FILE):
        a, b = load_file(str(tmp_path / "plain" / CKPT / name)), load_file(str(tmp_path / "ema" / CKPT / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    image = Path("samples") / "step-2" / "00-a-cat.png"
    assert not np.array_equal(pixels(tmp_path / "ema" / image), pixels(tmp_path / "trained" / image))
    start = Path("samples") / "step-0" / "00-a-cat.png"  # at the start the average is the weights
    assert np.array_equal(pixels(tmp_path / "ema" / start), pixels(tmp_path / "trained" / start))
