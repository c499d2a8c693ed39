"""Exports load in the ecosystem: a trained LoRA through diffusers' ``load_lora_weights`` (diffusers
and kohya files), a full fine-tune through ``DiffusionPipeline.from_pretrained``.

Each family trains a few steps of a tiny model on CPU (a learning rate high enough that the
adapter clearly moves, and alpha != rank so a lost alpha would show), then:

* the exported file, loaded into a fresh base pipeline, holds the trained adapter weights and
  makes the denoiser compute what the trained model computes, which is not what the base computes;
* ``mode=export train.resume=<run>`` on the same checkpoint writes the same tensors and metadata.
"""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed
from safetensors import safe_open
from safetensors.torch import load_file

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.export.checkpoint import EXPORT_DIR, FULL_DIR, INFO_FILE
from runner.export.comfy import COMFY_FILE
from runner.export.lora import DIFFUSERS_FILE, KOHYA_FILE
from runner.resolved import resolve
from runner.state.checkpoint import load_trainable_weights

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 2
CKPT = Path("checkpoints") / f"step-{STEPS:08d}"
COMMON = [f"train.steps={STEPS}", "train.device=cpu", "train.progress=false", "train.batch_size=1",
          "data.demo_size=2", "optimizer.lr=0.01"]
LORA = ["model.train=lora", "model.lora_rank=4", "model.lora_alpha=8"]
FAMILY = {"flux_kontext": ["data.references=1"]}  # what a family needs beyond trainer=<family> (an edit family: its reference)


def train_run(out: Path, family: str, *overrides: str) -> Path:
    task(compose_config([f"output_dir={out}", f"trainer={family}", *FAMILY.get(family, []), *COMMON, *overrides]))
    return out / CKPT


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = train_run(tmp_path_factory.mktemp(f"lora-{family}"), family, *LORA)
        return cache[family]

    return get


def fresh(family: str, *overrides: str):
    """(trainer, models) built as the run built them (same seed): the base, adapters untrained."""
    cfg = compose_config([f"trainer={family}", *FAMILY.get(family, []), "train.device=cpu", *COMMON, *overrides])
    run_ = resolve(cfg)
    trainer = build_trainer(cfg, run_)
    set_seed(run_.seed)
    return trainer, prepare_models(trainer.build_models("cpu"), cfg.model, run_)


def denoise(family: str, trainer, denoiser) -> torch.Tensor:
    """One denoiser forward on a fixed example batch, through the trainer's own call."""
    batch = trainer.example_batch(1, "cpu")
    t = torch.tensor([500]) if trainer.objective == "ddpm" else torch.tensor([0.5])  # DDPM step / flow t
    with torch.no_grad():
        return trainer.predict({trainer.denoiser: denoiser}, batch["latents"], t, batch)


def metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def adapter_weights(module) -> dict[str, torch.Tensor]:
    """lora_A/lora_B weights by module path (adapter name dropped), as loaded."""
    out = {}
    for name, p in module.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            parts = name.split(".")
            out[".".join(parts[:-2] + parts[-1:])] = p.detach().clone()  # drop the adapter name
    return out


@pytest.mark.parametrize("family", ["sdxl", "flux", "flux_kontext", "chroma", "sd15", "sd35"])
@pytest.mark.parametrize("fmt", [DIFFUSERS_FILE, KOHYA_FILE])
def test_lora_export_loads_in_diffusers(lora_runs, family, fmt):
    ckpt = lora_runs(family)
    path = ckpt / EXPORT_DIR / fmt
    if fmt == KOHYA_FILE and family == "sd35":  # diffusers has no reader for a kohya-layout SD3 LoRA: ComfyUI's
        files = json.loads((ckpt / EXPORT_DIR / INFO_FILE).read_text())["files"]  # file instead (test_comfy_lora.py)
        assert not path.exists() and files == [DIFFUSERS_FILE, COMFY_FILE]
        return
    assert path.is_file()
    meta = metadata(path)
    assert (meta["lora_rank"], meta["lora_alpha"], meta["ss_network_dim"]) == ("4", "8.0", "4")
    assert json.loads(meta["lora_target_modules"]) == sorted(["to_q", "to_k", "to_v", "to_out.0"])
    assert meta["step"] == str(STEPS) and meta["base_model"].startswith("random init")
    if fmt == KOHYA_FILE:
        keys = list(load_file(str(path)))
        prefix = "lora_unet_" if family in ("sdxl", "sd15") else "lora_transformer_"
        assert all(k.startswith(prefix) for k in keys)
        assert any(k.endswith(".alpha") for k in keys) and any(k.endswith(".lora_down.weight") for k in keys)

    trainer, trained = fresh(family, *LORA)
    load_trainable_weights(ckpt, trained)
    name = trainer.denoiser
    expected = denoise(family, trainer, trained[name])

    _, base = fresh(family)  # model.train=full: no adapters; a pipeline as a user builds it
    for m in base.modules.values():
        m.requires_grad_(False)
    pipe = trainer.pipeline(base)
    before = denoise(family, trainer, pipe.components[name])
    pipe.load_lora_weights(str(path), adapter_name="exported")
    after = denoise(family, trainer, pipe.components[name])

    assert torch.isfinite(after).all()
    assert (after - before).abs().max() > 1e-3  # the LoRA changes the output ...
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-5)  # ... exactly as training left it
    if fmt == DIFFUSERS_FILE:  # same parametrization: the loaded adapter weights are the trained ones
        loaded = adapter_weights(pipe.components[name])
        assert set(loaded) == set(adapter_weights(trained[name]))
        for k, v in adapter_weights(trained[name]).items():
            torch.testing.assert_close(loaded[k], v, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["sdxl", "flux", "flux_kontext", "chroma", "sd15", "sd35"])
