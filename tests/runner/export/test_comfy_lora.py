"""The ComfyUI LoRA file of every family: ComfyUI's key layout, ``.alpha`` on every module, and
the same adapter as the diffusers file.

Each family's tiny denoiser (built from config, nothing downloaded) gets peft's LoRA (rank 4,
alpha 8: a lost alpha shows as a factor 2) with random ``lora_B`` (peft starts it at zero), and
the files are written by the export's own writer. Then:

* the ComfyUI file's keys are the layout ComfyUI maps for the family (:data:`REFERENCE`, data:
  ComfyUI's ``comfy/lora.py`` ``model_lora_keys_unet`` and its ``unet_to_diffusers`` /
  ``flux_to_diffusers`` / ``mmdit_to_diffusers`` maps), every module has up, down and ``.alpha``
  with alpha / rank = lora_alpha / lora_rank;
* where diffusers has a converter for the layout, converting the file gives the diffusers file's
  adapter: the same ``B @ A * alpha / rank`` per module;
* SD3.5 has none: its keys are checked against the keys ComfyUI builds for the full-size model
  (:data:`FULL_SIZE`, encoded from ``mmdit_to_diffusers``), as for the other families.
"""
from __future__ import annotations

import json

import pytest
import torch
from accelerate.utils import set_seed
from diffusers.loaders import lora_conversion_utils as conv
from peft import LoraConfig, inject_adapter_in_model
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.export.comfy import COMFY_FILE, LAYOUTS, check_comfy_targets, comfy_state_dict, unmapped_modules
from runner.export.config import ExportConfig
from runner.export.lora import DIFFUSERS_FILE, KOHYA_FILE, write_lora_files
from runner.resolved import resolve

pytestmark = pytest.mark.usefixtures("one_thread")

RANK, ALPHA = 4, 8.0
LORA = ["model.train=lora", f"model.lora_rank={RANK}", f"model.lora_alpha={ALPHA}"]
FAMILIES = {  # test id -> trainer overrides
    "sdxl": ["trainer=sdxl"], "sd15": ["trainer=sd15"], "sd21": ["trainer=sd15", "trainer.variant=sd21"],
    "flux": ["trainer=flux"], "flux_kontext": ["trainer=flux_kontext", "data.references=1"], "chroma": ["trainer=chroma"],
    "sd35": ["trainer=sd35"], "qwen_image": ["trainer=qwen_image"],
    "wan21": ["trainer=wan"], "wan22": ["trainer=wan", "trainer.variant=2.2-5b"], "z_image": ["trainer=z_image"],
    # Wan 2.1 I2V: the image cross-attention's own projections adapted too (ComfyUI's k_img / v_img)
    "wan21_i2v": ["trainer=wan", "trainer.variant=i2v-2.1-14b", "data.frames=5",
                  "model.lora_targets=[to_q,to_k,to_v,to_out.0,add_k_proj,add_v_proj]"],
    # Lumina 2: the unfused modules here (one ComfyUI module each); q/k/v, fused into ComfyUI's attention.qkv,
    # are applied as ComfyUI applies them in tests/runner/export/test_comfy_apply.py
    "lumina2": ["trainer=lumina2", "model.lora_targets=[to_out.0,feed_forward.linear_1,norm1.linear]"],
    "qwen_image_edit": ["trainer=qwen_image_edit", "data.references=1"],
    "flux2": ["trainer=flux2", "model.lora_targets=[to_q,to_k,to_v,to_out.0,add_k_proj,to_qkv_mlp_proj]"],
}
# Which file ComfyUI loads at the trained strength, per family.
COMFY = {"sdxl": KOHYA_FILE, "sd15": KOHYA_FILE, "sd21": KOHYA_FILE, "flux": KOHYA_FILE, "flux_kontext": KOHYA_FILE, "chroma": KOHYA_FILE,
         "sd35": COMFY_FILE, "qwen_image": COMFY_FILE, "wan21": COMFY_FILE, "wan22": COMFY_FILE, "wan21_i2v": COMFY_FILE, "z_image": COMFY_FILE,
         "lumina2": COMFY_FILE, "flux2": COMFY_FILE, "qwen_image_edit": COMFY_FILE}

