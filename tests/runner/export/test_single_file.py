"""A full fine-tune exported as one original-layout file (``export.full_format``) reads back through
``model.path`` bit for bit, and is the layout the ecosystem loads.

Each family (SDXL, Flux, Flux.1 Kontext (BFL's flux1-kontext-dev layout is Flux's), SD1.5, SD3.5, Qwen-Image,
Wan) trains a few steps of a tiny model on CPU with an EMA, exporting ``both`` (the diffusers folder and the
single file). Then:

* the file, given as ``model.path`` to a fresh trainer (the runner's own loader, diffusers' single-file
  converters), gives back every tensor of the run's models (trained denoiser, frozen modules) with the
  same dtype and bytes; the EMA file gives back the average;
* its keys and bytes equal what tests/original_layouts.py writes, a mapping written independently of
  the export from the documented layouts (A1111/Stability SDXL and SD1.5, Black Forest Labs' Flux);
* a family without a single-file export, a LoRA run and a wrong value are refused before step 1.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from original_layouts import clip_to_original, flux_to_original, sdxl_original, unet_to_original, vae_to_original
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_training import built_as_run

from runner.__main__ import task
from runner.parts import build_trainer
from runner.cli.compose import compose_config
from runner.ema.average import FILE as EMA_FILE
from runner.errors import UserError
from runner.export.checkpoint import EXPORT_DIR, FULL_DIR, INFO_FILE
from runner.export.ema import FULL_EMA_DIR
from runner.export.single_file import FAMILIES
from runner.resolved import resolve
from runner.state.checkpoint import load_trainable_weights

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 2
CKPT = Path("checkpoints") / f"step-{STEPS:08d}"
COMMON = [f"train.steps={STEPS}", "train.device=cpu", "train.progress=false", "train.batch_size=1",
          "data.demo_size=2", "optimizer.lr=0.01"]  # as tests/runner/export/test_export.py trains
LORA = ["model.train=lora", "model.lora_rank=4", "model.lora_alpha=8"]
EMA = ["ema.enabled=true", "ema.decay=0.5"]


EDIT = {"flux_kontext": ["data.references=1"]}  # an edit family trains on the paired demo set


def train_run(out: Path, family: str, *overrides: str) -> Path:
    task(compose_config([f"output_dir={out}", f"trainer={family}", *EDIT.get(family, []), *COMMON, *overrides]))
    return out / CKPT


def fresh(family: str, *overrides: str):
    """(trainer, models) built as the run built them (same seed), before training."""
    return built_as_run([f"trainer={family}", *EDIT.get(family, []), *COMMON, *overrides])


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = train_run(tmp_path_factory.mktemp(f"full-{family}"), family, "export.full_format=both", *EMA)
        return cache[family]

    return get


def read_back(family: str, path, *overrides: str):
    """The models a run with ``model.path=<path>`` builds (the run's dtypes: CPU, float32)."""
    cfg = compose_config([f"trainer={family}", *EDIT.get(family, []), f"model.path={path}", *COMMON, *overrides])
    return build_trainer(cfg, resolve(cfg)).build_models("cpu")


def expected(family: str, ckpt, ema: bool = False):
    """The run's models at ``ckpt``: the frozen modules as built, the denoiser's trained (or EMA) weights."""
    trainer, models = fresh(family)
    load_trainable_weights(ckpt, models)
    if ema:
        name = trainer.denoiser
        average = load_file(str(ckpt / EMA_FILE))
        with torch.no_grad():
            for k, p in models[name].named_parameters():
                p.copy_(average[f"{name}.{k}"])
    return trainer, models


def assert_identical(a, b, names) -> None:
    for name in names:
        sa, sb = a[name].state_dict(), b[name].state_dict()
        assert sa.keys() == sb.keys(), (name, sorted(set(sa) ^ set(sb))[:5])
        bad = [k for k in sa if sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k])]
        assert not bad, (name, bad[:3])


LAYOUT = {"sdxl": "sdxl", "flux": "flux", "flux_kontext": "flux", "sd15": "sd", "sd35": "sd3", "qwen_image": "qwen_image", "wan": "wan"}
# Names ComfyUI's diffusion_models files of these families hold (no independent writer in tests/original_layouts.py).
KNOWN_KEYS = {
    "sd35": {"pos_embed", "joint_blocks.0.x_block.attn.qkv.weight", "joint_blocks.0.context_block.attn.qkv.bias",
             "final_layer.adaLN_modulation.1.weight", "x_embedder.proj.weight"},
    "wan": {"blocks.0.self_attn.q.weight", "blocks.0.cross_attn.o.bias", "blocks.0.self_attn.norm_q.weight",
            "blocks.0.norm3.weight", "blocks.0.modulation", "blocks.0.ffn.0.weight", "head.modulation", "head.head.weight",
            "text_embedding.0.weight", "time_embedding.2.bias", "time_projection.1.weight", "patch_embedding.weight"},
    "qwen_image": {"img_in.weight", "txt_norm.weight", "txt_in.weight", "transformer_blocks.0.attn.to_q.weight",
                   "transformer_blocks.0.img_mod.1.weight", "norm_out.linear.weight", "proj_out.weight"},
}  # trainer -> its single-file layout (FAMILIES)