def test_lora_pipeline_call_is_finite(lora_runs, family):
    """A 2-step pipeline call at the tiny resolution with the diffusers file: an image, no NaN,
    not the base model's image."""
    trainer, base = fresh(family)
    pipe = trainer.pipeline(base)
    kwargs = dict(prompt="a cat", num_inference_steps=2, height=64, width=64, output_type="pt")
    if family in ("flux", "flux_kontext", "chroma", "sd35"):
        kwargs["max_sequence_length"] = trainer.t5_max_length()
    if family == "flux_kontext":  # an edit: the reference image, at the sample's size (not scaled to 1024^2)
        from PIL import Image

        kwargs.update(image=Image.new("RGB", (64, 64), (128, 128, 128)), max_area=64 * 64, _auto_resize=False)
    without = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(str(lora_runs(family) / EXPORT_DIR / DIFFUSERS_FILE))
    with_lora = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert with_lora.shape == (1, 3, 64, 64)
    assert torch.isfinite(with_lora).all()
    assert not torch.equal(with_lora, without)


def test_mode_export_rewrites_the_same_files(lora_runs, tmp_path):
    """``mode=export train.resume=<run dir>`` (settings from the run's resolved_config.yaml)
    exports the checkpoint again: the same tensors and metadata; what a killed export left is removed."""
    ckpt = lora_runs("sdxl")
    run_dir = ckpt.parent.parent
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    exported = copy / CKPT / EXPORT_DIR
    shutil.rmtree(exported)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (copy / CKPT / f".tmp-export-{int(dead.stdout)}").mkdir()  # what an export killed mid-write leaves
    task(compose_config([f"output_dir={tmp_path / 'export-job'}", "mode=export", f"train.resume={copy}",
                        "train.device=cpu"]))
    for name in (DIFFUSERS_FILE, KOHYA_FILE):  # safetensors orders a header's metadata at random: compare contents
        again, first = load_file(str(exported / name)), load_file(str(ckpt / EXPORT_DIR / name))
        assert set(again) == set(first) and all(torch.equal(again[k], first[k]) for k in first)
        assert metadata(exported / name) == metadata(ckpt / EXPORT_DIR / name)
    assert json.loads((exported / INFO_FILE).read_text())["step"] == STEPS
    assert not list((copy / CKPT).glob(".*export*"))  # the dead writer's folder removed, no staging folder left


def test_exporting_one_format_again_keeps_the_other(lora_runs, tmp_path):
    """``mode=export export.lora_format=kohya`` after training rewrites the kohya file and keeps the
    diffusers one written at the end of training (it deleted the whole folder)."""
    ckpt = lora_runs("sdxl")
    copy = tmp_path / "run"
    shutil.copytree(ckpt.parent.parent, copy)
    exported = copy / CKPT / EXPORT_DIR
    from bad_input import run_main  # as typed: the resume composes on the checkpoint's command line plus this one

    r = run_main([f"output_dir={tmp_path / 'export-job'}", f"hydra.run.dir={tmp_path / 'h'}", "mode=export",
                  f"train.resume={copy}", "trainer=sdxl", *COMMON, *LORA, "export.lora_format=kohya"])
    assert r.code == 0, r.err
    for name in (DIFFUSERS_FILE, KOHYA_FILE):
        again, first = load_file(str(exported / name)), load_file(str(ckpt / EXPORT_DIR / name))
        assert set(again) == set(first) and all(torch.equal(again[k], first[k]) for k in first)
    assert set(json.loads((exported / INFO_FILE).read_text())["files"]) == {DIFFUSERS_FILE, KOHYA_FILE}


def test_a_resume_after_a_stop_during_the_final_export_writes_it(lora_runs, tmp_path):
    """Killed while exporting the last step: a resume has no step left to train, and exports that step."""
    ckpt = lora_runs("sdxl")
    copy = tmp_path / "run"
    shutil.copytree(ckpt.parent.parent, copy)
    shutil.rmtree(copy / CKPT / EXPORT_DIR)
    task(compose_config([f"output_dir={tmp_path / 'again'}", "trainer=sdxl", *COMMON, *LORA,
                        f"train.resume={copy / CKPT}"]))
    exported = copy / CKPT / EXPORT_DIR
    for name in (DIFFUSERS_FILE, KOHYA_FILE):
        again, first = load_file(str(exported / name)), load_file(str(ckpt / EXPORT_DIR / name))
        assert set(again) == set(first) and all(torch.equal(again[k], first[k]) for k in first)