# Key-layout reference: diffusers module -> the key ComfyUI reads for it (+ .lora_down/.lora_up
# or .lora_A/.lora_B, and .alpha). U-Nets: lora_unet_ + diffusers name (unet_to_diffusers); Flux
# and SD3.5: lora_transformer_ + diffusers name (OneTrainer's, flux_to_diffusers / mmdit_to_diffusers);
# Qwen-Image: diffusion_model. + its names (ComfyUI's are diffusers'); Wan: diffusion_model. + the
# original Wan names (comfy/ldm/wan/model.py); Z-Image: diffusion_model. + diffusers' names, which
# ComfyUI's comfy/utils.py z_image_to_diffusers maps onto its NextDiT (to_q/to_k/to_v onto slices of
# attention.qkv, to_out.0 onto attention.out; refiner blocks included).
REFERENCE = {
    "sdxl": {"down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q":
             "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q",
             "up_blocks.0.attentions.2.transformer_blocks.1.attn2.to_out.0":
             "lora_unet_up_blocks_0_attentions_2_transformer_blocks_1_attn2_to_out_0"},
    "sd15": {"down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k":
             "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k"},
    "sd21": {"up_blocks.1.attentions.2.transformer_blocks.0.attn1.to_v":
             "lora_unet_up_blocks_1_attentions_2_transformer_blocks_0_attn1_to_v"},
    "flux": {"transformer_blocks.0.attn.to_q": "lora_transformer_transformer_blocks_0_attn_to_q",
             "single_transformer_blocks.0.attn.to_k": "lora_transformer_single_transformer_blocks_0_attn_to_k"},
    # Flux.1 Kontext: ComfyUI loads it as a Flux model (the same architecture), so Flux's map keys its LoRA.
    "flux_kontext": {"transformer_blocks.0.attn.to_out.0": "lora_transformer_transformer_blocks_0_attn_to_out_0",
                     "single_transformer_blocks.0.attn.to_v": "lora_transformer_single_transformer_blocks_0_attn_to_v"},
    # Chroma: ComfyUI's Chroma is a Flux model (comfy/model_base.py), keyed by flux_to_diffusers as Flux is.
    "chroma": {"transformer_blocks.0.attn.to_k": "lora_transformer_transformer_blocks_0_attn_to_k",
               "single_transformer_blocks.1.attn.to_v": "lora_transformer_single_transformer_blocks_1_attn_to_v"},
    "sd35": {"transformer_blocks.0.attn.to_out.0": "lora_transformer_transformer_blocks_0_attn_to_out_0",
             "transformer_blocks.1.attn.to_v": "lora_transformer_transformer_blocks_1_attn_to_v"},
    "qwen_image": {"transformer_blocks.0.attn.to_q": "diffusion_model.transformer_blocks.0.attn.to_q",
                   "transformer_blocks.2.attn.to_out.0": "diffusion_model.transformer_blocks.2.attn.to_out.0"},
    # Qwen-Image-Edit: ComfyUI loads it as a Qwen-Image model (the same MMDiT), keyed as Qwen-Image is.
    "qwen_image_edit": {"transformer_blocks.1.attn.to_k": "diffusion_model.transformer_blocks.1.attn.to_k",
                        "transformer_blocks.2.attn.to_v": "diffusion_model.transformer_blocks.2.attn.to_v"},
    "wan21": {"blocks.0.attn1.to_q": "diffusion_model.blocks.0.self_attn.q",
              "blocks.0.attn1.to_out.0": "diffusion_model.blocks.0.self_attn.o",
              "blocks.2.attn2.to_k": "diffusion_model.blocks.2.cross_attn.k"},
    "wan22": {"blocks.1.attn2.to_out.0": "diffusion_model.blocks.1.cross_attn.o"},
    "wan21_i2v": {"blocks.0.attn2.add_k_proj": "diffusion_model.blocks.0.cross_attn.k_img",
                  "blocks.2.attn2.add_v_proj": "diffusion_model.blocks.2.cross_attn.v_img"},
    "z_image": {"layers.0.attention.to_q": "diffusion_model.layers.0.attention.to_q",
                "layers.2.attention.to_out.0": "diffusion_model.layers.2.attention.to_out.0",
                "noise_refiner.0.attention.to_k": "diffusion_model.noise_refiner.0.attention.to_k",
                "context_refiner.0.attention.to_v": "diffusion_model.context_refiner.0.attention.to_v"},
    # Lumina 2: ComfyUI's NextDiT names (comfy/ldm/lumina/model.py: JointAttention.out, FeedForward.w1,
    # JointTransformerBlock.adaLN_modulation = Sequential(SiLU, Linear)), read by its generic diffusion_model.* keys.
    "lumina2": {"layers.2.attn.to_out.0": "diffusion_model.layers.2.attention.out",
                "noise_refiner.0.feed_forward.linear_1": "diffusion_model.noise_refiner.0.feed_forward.w1",
                "layers.0.norm1.linear": "diffusion_model.layers.0.adaLN_modulation.1"},
}

