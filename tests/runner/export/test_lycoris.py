"""LoKr and LoHa (``model.train=lokr|loha``): the ComfyUI file holds the trained adapter in the
key layout ComfyUI's ``comfy/weight_adapter/lokr.py`` / ``loha.py`` read, at the trained strength.

Each case trains two steps of a tiny model on CPU, then rebuilds every module's weight delta from
the exported file by ComfyUI's rule (below, as data: tensor names, which factor sets the rank,
when ``.alpha`` applies) and compares it with peft's own delta of the trained adapter.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_training import built_as_run

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.checks import check_config, validate
from runner.errors import UserError
from runner.export.checkpoint import EXPORT_DIR, INFO_FILE
from runner.export.comfy import COMFY_FILE
from runner.state.checkpoint import load_trainable_weights

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 2
COMMON = [f"train.steps={STEPS}", "train.device=cpu", "train.progress=false", "train.batch_size=1",
          "data.demo_size=2", "optimizer.lr=0.01", "model.lora_rank=4", "model.lora_alpha=8"]
# ComfyUI's module key prefix per family (kohya style: <prefix>_<diffusers module with _>).
PREFIX = {"sdxl": "lora_unet", "sd35": "lora_transformer"}
# The tensors ComfyUI reads per module, by case (a LoKr factor is full or split into _a/_b; ".alpha"
# only where ComfyUI applies it, i.e. where some factor is rank-decomposed).
CASES = {
    "lokr": (["model.train=lokr"], {"lokr_w1", "lokr_w2"}),
    "lokr_factor2": (["model.train=lokr", "model.lokr_factor=2"], {"lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"}),
    "loha": (["model.train=loha"], {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}),
}


def comfy_delta(t: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """A module's delta as ComfyUI computes it from its tensors ``t`` (names without the key)."""
    alpha = t["alpha"].item() if "alpha" in t else None
    if "hada_w1_a" in t:
        scale = alpha / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
        return scale * ((t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])).reshape(shape)
    w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
    dim = t["lokr_w2_b"].shape[0] if "lokr_w2_b" in t else t["lokr_w1_b"].shape[0] if "lokr_w1_b" in t else None
    scale = alpha / dim if alpha is not None and dim is not None else 1.0
    if w2.dim() == 4:
        w1 = w1[:, :, None, None]
    return scale * torch.kron(w1, w2).reshape(shape)


def fresh(family: str, *overrides: str):
    return built_as_run([f"trainer={family}", *COMMON, *overrides])


@pytest.mark.parametrize("family", list(PREFIX))
@pytest.mark.parametrize("case", list(CASES))
def test_the_comfy_file_holds_the_trained_delta_in_comfyuis_layout(tmp_path, family, case):
    overrides, tensors = CASES[case]
    task(compose_config([f"output_dir={tmp_path}", f"trainer={family}", *COMMON, *overrides]))
    ckpt = tmp_path / "checkpoints" / f"step-{STEPS:08d}"
    assert json.loads((ckpt / EXPORT_DIR / INFO_FILE).read_text())["files"] == [COMFY_FILE]
    path = ckpt / EXPORT_DIR / COMFY_FILE
    state = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    kind = overrides[0].split("=")[1]
    assert (meta["adapter"], meta["lora_rank"], meta["lora_alpha"]) == (kind, "4", "8.0")

    trainer, trained = fresh(family, *overrides)
    load_trainable_weights(ckpt, trained)
    from peft.tuners.lycoris_utils import LycorisLayer

    layers = {n: m for n, m in trained[trainer.denoiser].named_modules() if isinstance(m, LycorisLayer)}
    keys = {f"{PREFIX[family]}_{n.replace('.', '_')}": n for n in layers}
    assert {k.rpartition(".")[0] for k in state} == set(keys)
    moved = 0.0
    for key, name in keys.items():
        parts = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == key}
        assert set(parts) == tensors, (key, sorted(parts))
        layer = layers[name]
        want = layer.get_delta_weight("default").detach()
        torch.testing.assert_close(comfy_delta(parts, layer.get_base_layer().weight.shape), want,
                                   rtol=1e-5, atol=1e-7)
        moved = max(moved, want.abs().max().item())
    assert moved > 1e-4  # the adapter trained away from its zero-delta init


@pytest.mark.parametrize("train", ["lokr", "loha"])
@pytest.mark.parametrize("fmt", ["diffusers", "kohya"])
def test_a_diffusers_or_kohya_file_of_lokr_or_loha_is_refused_before_step_1(train, fmt):
    with pytest.raises(UserError, match=rf"export.lora_format={fmt} with model.train={train}.*lora_format=comfy"):
        validate(compose_config([f"model.train={train}", f"export.lora_format={fmt}"]))


@pytest.mark.parametrize("value", ["0", "-2"])
def test_a_bad_lokr_factor_is_refused(value):
    with pytest.raises(UserError, match=rf"model.lokr_factor={value} is not valid"):
        check_config(compose_config(["model.train=lokr", f"model.lokr_factor={value}"]))


def test_the_ema_of_a_loha_is_exported_as_its_own_comfy_file(tmp_path):
    from runner.ema.average import FILE
    from runner.export.comfy import COMFY_EMA_FILE

    task(compose_config([f"output_dir={tmp_path}", "trainer=sdxl", *COMMON, "model.train=loha", "ema.enabled=true",
                         "ema.decay=0.5"]))
    ckpt = tmp_path / "checkpoints" / f"step-{STEPS:08d}"
    assert json.loads((ckpt / EXPORT_DIR / INFO_FILE).read_text())["files"] == [COMFY_FILE, COMFY_EMA_FILE]

    def by_key(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # unet.<module>.hada_w1_a.default
        out = {}
        for k, v in state.items():
            module, tensor = k.removeprefix("unet.").removesuffix(".default").rsplit(".", 1)
            out[f"lora_unet_{module.replace('.', '_')}.{tensor}"] = v
        return out

    ema, trained = by_key(load_file(str(ckpt / FILE))), by_key(load_file(str(ckpt / "trainable.safetensors")))
    exported = load_file(str(ckpt / EXPORT_DIR / COMFY_EMA_FILE))
    with safe_open(str(ckpt / EXPORT_DIR / COMFY_EMA_FILE), framework="pt") as f:
        assert f.metadata()["weights"] == "ema"
    tensors = {k: v for k, v in exported.items() if not k.endswith(".alpha")}
    assert tensors.keys() == ema.keys() and all(torch.equal(tensors[k], ema[k]) for k in ema)
    assert any(not torch.equal(ema[k], trained[k]) for k in ema)  # the average, not the trained weights
