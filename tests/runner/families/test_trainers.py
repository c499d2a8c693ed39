"""Built-in trainers (SDXL, Flux, Chroma, SD1.5/SD2.1, SD3.5 Medium/Large, Flux.2 dev/klein) on tiny random models (CPU, offline).

Batches are made here rather than through ``dataset()``, so these tests do not depend on the
data module. Models are built once per module where a test does not change them.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from omegaconf import OmegaConf

from runner.blocks import find_repeated_blocks
from runner.config import DataConfig, ModelConfig
from runner.errors import UserError
from runner.families.chroma.trainer import ChromaTrainer, ChromaTrainerConfig
from runner.families.common.loading import build_denoiser, load_single_file
from runner.families.common.tokenizers import clip_tokenizer, t5_tokenizer
from runner.families.flux.trainer import FluxTrainer, FluxTrainerConfig
from runner.families.flux2.config import Flux2TrainerConfig
from runner.families.flux2.trainer import Flux2Trainer
from runner.families.hidream.trainer import HiDreamTrainer, HiDreamTrainerConfig
from runner.families.krea2.trainer import Krea2Trainer, Krea2TrainerConfig
from runner.families.lumina2.trainer import Lumina2Trainer, Lumina2TrainerConfig
from runner.families.qwen_image21.trainer import QwenImage21Trainer, QwenImage21TrainerConfig
from runner.families.sd15.trainer import SD15Trainer, SD15TrainerConfig
from runner.families.sd35.trainer import SD35Trainer, SD35TrainerConfig
from runner.families.sdxl.architecture import sdxl_configs
from runner.families.sdxl.trainer import SDXLTrainer, SDXLTrainerConfig
from runner.families.z_image.trainer import ZImageTrainer, ZImageTrainerConfig
from runner.loss.objectives import LossConfig
from runner.trainer import ModelSet, encode, slice_batch

# name -> (trainer class, its config, trainer options of this variant)
FAMILIES = {
    "sdxl": (SDXLTrainer, SDXLTrainerConfig, {}),
    "flux": (FluxTrainer, FluxTrainerConfig, {}),
    "chroma": (ChromaTrainer, ChromaTrainerConfig, {}),
    "sd15": (SD15Trainer, SD15TrainerConfig, {}),
    "sd21": (SD15Trainer, SD15TrainerConfig, {"variant": "sd21"}),
    "sd35": (SD35Trainer, SD35TrainerConfig, {}),
    "sd35_medium": (SD35Trainer, SD35TrainerConfig, {"variant": "medium"}),
    "z_image": (ZImageTrainer, ZImageTrainerConfig, {}),
    "lumina2": (Lumina2Trainer, Lumina2TrainerConfig, {}),
    "hidream": (HiDreamTrainer, HiDreamTrainerConfig, {}),
    "flux2": (Flux2Trainer, Flux2TrainerConfig, {}),
    "flux2_klein": (Flux2Trainer, Flux2TrainerConfig, {"variant": "klein"}),
    "qwen_image21": (QwenImage21Trainer, QwenImage21TrainerConfig, {}),
    "krea2": (Krea2Trainer, Krea2TrainerConfig, {}),
}


def make_cfg(family: str, trainer: dict | None = None, loss: dict | None = None, **model):
    _, tcfg, variant = FAMILIES[family]
    cfg = OmegaConf.create(
        {
            "model": OmegaConf.structured(ModelConfig),
            "data": OmegaConf.structured(DataConfig),
            "trainer": OmegaConf.structured(tcfg),
            "loss": OmegaConf.merge(OmegaConf.structured(LossConfig), loss or {}),
        }
    )
    for k, v in model.items():
        cfg.model[k] = v
    for k, v in {**variant, **(trainer or {})}.items():
        cfg.trainer[k] = v
    return cfg


def make_trainer(family: str, trainer: dict | None = None, loss: dict | None = None, **model):
    return FAMILIES[family][0](make_cfg(family, trainer, loss, **model))


def raw_batch(n: int = 2, res: int = 64, seeds=(11, 22)) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "pixel_values": torch.rand(n, 3, res, res, generator=g) * 2 - 1,
        "caption": ["a photo of a cat", "a red bicycle, oil painting"][:n],
        "index": torch.arange(n),
        "sample_seed": torch.tensor(list(seeds)[:n], dtype=torch.int64),
    }


@pytest.fixture(scope="module", params=list(FAMILIES))
def full_setup(request):
    """(family, trainer, models) with the denoiser fully trainable; grads zeroed per use."""
    tr = make_trainer(request.param)
    return request.param, tr, tr.build_models("cpu")


def _zero_grads(models: ModelSet) -> None:
    for _, m in models.items():
        m.zero_grad(set_to_none=True)


def test_full_finetune_loss_and_grads(full_setup):
    family, tr, models = full_setup
    assert models.trained == {tr.denoiser}
    assert set(models.modules) == set(tr.module_classes()) and "vae" in models and "text_encoder" in models
    _zero_grads(models)
    enc = encode(tr, models, raw_batch())
    assert not any(t.requires_grad for t in enc.values() if isinstance(t, torch.Tensor))
    loss = tr.loss(models, enc)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    for name, module in models.items():
        for pname, p in module.named_parameters():
            if name == tr.denoiser:
                assert p.requires_grad and p.dtype == torch.float32
            else:
                assert not p.requires_grad and p.grad is None, f"{name}.{pname}"
    assert sum(p.grad is not None and p.grad.abs().sum() > 0 for p in models.trainable_parameters()) > 0
    assert not any(models[n].training for n in models.modules if n != tr.denoiser)
    _zero_grads(models)


def test_loss_is_split_invariant(full_setup):
    family, tr, models = full_setup
    batch = raw_batch()
    with torch.no_grad():
        enc = encode(tr, models, batch)
        halves = [encode(tr, models, slice_batch(batch, i, i + 1)) for i in range(2)]
        keys = [k for k, v in enc.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        assert "latents" in keys and any(k.startswith("prompt_embeds") for k in keys)  # hidream: prompt_embeds_t5
        for key in keys:
            torch.testing.assert_close(torch.cat([h[key] for h in halves]), enc[key], rtol=0, atol=1e-5)
        whole = tr.loss(models, enc).item()
        split = sum(tr.loss(models, slice_batch(enc, i, i + 1)).item() for i in range(2)) / 2
        again = tr.loss(models, enc).item()
    assert abs(whole - split) < 1e-6
    assert whole == again  # deterministic from the seeds alone


def test_example_batch_matches_encode_and_runs(full_setup):
    family, tr, models = full_setup
    with torch.no_grad():
        enc = encode(tr, models, raw_batch())
        ex = tr.example_batch(2, "cpu")
        assert set(ex) == set(enc)
        for k in enc:
            assert ex[k].shape == enc[k].shape, k
        assert math.isfinite(tr.loss(models, ex).item())


# Not lumina2 nor qwen_image21: their transformers read their masks' token counts (mask.sum(dim=1).tolist()),
# which plain meta tensors cannot answer; the planner gives masks their values (runner/plan/known_values.py), and
# each family's own tests plan it (lumina2 against real CPU steps).
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("lumina2", "qwen_image21")])
def test_example_batch_on_meta_models(family):
    tr = make_trainer(family)
    models = tr.build_models("meta")
    assert all(p.is_meta for _, m in models.items() for p in m.parameters())
    ex = tr.example_batch(3, "meta")
    assert ex["latents"].is_meta and ex["latents"].shape[0] == 3
    loss = tr.loss(models, ex)
    assert loss.is_meta and loss.dim() == 0


@pytest.mark.parametrize("family", ["sdxl", "flux", "chroma", "sd15", "sd35"])
def test_lora_trains_only_adapters(family):
    tr = make_trainer(family, train="lora", dtype="bfloat16", lora_rank=2)
    models = tr.build_models("cpu")
    trainable = dict(models.named_trainable_parameters())
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in trainable.values())
    den = models[tr.denoiser]
    base = [p for n, p in den.named_parameters() if "lora_" not in n]
    assert base and all(not p.requires_grad and p.dtype == torch.bfloat16 for p in base)
    assert all(p.dtype == torch.bfloat16 for p in models["text_encoder"].parameters())
    loss = tr.loss(models, encode(tr, models, raw_batch()))
    assert math.isfinite(loss.item())
    loss.backward()
    for _, m in models.items():
        for n, p in m.named_parameters():
            assert (p.grad is not None) == ("lora_" in n and p.requires_grad), n
    # B starts at zero (adapter = identity), so its gradient is the non-zero one at step 0.
    assert any(p.grad.abs().sum() > 0 for n, p in trainable.items() if "lora_B" in n)


def test_bad_options_are_user_errors():
    with pytest.raises(UserError, match="model.train 'qlora'.*full"):
        make_trainer("sdxl", train="qlora")
    with pytest.raises(UserError, match="model.dtype 'fp8'"):
        make_trainer("sdxl", dtype="fp8")
    with pytest.raises(UserError, match="model.size 'huge'"):
        make_trainer("flux", size="huge")
    with pytest.raises(UserError, match="prediction_type 'eps'"):
        make_trainer("sdxl", trainer={"prediction_type": "eps"})
    with pytest.raises(UserError, match="lora_targets"):
        make_trainer("sdxl", train="lora", lora_targets=["nope"]).build_models("meta")


def test_trainer_options_change_the_loss(full_setup):
    family, tr, models = full_setup
    option = {"sdxl": {"trainer": {"prediction_type": "v_prediction"}},
              "flux": {"loss": {"timestep_sampling": "uniform"}},
              "chroma": {"loss": {"timestep_shift": "resolution"}},
              "sd15": {"trainer": {"prediction_type": "v_prediction"}},
              "sd21": {"trainer": {"prediction_type": "epsilon"}},  # the variant's default is v
              "sd35": {"loss": {"timestep_shift": "none"}},  # the family's default is SD3's fixed 3.0
              "sd35_medium": {"loss": {"logit_std": 2.0}},
              "z_image": {"loss": {"timestep_shift": "resolution"}},
              "lumina2": {"loss": {"timestep_sampling": "uniform"}},
              "hidream": {"loss": {"timestep_shift": "none"}},  # the family's default is the fixed 3.0
              "flux2": {"trainer": {"guidance": 4.0}},  # dev's guidance embedding
              "flux2_klein": {"loss": {"timestep_sampling": "uniform"}},
              "qwen_image21": {"loss": {"timestep_sampling": "uniform"}},
              "krea2": {"loss": {"timestep_sampling": "uniform"}}}[family]
    other = make_trainer(family, **option)
    with torch.no_grad():
        batch = tr.example_batch(2, "cpu")
        a, b = tr.loss(models, batch).item(), other.loss(models, batch).item()
    assert math.isfinite(b) and a != b


def test_full_size_configs_on_meta():
    sdxl = make_trainer("sdxl", size="full").build_models("meta")
    flux = make_trainer("flux", size="full").build_models("meta")
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert abs(count(sdxl["unet"]) / 2.567e9 - 1) < 0.01
    assert abs(count(flux["transformer"]) / 11.9e9 - 1) < 0.01
    assert abs(count(flux["text_encoder_2"]) / 4.76e9 - 1) < 0.01  # T5-XXL encoder
    assert abs(count(build_denoiser("sd15")) / 0.86e9 - 1) < 0.01
    assert abs(count(build_denoiser("sd3")) / 2.03e9 - 1) < 0.01
    ex = make_trainer("sdxl", size="full").example_batch(1, "meta")
    assert tuple(ex["prompt_embeds"].shape) == (1, 77, 2048) and tuple(ex["latents"].shape) == (1, 4, 8, 8)
    blocks = find_repeated_blocks(flux["transformer"])
    assert len(blocks) == 19 + 38


@pytest.mark.parametrize("family, published", [
    ("sd15", {"unet": 859_520_964, "text_encoder": 123_060_480}),  # SD1.5 U-Net, CLIP ViT-L text tower
    ("sd21", {"unet": 865_910_724, "text_encoder": 340_387_840}),  # SD2.1 U-Net, OpenCLIP ViT-H (23 layers)
    ("sd35", {"transformer": 8.1e9, "text_encoder_2": 694_659_840, "text_encoder_3": 4.76e9}),  # Large, bigG, T5
    ("sd35_medium", {}),
    ("chroma", {"transformer": 8.9e9, "text_encoder": 4.76e9}),  # Chroma1-HD, T5-XXL encoder
])
def test_new_families_build_their_published_sizes_on_meta(family, published):
    from runner.parts import build_trainer
    from runner.cli.compose import compose_config

    cls, _, variant = FAMILIES[family]
    trainer_name = cls.__module__.split(".")[2]  # runner.families.<family>.trainer
    tr = build_trainer(compose_config([f"trainer={trainer_name}", "model.size=full",
                                       *(f"trainer.{k}={v}" for k, v in variant.items())]))
    models = tr.build_models("meta")
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    for name, n in published.items():
        assert count(models[name]) == pytest.approx(n, rel=1e-3 if isinstance(n, int) else 1e-2), name
    if family == "sd35_medium":  # MMDiT-X: SD3 Medium's blocks (2.03 B), 13 of them with a second attention
        assert count(build_denoiser("sd3")) < count(models["transformer"]) < 2.5e9
        assert sum(b.attn2 is not None for b in models["transformer"].transformer_blocks) == 13
    ex = tr.example_batch(1, "meta")
    side = {"sd15": 512, "sd21": 768}.get(family, 1024) // 8  # data.resolution follows the variant (conf/config.yaml)
    channels = 16 if family.startswith("sd35") or family == "chroma" else 4
    assert tuple(ex["latents"].shape) == (1, channels, side, side)
    if family == "chroma":  # T5's 512 tokens and their text mask; no CLIP
        assert tuple(ex["prompt_embeds"].shape) == (1, 512, 4096) and tuple(ex["prompt_attention_mask"].shape) == (1, 512)
        assert len(find_repeated_blocks(models["transformer"])) == 19 + 38
    elif family.startswith("sd35"):  # 77 CLIP + 256 T5 tokens of T5's width; both CLIPs' pooled outputs
        assert tuple(ex["prompt_embeds"].shape) == (1, 77 + 256, 4096)
        assert tuple(ex["pooled_prompt_embeds"].shape) == (1, 768 + 1280)
    else:
        assert tuple(ex["prompt_embeds"].shape) == (1, 77, 768 if family == "sd15" else 1024)


def test_repeated_blocks_are_outermost(full_setup):
    family, tr, models = full_setup
    blocks = tr.repeated_blocks(models)[tr.denoiser]
    assert models.blocks[tr.denoiser] == blocks and blocks
    ids = {id(b) for b in blocks}
    for b in blocks:
        assert not any(id(m) in ids for m in b.modules() if m is not b)
    names = {type(b).__name__ for b in blocks}
    unet = {"ResnetBlock2D", "Transformer2DModel"}
    expected = {
        "sdxl": unet, "sd15": unet, "sd21": unet,
        "flux": {"FluxTransformerBlock", "FluxSingleTransformerBlock"},
        "chroma": {"ChromaTransformerBlock", "ChromaSingleTransformerBlock"},
        "sd35": {"JointTransformerBlock"}, "sd35_medium": {"JointTransformerBlock"},
        "z_image": {"ZImageTransformerBlock"},  # the refiners' and the joint blocks
        "lumina2": {"Lumina2TransformerBlock"},  # the refiners' and the joint blocks
        "hidream": {"HiDreamBlock"},  # double and single stream (trainer.repeated_blocks: not the caption projections)
        "flux2": {"Flux2TransformerBlock", "Flux2SingleTransformerBlock"},
        "flux2_klein": {"Flux2TransformerBlock", "Flux2SingleTransformerBlock"},
        "qwen_image21": {"QwenImage21TransformerBlock"},
        "krea2": {"Krea2TransformerBlock"},
    }
    assert names == expected[family]


def test_tokenizers_work_offline():
    tok = clip_tokenizer()
    ids = tok(["A photo, of a cat!"], padding="max_length", max_length=77, truncation=True).input_ids[0]
    assert len(ids) == 77 and ids[0] == tok.bos_token_id and max(ids) < 514
    assert tok.decode(ids, skip_special_tokens=True).replace(" ", "") == "aphoto,ofacat!"
    t5 = t5_tokenizer()
    assert max(t5(["héllo"]).input_ids[0]) < 384


def _save_tiny_unet(path: str, prefix: str = "") -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    unet = make_trainer("sdxl").build_models("cpu")["unet"]
    state = {k: v.contiguous() for k, v in unet.state_dict().items()}
    save_file({prefix + k: v for k, v in state.items()}, path)
    return state


@pytest.mark.parametrize("prefix", ["", "unet."])
def test_single_file_roundtrip_bf16(tmp_path, prefix):
    file = str(tmp_path / "unet.safetensors")
    state = _save_tiny_unet(file, prefix)
    tr = make_trainer("sdxl", path=file, dtype="bfloat16", train="lora")
    models = tr.build_models("cpu")
    loaded = {
        k.replace(".base_layer", ""): v for k, v in models["unet"].state_dict().items() if "lora_" not in k
    }
    assert set(loaded) == set(state)
    for k, v in state.items():
        assert loaded[k].dtype == torch.bfloat16
        assert torch.equal(loaded[k], v.to(torch.bfloat16)), k
    assert not any(b.is_meta for b in models["unet"].buffers())
    assert math.isfinite(tr.loss(models, encode(tr, models, raw_batch())).item())
    # The lazy loader on its own, and the planner's meta build from the same file.
    direct = load_single_file(type(models["unet"]), sdxl_configs("tiny")["unet"], file, torch.float16)
    assert all(p.dtype == torch.float16 for p in direct.parameters())
    assert all(p.is_meta for p in tr.build_models("meta")["unet"].parameters())


def test_single_file_wrong_architecture(tmp_path):
    file = str(tmp_path / "unet.safetensors")
    _save_tiny_unet(file)
    with pytest.raises(UserError, match="unet.safetensors.*missing keys"):
        make_trainer("flux", path=file).build_models("cpu")


def test_diffusers_folder_roundtrip(tmp_path, full_setup):
    family, tr, models = full_setup
    folder = tmp_path / "model"
    for name, module in models.items():
        module.save_pretrained(str(folder / name))
    for name in (m.replace("text_encoder", "tokenizer") for m in models.modules if m.startswith("text_encoder")):
        tr.tokenizer(name).save_pretrained(str(folder / name))
    loaded_tr = make_trainer(family, path=str(folder))
    loaded = loaded_tr.build_models("cpu")
    for name, module in models.items():
        want = module.state_dict()
        got = loaded[name].state_dict()
        assert set(got) == set(want), name
        assert all(torch.equal(got[k], want[k]) for k in want), name
    with torch.no_grad():
        a, b = encode(tr, models, raw_batch()), encode(loaded_tr, loaded, raw_batch())
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    meta = loaded_tr.build_models("meta")
    assert all(p.is_meta for p in meta[tr.denoiser].parameters())


def test_bad_paths(tmp_path):
    with pytest.raises(UserError, match="does-not-exist.*does not exist.*diffusers folder"):
        make_trainer("sdxl", path=str(tmp_path / "does-not-exist"))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"this is not safetensors")
    with pytest.raises(UserError, match="junk.safetensors.*not a valid safetensors"):
        make_trainer("sdxl", path=str(junk))
    empty = tmp_path / "empty_folder"
    os.makedirs(empty / "vae")
    with pytest.raises(UserError, match="no 'unet/' subfolder"):
        make_trainer("sdxl", path=str(empty)).build_models("meta")


def test_trainers_are_registered():
    import runner.families  # noqa: F401
    from runner.registry import trainers

    reg = trainers()
    assert reg["sdxl"].target == "runner.families.sdxl.trainer.SDXLTrainer"
    assert reg["flux"].target == "runner.families.flux.trainer.FluxTrainer"
    assert reg["chroma"].target == "runner.families.chroma.trainer.ChromaTrainer"
    assert reg["flux_kontext"].target == "runner.families.flux_kontext.trainer.FluxKontextTrainer"
    assert reg["flux2"].target == "runner.families.flux2.trainer.Flux2Trainer"
    assert reg["flux2_klein"].target == "runner.families.flux2.trainer.Flux2Trainer" and reg["flux2_klein"].config().variant == "klein"
    assert reg["qwen_image_edit"].target == "runner.families.qwen_image_edit.trainer.QwenImageEditTrainer"
    assert reg["sd15"].target == "runner.families.sd15.trainer.SD15Trainer"
    assert reg["sd35"].target == "runner.families.sd35.trainer.SD35Trainer"