# Full-size facts from ComfyUI's own maps: (layout, diffusers module of the full-size model, the key
# a LoRA must carry, the ComfyUI model weight model_lora_keys_unet maps it to).
FULL_SIZE = [
    ("sd3", "transformer_blocks.37.attn.to_q", "lora_transformer_transformer_blocks_37_attn_to_q",
     "diffusion_model.joint_blocks.37.x_block.attn.qkv.weight"),  # SD3.5 Large, 38 blocks, a slice of qkv
    ("sd3", "transformer_blocks.12.attn2.to_out.0", "lora_transformer_transformer_blocks_12_attn2_to_out_0",
     "diffusion_model.joint_blocks.12.x_block.attn2.proj.weight"),  # SD3.5 Medium's second attention
    ("sd3", "transformer_blocks.0.attn.add_k_proj", "lora_transformer_transformer_blocks_0_attn_add_k_proj",
     "diffusion_model.joint_blocks.0.context_block.attn.qkv.weight"),
    ("qwen_image", "transformer_blocks.59.img_mlp.net.2", "diffusion_model.transformer_blocks.59.img_mlp.net.2",
     "diffusion_model.transformer_blocks.59.img_mlp.net.2.weight"),
    ("wan", "blocks.39.attn2.add_k_proj", "diffusion_model.blocks.39.cross_attn.k_img",
     "diffusion_model.blocks.39.cross_attn.k_img.weight"),  # Wan 2.1 I2V-14B
    ("wan", "blocks.29.ffn.net.0.proj", "diffusion_model.blocks.29.ffn.0", "diffusion_model.blocks.29.ffn.0.weight"),
    ("wan", "condition_embedder.time_proj", "diffusion_model.time_projection.1",
     "diffusion_model.time_projection.1.weight"),
    ("wan", "proj_out", "diffusion_model.head.head", "diffusion_model.head.head.weight"),
    ("lumina2", "layers.25.attn.to_out.0", "diffusion_model.layers.25.attention.out",
     "diffusion_model.layers.25.attention.out.weight"),  # Lumina-Image-2.0, 26 blocks
    ("lumina2", "layers.25.feed_forward.linear_3", "diffusion_model.layers.25.feed_forward.w3",
     "diffusion_model.layers.25.feed_forward.w3.weight"),
]


def adapted(family: str):
    """(trainer, denoiser with a random non-zero adapter) of ``family``'s tiny model."""
    cfg = compose_config([*FAMILIES[family], "train.device=cpu", "train.batch_size=1", "data.demo_size=2", *LORA])
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    set_seed(run.seed)
    module = prepare_models(trainer.build_models("cpu"), cfg.model, run)[trainer.denoiser]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return trainer, module


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """family -> the folder the export's writer filled with the default ``export.lora_format``."""
    cache = {}

    def get(family: str):
        if family not in cache:
            trainer, module = adapted(family)
            folder = tmp_path_factory.mktemp(f"comfy-{family}")
            files = write_lora_files(trainer, trainer.pipeline_class(), trainer.denoiser, module, folder,
                                     {"step": 1, "base_model": "random init"}, ExportConfig())
            cache[family] = (trainer, module, folder, files)
        return cache[family]

    return get


def deltas_of_diffusers_file(path) -> dict[str, torch.Tensor]:
    """module -> B @ A * alpha / rank of a diffusers LoRA file (alpha and rank from its adapter metadata)."""
    with safe_open(str(path), framework="pt") as f:
        config = json.loads(f.metadata()["lora_adapter_metadata"])  # diffusers' keys: <denoiser>.lora_alpha, ...
    sd = load_file(str(path))
    denoiser = next(iter(sd)).split(".", 1)[0]
    scale = config[f"{denoiser}.lora_alpha"] / config[f"{denoiser}.r"]
    assert scale == ALPHA / RANK
    return {k.split(".", 1)[1].removesuffix(".lora_A.weight"): sd[k.replace("lora_A", "lora_B")] @ v * scale
            for k, v in sd.items() if k.endswith(".lora_A.weight")}