@pytest.mark.parametrize("family,plugins", [("sdxl", []), ("flux", []), ("sdxl", ["offload=park"]), ("sd15", []),
                                            ("sd35", ["offload=park"]), ("chroma", ["offload=park"])],
                         ids=["sdxl", "flux", "sdxl-park", "sd15", "sd35-park", "chroma-park"])
def test_full_finetune_exports_a_pipeline_folder(tmp_path, caplog, family, plugins):
    """model.train=full: checkpoints/step-N/export/diffusers loads with DiffusionPipeline.from_pretrained
    and holds the trained denoiser, the run's frozen modules and its tokenizers; also when park
    dropped the encoders during training (the export rebuilds them)."""
    from diffusers import DiffusionPipeline

    with caplog.at_level(logging.INFO, logger="runner"):
        ckpt = train_run(tmp_path, family, *plugins)
    assert ("rebuilding them on the CPU" in caplog.text) == bool(plugins)
    # export.full_format's default: the pipeline folder alone, as before single files existed
    assert json.loads((ckpt / EXPORT_DIR / INFO_FILE).read_text())["files"] == [FULL_DIR]
    assert sorted(p.name for p in (ckpt / EXPORT_DIR).iterdir()) == sorted([FULL_DIR, INFO_FILE])
    pipe = DiffusionPipeline.from_pretrained(str(ckpt / EXPORT_DIR / FULL_DIR))
    trainer, base = fresh(family)
    assert type(pipe) is trainer.pipeline_class()
    name = trainer.denoiser
    trained = load_file(str(ckpt / "trainable.safetensors"))
    loaded = getattr(pipe, name).state_dict()
    buffers = {n for n, _ in getattr(pipe, name).named_buffers()}  # SD3's fixed pos_embed is a saved buffer
    assert {k.removeprefix(f"{name}.") for k in trained} == set(loaded) - buffers
    for k, v in trained.items():
        torch.testing.assert_close(loaded[k.removeprefix(f"{name}.")], v, rtol=0, atol=0)
    assert any(not torch.equal(base[name].state_dict()[k.removeprefix(f"{name}.")], v) for k, v in trained.items())
    frozen = [n for n in base.modules if n != name]
    assert "vae" in frozen and "text_encoder" in frozen
    for module in frozen:
        for k, v in base[module].state_dict().items():
            torch.testing.assert_close(getattr(pipe, module).state_dict()[k], v, rtol=0, atol=0)
    for tok in (n.replace("text_encoder", "tokenizer") for n in frozen if n.startswith("text_encoder")):
        assert getattr(pipe, tok)("a cat").input_ids == trainer.tokenizer(tok)("a cat").input_ids


def test_export_disabled_and_bad_values(tmp_path):
    train_run(tmp_path, "sdxl", *LORA, "train.steps=1", "export.enabled=false")
    ckpt = tmp_path / "checkpoints" / "step-00000001"
    assert (ckpt / "trainable.safetensors").is_file() and not (ckpt / EXPORT_DIR).exists()
    with pytest.raises(UserError, match="export.lora_format='kohy'.*kohya"):
        task(compose_config([f"output_dir={tmp_path}", "export.lora_format=kohy"]))
    with pytest.raises(UserError, match="mode=export needs train.resume"):
        task(compose_config([f"output_dir={tmp_path}", "mode=export"]))


def test_a_trainer_without_a_pipeline_keeps_only_trainable_safetensors(tmp_path, caplog, monkeypatch):
    """A user's trainer (tests/assets/dit_trainer.py: no pipeline_class) trains with LoRA as before;
    the log says why no export is written."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "assets"))
    with caplog.at_level(logging.INFO, logger="runner"):
        task(compose_config([f"output_dir={tmp_path}", "trainer=custom", "trainer._target_=dit_trainer.ClassConditionalDiT",
                            "model.train=lora", "train.steps=1", "train.device=cpu", "train.progress=false"]))
    ckpt = tmp_path / "checkpoints" / "step-00000001"
    assert (ckpt / "trainable.safetensors").is_file() and not (ckpt / EXPORT_DIR).exists()
    assert "has no pipeline_class()/pipeline(models), so no diffusers/kohya export is written" in caplog.text


def test_a_full_finetune_without_a_pipeline_rebuilds_nothing_to_export(tmp_path, caplog, monkeypatch):
    """Plugins dropped the frozen encoders, and the trainer names no pipeline: the export says so at once
    instead of rebuilding every model on the CPU first."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "assets"))
    with caplog.at_level(logging.INFO, logger="runner"):
        task(compose_config([f"output_dir={tmp_path}", "trainer=sdxl", "trainer._target_=masked_trainer.NoPipelineSDXL",
                             "train.steps=1", "train.device=cpu", "train.progress=false", "offload=park",
                             f"offload.park.cache_dir={tmp_path / 'cache'}", "data.demo_size=2"]))
    assert "has no pipeline_class()/pipeline(models), so no diffusers/kohya export is written" in caplog.text
    assert "rebuilding them on the CPU" not in caplog.text