def original(family: str, models) -> dict[str, torch.Tensor] | None:
    """The independent writer's file of ``models`` (tests/original_layouts.py; None: no writer there)."""
    configs = {n: dict(models[n].config) for n in ("unet", "vae") if n in models.modules}
    if family == "sdxl":
        return sdxl_original(models, configs)
    if family == "sd15":
        te = {k: v for k, v in models["text_encoder"].state_dict().items() if not k.endswith("position_ids")}
        return {**unet_to_original(models["unet"].state_dict(), configs["unet"]),
                **vae_to_original(models["vae"].state_dict(), configs["vae"]),
                **clip_to_original(te, "cond_stage_model.transformer.")}
    if family in KNOWN_KEYS:
        return None
    return flux_to_original(models["transformer"].state_dict())


@pytest.mark.parametrize("family", ["sdxl", "flux", "flux_kontext", "sd15", "sd35", "qwen_image", "wan"])
def test_single_file_reads_back_bit_for_bit(full_runs, family):
    ckpt = full_runs(family)
    export = ckpt / EXPORT_DIR
    spec = FAMILIES[LAYOUT[family]]
    info = json.loads((export / INFO_FILE).read_text())
    assert info["files"] == [FULL_DIR, spec.file, FULL_EMA_DIR, spec.ema_file()]
    names = list(spec.modules)
    for ema, file in ((False, spec.file), (True, spec.ema_file())):
        trainer, want = expected(family, ckpt, ema=ema)
        assert_identical(want, read_back(family, export / file), names)
        written = load_file(str(export / file))
        independent = original(family, want)
        if independent is not None:
            assert set(written) == set(independent)
            assert all(torch.equal(written[k], independent[k]) for k in written)
        else:  # the names ComfyUI's diffusion_models files hold
            assert KNOWN_KEYS[family] <= set(written), sorted(KNOWN_KEYS[family] - set(written))
        with safe_open(str(export / file), framework="pt") as f:
            assert f.metadata()["weights"] == ("ema" if ema else "trained")
    _, base = fresh(family)
    name = trainer.denoiser
    trained, averaged = expected(family, ckpt)[1], expected(family, ckpt, ema=True)[1]
    for other in (base, averaged):  # the file holds this checkpoint's trained weights, not the base or the EMA
        assert any(not torch.equal(v, other[name].state_dict()[k]) for k, v in trained[name].state_dict().items())


def test_mode_export_writes_the_same_single_file_and_keeps_the_folder(full_runs, tmp_path):
    """mode=export export.full_format=single_file on a copy of the run: the same tensors and metadata; the diffusers
    folder of the earlier export is kept (an export adds a format, never deletes one)."""
    run = full_runs("sdxl").parents[1]
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    task(compose_config([f"output_dir={tmp_path / 'out'}", "mode=export", "export.full_format=single_file",
                         f"train.resume={copy / CKPT}"]))
    spec = FAMILIES["sdxl"]
    again, first = copy / CKPT / EXPORT_DIR, run / CKPT / EXPORT_DIR
    a, b = load_file(str(again / spec.file)), load_file(str(first / spec.file))
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    metadata = []
    for path in (again / spec.file, first / spec.file):
        with safe_open(str(path), framework="pt") as f:
            metadata.append(f.metadata())
    assert metadata[0] == metadata[1] and metadata[0]["preset"] == "" and metadata[0]["step"] == str(STEPS)
    assert (again / FULL_DIR / "model_index.json").is_file()


def test_sd35_medium_dual_attention_round_trip_and_an_all_in_one_file_is_refused(tmp_path):
    """MMDiT-X (SD3.5 Medium: attn2 in the dual-attention layers) writes and reads back bit for bit; a
    file that also holds text encoders is refused (they are not read from it yet), not half-loaded."""
    from safetensors.torch import save_file

    from runner.export.single_file import write_single_file

    _, models = fresh("sd35", "trainer.variant=medium")
    path = write_single_file("sd3", models, tmp_path, {"step": 0})
    written = load_file(str(path))
    assert "joint_blocks.0.x_block.attn2.qkv.weight" in written
    assert_identical(models, read_back("sd35", path, "trainer.variant=medium"), ["transformer"])
    save_file({**written, "text_encoders.clip_l.transformer.text_model.final_layer_norm.weight": torch.ones(2)},
              str(tmp_path / "all_in_one.safetensors"))
    with pytest.raises(UserError, match=r"also holds text_encoders\.\*.*diffusion_models file"):
        read_back("sd35", tmp_path / "all_in_one.safetensors", "trainer.variant=medium")