def deltas(sd: dict[str, torch.Tensor], scale: float = 1.0) -> dict[str, torch.Tensor]:
    """module -> B @ A * scale of a diffusers (peft-keyed) state dict, its ``transformer.``/``unet.`` dropped."""
    return {k.split(".", 1)[1].removesuffix(".lora_A.weight"): sd[k.replace(".lora_A.", ".lora_B.")] @ v * scale
            for k, v in sd.items() if k.endswith(".lora_A.weight")}


# Flux.2's file has no .alpha (the scale is in B, as diffusers' reader of BFL's layout requires) and fuses
# q/k/v: its keys are checked in tests/runner/families/flux2/test_flux2.py, its values by the two tests below.
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "flux2"])
def test_the_comfy_file_has_comfyuis_keys_and_the_trained_alpha(exports, family):
    _, module, folder, files = exports(family)
    assert files == [DIFFUSERS_FILE, COMFY[family]]  # U-Nets, Flux: the kohya file is the ComfyUI file
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)  # no second file with the kohya bytes
    sd = load_file(str(folder / COMFY[family]))
    down, up = ("lora_A.weight", "lora_B.weight") if family in ("qwen_image", "qwen_image_edit", "wan21", "wan22", "wan21_i2v", "z_image",
                                                          "lumina2") else (
        "lora_down.weight", "lora_up.weight")
    modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in sd}
    adapted_modules = sum(1 for n, _ in module.named_parameters() if ".lora_A." in n)
    assert len(modules) == adapted_modules and len(sd) == 3 * adapted_modules
    for m in modules:
        assert {f"{m}.{down}", f"{m}.{up}", f"{m}.alpha"} <= set(sd)
        assert sd[f"{m}.alpha"].ndim == 0 and sd[f"{m}.alpha"].item() / sd[f"{m}.{down}"].shape[0] == ALPHA / RANK
    for diffusers_name, comfy_key in REFERENCE[family].items():
        assert comfy_key in modules, (diffusers_name, sorted(modules)[:4])
    with safe_open(str(folder / COMFY[family]), framework="pt") as f:
        meta = f.metadata()
    assert (meta["lora_rank"], meta["lora_alpha"], meta["ss_network_alpha"]) == ("4", "8.0", "8.0")


@pytest.mark.parametrize("family,convert", [
    ("sdxl", "unet"), ("sd15", "unet"), ("sd21", "unet"), ("flux", "_convert_kohya_flux_lora_to_diffusers"),
    ("flux_kontext", "_convert_kohya_flux_lora_to_diffusers"),  # FluxKontextPipeline: Flux's loader
    ("chroma", "_convert_kohya_flux_lora_to_diffusers"),  # ChromaPipeline reads LoRAs with Flux's loader
    ("qwen_image", "_convert_non_diffusers_qwen_lora_to_diffusers"),
    ("qwen_image_edit", "_convert_non_diffusers_qwen_lora_to_diffusers"),  # QwenImageEditPipeline: Qwen-Image's loader
    ("wan21", "_convert_non_diffusers_wan_lora_to_diffusers"), ("wan22", "_convert_non_diffusers_wan_lora_to_diffusers"),
    ("z_image", "_convert_non_diffusers_z_image_lora_to_diffusers"),
    ("flux2", "_convert_non_diffusers_flux2_lora_to_diffusers"),  # BFL's layout, q/k/v fused (an unadapted v too)
])
def test_diffusers_converter_gives_back_the_diffusers_export(exports, family, convert):
    """diffusers' own reader of the layout, on the ComfyUI file, gives the diffusers file's adapter
    (values and effective scale: it folds alpha / rank into the weights, or returns the alphas)."""
    _, _, folder, _ = exports(family)
    sd = load_file(str(folder / COMFY[family]))
    if convert == "unet":  # kohya -> diffusers' attention-processor keys + alphas -> peft keys, as load_lora_weights
        from diffusers.utils import convert_unet_state_dict_to_peft

        converted, alphas = conv._convert_non_diffusers_lora_to_diffusers(dict(sd))
        downs = [k for k in converted if k.endswith("lora.down.weight")]
        assert sorted(alphas) == sorted(f"{k}.alpha" for k in downs) and set(alphas.values()) == {ALPHA}
        assert {converted[k].shape[0] for k in downs} == {RANK}
        peft = convert_unet_state_dict_to_peft({k.removeprefix("unet."): v for k, v in converted.items()})
        got = deltas({f"unet.{k}": v for k, v in peft.items()}, ALPHA / RANK)
    else:
        got = deltas(getattr(conv, convert)(dict(sd)))
    expected = deltas_of_diffusers_file(folder / DIFFUSERS_FILE)
    # A fused module (Flux.2's qkv) adapted in part reads back with zero updates for its unadapted parts.
    assert set(got) >= set(expected) and len(expected) > 0
    assert all(not got[k].any() for k in set(got) - set(expected))
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-7)
    assert any(v.abs().max() > 1e-3 for v in expected.values())  # a real adapter, not zeros


