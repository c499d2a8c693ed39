"""DoRA (``model.lora_dora=true``): trains, and its diffusers file loads back into a fresh pipeline.

Each family trains two steps of a tiny model on CPU with a learning rate that moves the DoRA
magnitude away from its initial value (the base weight's row norms), then the exported
``pytorch_lora_weights.safetensors``, loaded with ``pipe.load_lora_weights``, must hold the trained
``lora_magnitude_vector`` values and make the denoiser compute what the trained model computes.
A loader that dropped the magnitude (plain LoRA over the same A/B) would compute something else.
The kohya/ComfyUI layouts are refused before step 1 (runner/export/config.py says why).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_training import built_as_run

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.checks import check_config, validate
from runner.errors import UserError
from runner.export.checkpoint import EXPORT_DIR, INFO_FILE
from runner.export.lora import DIFFUSERS_FILE
from runner.state.checkpoint import load_trainable_weights

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 2
COMMON = [f"train.steps={STEPS}", "train.device=cpu", "train.progress=false", "train.batch_size=1",
          "data.demo_size=2", "optimizer.lr=0.01"]
DORA = ["model.train=lora", "model.lora_rank=4", "model.lora_alpha=8", "model.lora_dora=true"]
MAGNITUDE = "lora_magnitude_vector"


def fresh(family: str, *overrides: str):
    """(trainer, models) built as the run built them (same seed)."""
    return built_as_run([f"trainer={family}", *COMMON, *overrides])


def denoise(trainer, denoiser) -> torch.Tensor:
    batch = trainer.example_batch(1, "cpu")
    t = torch.tensor([500]) if trainer.objective == "ddpm" else torch.tensor([0.5])
    with torch.no_grad():
        return trainer.predict({trainer.denoiser: denoiser}, batch["latents"], t, batch)


def magnitudes(module) -> dict[str, torch.Tensor]:
    """DoRA magnitudes by module path (adapter name dropped)."""
    return {name.split(f".{MAGNITUDE}.")[0]: p.detach().clone()
            for name, p in module.named_parameters() if f".{MAGNITUDE}." in name}


@pytest.mark.parametrize("family", ["sdxl", "flux", "sd15", "sd35"])
def test_dora_export_loads_in_diffusers_with_the_trained_magnitudes(tmp_path, family):
    task(compose_config([f"output_dir={tmp_path}", f"trainer={family}", *COMMON, *DORA]))
    ckpt = tmp_path / "checkpoints" / f"step-{STEPS:08d}"
    export = ckpt / EXPORT_DIR
    assert json.loads((export / INFO_FILE).read_text())["files"] == [DIFFUSERS_FILE]  # no kohya/comfy file
    keys = list(load_file(str(export / DIFFUSERS_FILE)))
    assert any(MAGNITUDE in k for k in keys) and any(".lora_A." in k for k in keys)

    trainer, trained = fresh(family, *DORA)
    untrained = magnitudes(trained[trainer.denoiser])
    load_trainable_weights(ckpt, trained)
    name = trainer.denoiser
    want = magnitudes(trained[name])
    assert want and any((want[k] - untrained[k]).abs().max() > 1e-4 for k in want)  # training moved them
    expected = denoise(trainer, trained[name])

    _, base = fresh(family)  # model.train=full: no adapters, as a user builds the pipeline
    for m in base.modules.values():
        m.requires_grad_(False)
    pipe = trainer.pipeline(base)
    before = denoise(trainer, pipe.components[name])
    pipe.load_lora_weights(str(export / DIFFUSERS_FILE), adapter_name="exported")
    after = denoise(trainer, pipe.components[name])

    loaded = magnitudes(pipe.components[name])
    assert set(loaded) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=0)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["kohya", "comfy"])
def test_a_kohya_or_comfy_dora_export_is_refused_before_step_1(fmt):
    with pytest.raises(UserError, match=rf"export.lora_format={fmt} with model.lora_dora=true.*lora_format=diffusers"):
        validate(compose_config([*DORA, f"export.lora_format={fmt}"]))


def test_dora_without_lora_is_refused():
    with pytest.raises(UserError, match="model.lora_dora=true needs model.train=lora"):
        check_config(compose_config(["model.lora_dora=true"]))


def test_dora_has_more_trainable_parameters_than_lora_by_the_magnitudes(tmp_path):
    _, lora = fresh("sdxl", *DORA[:-1])
    trainer, dora = fresh("sdxl", *DORA)
    extra = sum(v.numel() for v in magnitudes(dora[trainer.denoiser]).values())
    n_dora, n_lora = (sum(p.numel() for p in ms.trainable_parameters()) for ms in (dora, lora))
    assert extra > 0 and n_dora == n_lora + extra


def test_dora_ema_file_loads_in_diffusers_with_the_averaged_magnitudes(tmp_path):
    from runner.ema.average import FILE
    from runner.export.lora import DIFFUSERS_EMA_FILE

    task(compose_config([f"output_dir={tmp_path}", "trainer=sdxl", *COMMON, *DORA, "ema.enabled=true",
                         "ema.decay=0.5"]))
    ckpt = tmp_path / "checkpoints" / f"step-{STEPS:08d}"
    assert json.loads((ckpt / EXPORT_DIR / INFO_FILE).read_text())["files"] == [DIFFUSERS_FILE, DIFFUSERS_EMA_FILE]
    ema = {k.removeprefix("unet.").split(f".{MAGNITUDE}.")[0]: v
           for k, v in load_file(str(ckpt / FILE)).items() if MAGNITUDE in k}
    trained = {k.removeprefix("unet.").split(f".{MAGNITUDE}.")[0]: v
               for k, v in load_file(str(ckpt / "trainable.safetensors")).items() if MAGNITUDE in k}
    assert ema and ema.keys() == trained.keys() and any(not torch.equal(ema[k], trained[k]) for k in ema)
    trainer, base = fresh("sdxl")
    pipe = trainer.pipeline(base)
    pipe.load_lora_weights(str(ckpt / EXPORT_DIR / DIFFUSERS_EMA_FILE), adapter_name="ema")
    loaded = magnitudes(pipe.unet)
    assert loaded.keys() == ema.keys() and all(torch.equal(loaded[k], ema[k]) for k in ema)