@pytest.mark.parametrize("overrides,message", [
    (["trainer=sd15", "trainer.variant=sd21", "export.full_format=single_file"],
     "no single-file export is written for SD1.5/SD2.1"),
    (["trainer=sdxl", "export.full_format=single_file", *LORA], "applies to a full fine-tune.*model.train=lora"),
    (["trainer=sdxl", "export.full_format=single"], "export.full_format='single' is not valid.*single_file"),
], ids=["sd21", "lora", "typo"])
def test_what_cannot_be_written_is_refused_before_step_1(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        task(compose_config([f"output_dir={tmp_path}", *COMMON, *overrides]))
    assert not (tmp_path / "checkpoints").exists()


def test_a_users_trainer_gets_no_single_file(tmp_path, monkeypatch):
    """A trainer of one's own (tests/assets/dit_trainer.py) has no original layout to write: refused before step 1."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "assets"))
    with pytest.raises(UserError, match="no single-file export is written for ClassConditionalDiT"):
        task(compose_config([f"output_dir={tmp_path}", "trainer=custom", "trainer._target_=dit_trainer.ClassConditionalDiT",
                             "train.steps=1", "train.device=cpu", "train.progress=false", "export.full_format=single_file"]))
    assert not (tmp_path / "checkpoints").exists()


def test_the_lazy_writer_writes_what_safetensors_reads(tmp_path):
    """save_lazily (one tensor in memory at a time) against safetensors' reader: every dtype the models
    hold, a 0-d and an empty tensor, a fused tensor made only when written, and the metadata."""
    from runner.export.single_file import LazyCat, save_lazily

    g = torch.Generator().manual_seed(0)
    parts = tuple(torch.randn(2, 3, generator=g) for _ in range(3))
    state = {"a.bf16": torch.randn(3, 4, generator=g).to(torch.bfloat16), "b.f16": torch.randn(5, generator=g).half(),
             "c.i64": torch.arange(7), "d.bool": torch.tensor([True, False, True]), "e.scalar": torch.tensor(1.5),
             "f.empty": torch.zeros(0, 4), "g.fused": LazyCat(parts), "h.view": torch.randn(4, 4, generator=g).T}
    save_lazily(state, tmp_path / "x.safetensors", {"weights": "trained"})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(state)
    for k, v in state.items():
        want = v.materialize() if isinstance(v, LazyCat) else v
        assert back[k].dtype == want.dtype and back[k].shape == want.shape and torch.equal(back[k], want), k
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"weights": "trained"}


@pytest.mark.parametrize("family,overrides,tensors", [
    pytest.param("sdxl", [], 2513, marks=pytest.mark.slow), ("sd15", [], 1130), ("flux", [], 780), ("sd35", [], 923),
    ("sd35", ["trainer.variant=medium"], 665), ("wan", [], 1095), ("qwen_image", [], 1933),
    # Wan 2.1 I2V 14B: T2V's 1095 + per block cross_attn.k_img/v_img (weight, bias) and norm_k_img (5 x 40),
    # + img_emb.proj.0/1/3/4 (weight, bias each: 8)
    ("wan", ["trainer.variant=i2v-2.1-14b"], 1095 + 5 * 40 + 8),
], ids=["sdxl", "sd15", "flux", "sd35-large", "sd35-medium", "wan-14b", "qwen-image", "wan-i2v-14b"])
def test_full_size_layouts_convert_back_on_meta(family, overrides, tensors):
    """The published architectures (model.size=full, on meta: no weights): every original key the export
    would write converts back, through the reader's converters, onto the model's own keys and shapes. The
    counts pin each layout's size (flux1-dev.safetensors holds 780 tensors; SDXL's and SD1.5's files also
    hold CLIP's position_ids buffer, which transformers no longer saves and the readers do not need)."""
    from runner.export.single_file import check_inverse, original_state_dict

    cfg = compose_config([f"trainer={family}", "model.size=full", *overrides])
    models = build_trainer(cfg).build_models("meta")
    state = original_state_dict(LAYOUT[family], models)
    check_inverse(LAYOUT[family], models, state)
    assert len(state) == tensors