@pytest.mark.parametrize("family", ["qwen_image", "wan21", "z_image", "flux2"])
def test_the_comfy_file_loads_in_the_pipeline_at_the_trained_strength(exports, family):
    """``pipe.load_lora_weights(lora_comfy.safetensors)`` (diffusers detects the layout) makes the
    denoiser compute what the adapted model computes."""
    trainer, module, folder, _ = exports(family)
    batch = trainer.example_batch(1, "cpu")
    t = torch.tensor([0.5])
    with torch.no_grad():
        expected = trainer.predict({trainer.denoiser: module}, batch["latents"], t, batch)
    cfg = compose_config([*FAMILIES[family], "train.device=cpu", "train.batch_size=1", "data.demo_size=2"])
    run = resolve(cfg)
    plain = build_trainer(cfg, run)
    set_seed(run.seed)
    base = prepare_models(plain.build_models("cpu"), cfg.model, run)  # model.train=full: the base, no adapter
    for m in base.modules.values():
        m.requires_grad_(False)
    pipe = plain.pipeline(base)
    with torch.no_grad():
        before = trainer.predict({trainer.denoiser: pipe.components[trainer.denoiser]}, batch["latents"], t, batch)
    pipe.load_lora_weights(str(folder / COMFY_FILE), adapter_name="comfy")
    with torch.no_grad():
        after = trainer.predict({trainer.denoiser: pipe.components[trainer.denoiser]}, batch["latents"], t, batch)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout,module,key,comfy_weight", FULL_SIZE)
def test_full_size_keys_are_the_ones_comfyui_maps(layout, module, key, comfy_weight):
    """The key written for a full-size module is the key ComfyUI's ``model_lora_keys_unet`` builds
    for the weight it patches (for diffusion_model.* keys: the weight's name less ``.weight``)."""
    lay = LAYOUTS[layout]
    sd = comfy_state_dict({f"{module}.lora_A.weight": torch.ones(2, 3), f"{module}.lora_B.weight": torch.ones(5, 2)},
                          lay, ALPHA)
    assert sorted(sd) == sorted([f"{key}.alpha", *(f"{key}.{s}.weight" for s in (
        ("lora_down", "lora_up") if lay.style == "kohya" else ("lora_A", "lora_B")))])
    if comfy_weight.startswith("diffusion_model.") and lay.style == "dotted":
        assert key == comfy_weight.removesuffix(".weight")  # ComfyUI's generic "diffusion_model.<name>" key


def test_every_linear_of_the_full_size_wan_has_a_comfyui_name():
    """Wan 2.1 14B, 2.2 5B and 2.1 I2V 14B, built on meta: any module a user targets has an original name."""
    from runner.families.common.loading import build_module
    from runner.families.wan.trainer import WanTrainer

    for variant in ("14b", "2.2-5b", "i2v-2.1-14b"):  # I2V: the image cross-attention and img_emb too
        cfg = compose_config(["trainer=wan", f"trainer.variant={variant}", "model.size=full", "train.device=cpu"])
        trainer = build_trainer(cfg, resolve(cfg))
        assert isinstance(trainer, WanTrainer)
        cls = trainer.module_classes()["transformer"]
        model = build_module(cls, trainer.size_configs()["transformer"], "meta", torch.float32)
        linears = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv3d))]
        assert len(linears) > 300 and unmapped_modules(LAYOUTS["wan"], linears) == []


def test_an_adapter_comfyui_cannot_name_is_refused_before_training():
    """A Wan module outside the rename table: refused at build (one paragraph naming the setting),
    not after the run at its export; export.lora_format=diffusers needs no ComfyUI name."""

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.extra_head = nn.Linear(4, 4)

    model = inject_adapter_in_model(LoraConfig(r=2, target_modules=["extra_head"]), Odd())
    cfg = compose_config(["trainer=wan", *LORA])
    with pytest.raises(UserError, match=r"model.lora_targets .* \(e.g. extra_head\).*export.lora_format=diffusers"):
        check_comfy_targets(cfg, "wan", model, "Wan")
    check_comfy_targets(compose_config(["trainer=wan", *LORA, "export.lora_format=diffusers"]), "wan", model, "Wan")


def test_a_run_exports_the_comfy_file_and_its_ema(tmp_path):
    """A tiny Wan run with the EMA, default export: lora_comfy.safetensors and
    lora_comfy_ema.safetensors beside the diffusers files, each the ComfyUI layout of its diffusers
    file (the EMA one of the average, which is not the trained adapter)."""
    from runner.__main__ import task
    from runner.export.checkpoint import EXPORT_DIR, INFO_FILE
    from runner.export.comfy import COMFY_EMA_FILE
    from runner.export.lora import DIFFUSERS_EMA_FILE

    task(compose_config([f"output_dir={tmp_path}", "trainer=wan", *LORA, "train.steps=2", "train.device=cpu",
                         "train.progress=false", "train.batch_size=1", "data.demo_size=2", "optimizer.lr=0.01",
                         "ema.enabled=true", "ema.decay=0.5"]))
    export = tmp_path / "checkpoints" / "step-00000002" / EXPORT_DIR
    files = json.loads((export / INFO_FILE).read_text())["files"]
    assert files == [DIFFUSERS_FILE, COMFY_FILE, DIFFUSERS_EMA_FILE, COMFY_EMA_FILE]
    for diffusers_file, comfy_file in ((DIFFUSERS_FILE, COMFY_FILE), (DIFFUSERS_EMA_FILE, COMFY_EMA_FILE)):
        peft = {k.removeprefix("transformer."): v for k, v in load_file(str(export / diffusers_file)).items()}
        expected, got = comfy_state_dict(peft, LAYOUTS["wan"], ALPHA), load_file(str(export / comfy_file))
        assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    trained, ema = load_file(str(export / COMFY_FILE)), load_file(str(export / COMFY_EMA_FILE))
    assert any(not torch.equal(trained[k], ema[k]) for k in trained if k.endswith("lora_A.weight"))
    with safe_open(str(export / COMFY_EMA_FILE), framework="pt") as f:
        assert f.metadata()["weights"] == "ema"


@pytest.mark.parametrize("family,fmt,written", [
    ("sdxl", "comfy", [KOHYA_FILE]), ("flux", "kohya", [KOHYA_FILE]), ("sd35", "comfy", [COMFY_FILE]),
    ("wan21", "diffusers", [DIFFUSERS_FILE]), ("qwen_image", "comfy", [COMFY_FILE]),
])
def test_each_lora_format_writes_its_files(exports, tmp_path, family, fmt, written):
    trainer, module, _, _ = exports(family)
    files = write_lora_files(trainer, trainer.pipeline_class(), trainer.denoiser, module, tmp_path, {"step": 1},
                             ExportConfig(lora_format=fmt))
    assert files == written and sorted(p.name for p in tmp_path.iterdir()) == sorted(written)


def test_kohya_for_a_family_without_one_points_to_comfy(tmp_path):
    from runner.__main__ import task

    with pytest.raises(UserError, match=r"export.lora_format=kohya: .*Wan.*export.lora_format=comfy"):
        task(compose_config([f"output_dir={tmp_path}", "trainer=wan", *LORA, "train.device=cpu",
                             "export.lora_format=kohya"]))
    with pytest.raises(UserError, match=r"export.lora_format='comfyui'.*comfy"):
        task(compose_config([f"output_dir={tmp_path}", "export.lora_format=comfyui"]))
