"""Flux.2 (runner/families/flux2/trainer.py) against diffusers' ``Flux2Pipeline``, tiny model, CPU, offline.

* the text encoding and the transformer call are the pipeline's: one pipeline step with a reference
  image gives the prompt embeddings, reference tokens, ids and velocity that ``encode`` + ``predict``
  give for the same inputs;
* a reference conditions the target's prediction;
* a LoRA trains (plain and with a reference per target), and its diffusers file loads into
  ``Flux2Pipeline`` and changes its output, with no NaN;
* the published size builds on ``meta`` with FLUX.2 dev's parameter count;
* what the family does not do is refused before anything is built.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from accelerate.utils import set_seed
from PIL import Image
from safetensors.torch import load_file

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.data import collate
from runner.data.demo import demo_reference
from runner.data.images import _to_tensor
from runner.errors import UserError
from runner.export.checkpoint import EXPORT_DIR, INFO_FILE
from runner.export.comfy import COMFY_FILE
from runner.export.lora import DIFFUSERS_FILE
from runner.families.flux2.trainer import Flux2Trainer
from runner.output.report import read_metrics
from runner.resolved import resolve

pytestmark = pytest.mark.usefixtures("one_thread")

FLUX2 = ["trainer=flux2", "train.device=cpu"]


def build(*overrides: str):
    cfg = compose_config([*FLUX2, *overrides])
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    set_seed(run.seed)
    return trainer, prepare_models(trainer.build_models("cpu"), cfg.model, run)


@pytest.fixture(scope="module")
def built():
    trainer, models = build("data.references=1")
    assert isinstance(trainer, Flux2Trainer)
    for m in models.modules.values():
        m.requires_grad_(False)
    # A random VAE's batch norm has mean 0 and variance 1; give it statistics so the test sees them used.
    bn = models["vae"].bn
    g = torch.Generator().manual_seed(5)
    bn.running_mean.copy_(torch.randn(bn.running_mean.shape, generator=g))
    bn.running_var.copy_(torch.rand(bn.running_var.shape, generator=g) + 0.5)
    return trainer, models


def reference_image(index: int = 3) -> Image.Image:
    pixels = demo_reference(index, 64, 0)
    return Image.fromarray(((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy())


@pytest.fixture(scope="module")
def klein():
    trainer, models = build("data.references=1", "trainer.variant=klein")
    for m in models.modules.values():
        m.requires_grad_(False)
    return trainer, models


def test_klein_encode_and_predict_are_the_pipelines(klein):
    """FLUX.2 klein: Qwen3's hidden states 9, 18, 27 stacked as Flux2KleinPipeline encodes the prompt, no
    guidance, and the transformer call with a reference equals the pipeline's (guidance_scale 1: one pass)."""
    trainer, models = klein
    pipe = trainer.pipeline(models)
    assert type(pipe).__name__ == "Flux2KleinPipeline" and not models["transformer"].config.guidance_embeds
    cond = trainer.encode_part(models, "text", {"caption": ["make the circle red"], "sample_seed": torch.zeros(1)})
    assert cond["prompt_embeds"].shape == (1, 512, 96)
    seen = {}

    def capture(module, args, kwargs, out):
        seen.update({k: kwargs[k] for k in ("hidden_states", "img_ids", "timestep", "guidance",
                                              "encoder_hidden_states")}, out=out[0])

    handle = models["transformer"].register_forward_hook(capture, with_kwargs=True)
    try:
        pipe(image=[reference_image()], prompt="make the circle red", num_inference_steps=1, guidance_scale=1.0,
             height=64, width=64, output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    assert seen["guidance"] is None
    torch.testing.assert_close(cond["prompt_embeds"], seen["encoder_hidden_states"], rtol=0, atol=0)
    tokens = 16
    latents = pipe._unpack_latents_with_ids(seen["hidden_states"][:, :tokens], seen["img_ids"][:, :tokens])
    reference = seen["hidden_states"][:, tokens:].transpose(1, 2).reshape(1, 1, 32, 4, 4)
    with torch.no_grad():
        ours = trainer.predict(models, latents, seen["timestep"], {**cond, "reference_latents": reference})
    torch.testing.assert_close(ours, seen["out"][:, :tokens], rtol=1e-5, atol=1e-5)


def test_encode_and_predict_are_the_pipelines(built):
    """The pipeline encodes the prompt and the reference itself; ours encode the same caption and pixels:
    equal prompt embeddings (Mistral's hidden states 10, 20, 30 stacked), equal reference tokens (patchified,
    batch-norm normalised), ids (target ``(0, h, w, 0)``, reference ``(10, h, w, 0)``), and the velocity
    ``predict`` gives equals the pipeline's output cut to the target's tokens."""
    trainer, models = built
    pipe = trainer.pipeline(models)
    assert type(pipe).__name__ == "Flux2Pipeline"
    image = reference_image()
    seed = torch.zeros(1, dtype=torch.int64)
    cond = trainer.encode_part(models, "text", {"caption": ["make the circle red"], "sample_seed": seed})
    seen = {}

    def capture(module, args, kwargs, out):
        seen.update({k: kwargs[k] for k in ("hidden_states", "img_ids", "txt_ids", "timestep", "guidance",
                                              "encoder_hidden_states")}, out=out[0])

    handle = models["transformer"].register_forward_hook(capture, with_kwargs=True)
    try:
        pipe(image=[image], prompt="make the circle red", num_inference_steps=1, guidance_scale=2.5, height=64,
             width=64, output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    tokens = (64 // 16) ** 2
    assert seen["hidden_states"].shape[1] == 2 * tokens  # target + reference along the sequence
    torch.testing.assert_close(cond["prompt_embeds"], seen["encoder_hidden_states"], rtol=0, atol=0)
    # The reference as our encode gives it, from the pipeline's own [-1, 1] pixels made contiguous (the
    # processor's are channels-last, and the CPU convolution rounds the two layouts differently in the last
    # bits): it is _encode_vae_image's latent; the pipeline's reference tokens are that latent packed.
    pixels = pipe.image_processor.preprocess(image, height=64, width=64, resize_mode="crop").contiguous()
    part = trainer.encode_part(models, "latents", {"pixel_values": pixels, "references": pixels[:, None],
                                                   "sample_seed": seed})
    reference = part["reference_latents"]
    assert reference.shape == (1, 1, 32, 4, 4)  # 8 latent channels x 2x2, at 1/16 of the pixels
    with torch.no_grad():
        theirs = pipe._encode_vae_image(pixels, generator=None)
        theirs_cl = pipe._encode_vae_image(pixels.contiguous(memory_format=torch.channels_last), generator=None)
    torch.testing.assert_close(reference[:, 0], theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pipe._pack_latents(theirs_cl), seen["hidden_states"][:, tokens:], rtol=0, atol=0)
    reference = seen["hidden_states"][:, tokens:].transpose(1, 2).reshape(1, 1, 32, 4, 4)
    latents = pipe._unpack_latents_with_ids(seen["hidden_states"][:, :tokens], seen["img_ids"][:, :tokens])
    trainer.guidance = 2.5
    try:
        with torch.no_grad():
            ours = trainer.predict(models, latents, seen["timestep"], {**cond, "reference_latents": reference})
    finally:
        trainer.guidance = 1.0
    assert ours.shape == seen["out"][:, :tokens].shape
    torch.testing.assert_close(ours, seen["out"][:, :tokens], rtol=1e-5, atol=1e-5)
    ids = seen["img_ids"][0]
    assert not ids[:tokens, 0].any() and torch.equal(ids[tokens:, 0], torch.full((tokens,), 10))
    assert torch.equal(ids[tokens:, 1:], ids[:tokens, 1:])  # the reference's grid is the target's


def test_the_latents_are_the_pipelines_normalised_patchified_latents(built):
    """The cached moments are normalised so that a draw from them is ``_encode_vae_image``'s latent: the mean
    equals what the pipeline computes from the posterior's mode, and a loss mask lands on the token grid."""
    trainer, models = built
    pipe = trainer.pipeline(models)
    pixels = _to_tensor(reference_image(1))[None]
    mask = torch.zeros(1, 1, 64, 64)
    mask[..., :32] = 1
    part = trainer.encode_part(models, "latents", {"pixel_values": pixels, "mask": mask,
                                                   "references": pixels[:, None], "sample_seed": torch.zeros(1)})
    with torch.no_grad():
        theirs = pipe._encode_vae_image(pixels, generator=None)
    torch.testing.assert_close(part["latent_mean"], theirs, rtol=1e-5, atol=1e-5)
    assert part["latent_std"].shape == theirs.shape and bool((part["latent_std"] > 0).all())
    assert part["latent_mask"].shape == (1, 1, 4, 4) and torch.equal(part["latent_mask"][0, 0, 0], torch.tensor([1., 1, 0, 0]))


def test_the_reference_conditions_the_prediction_of_the_target_tokens(built):
    trainer, models = built
    ds = trainer.dataset()
    batch = collate([ds[0], ds[1]])
    batch["sample_seed"] = torch.arange(2)
    enc = trainer.encode(models, batch)
    assert enc["latents"].shape == (2, 32, 4, 4)
    assert enc["reference_latents"].shape == (2, 1, 32, 4, 4)
    t = torch.tensor([0.5, 0.5])
    with torch.no_grad():
        a = trainer.predict(models, enc["latents"], t, enc)
        b = trainer.predict(models, enc["latents"], t, {**enc, "reference_latents": enc["reference_latents"].flip(0)})
        c = trainer.predict(models, enc["latents"], t, {k: v for k, v in enc.items() if k != "reference_latents"})
    assert a.shape == c.shape == trainer.pack(enc["latents"]).shape == (2, 16, 32)
    assert not torch.allclose(a, b) and not torch.allclose(a, c)


@pytest.mark.parametrize("variant, references", [("dev", 0), ("dev", 1), ("klein", 1)],
                         ids=["plain", "reference", "klein-reference"])
def test_a_lora_trains_and_loads_into_the_pipeline(tmp_path, variant, references):
    task(compose_config([f"output_dir={tmp_path}", *FLUX2, f"trainer.variant={variant}", f"data.references={references}",
                         "model.train=lora",
                         "model.lora_rank=4", "model.lora_targets=[to_q,to_k,to_v,to_out.0,to_qkv_mlp_proj]",
                         "train.steps=3", "train.progress=false", "train.batch_size=2", "data.demo_size=4",
                         "optimizer.lr=1e-2", "sample.every=3", "sample.prompts=[make the circle red]", "sample.steps=2"]))
    samples = {p.parent.name: np.asarray(Image.open(p).convert("RGB")) for p in (tmp_path / "samples").glob("*/*.png")}
    assert sorted(samples) == ["step-0", "step-3"] and samples["step-0"].shape == (64, 64, 3)
    assert not np.array_equal(samples["step-0"], samples["step-3"])  # sampled with the LoRA as it trains
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["nonfinite_skips"] == 0 for r in rows)
    export = tmp_path / "checkpoints" / "step-00000003" / EXPORT_DIR
    assert json.loads((export / INFO_FILE).read_text())["files"] == [DIFFUSERS_FILE, COMFY_FILE]
    comfy = load_file(str(export / COMFY_FILE))
    assert "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight" in comfy  # BFL's fused q/k/v
    assert comfy["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"].shape[0] == 3 * 4
    assert "diffusion_model.single_blocks.1.linear1.lora_B.weight" in comfy and not any(k.endswith(".alpha") for k in comfy)

    trainer, base = build("model.train=full", f"trainer.variant={variant}")
    pipe = trainer.pipeline(base)
    kwargs = {"prompt": "make the circle red", "num_inference_steps": 2, "height": 64, "width": 64,
              "output_type": "pt", "guidance_scale": 2.5}
    if references:
        kwargs["image"] = [reference_image()]
    without = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(str(export / DIFFUSERS_FILE))
    adapted = {n for n, _ in pipe.transformer.named_modules() if n.endswith("lora_A")}
    assert any(".to_qkv_mlp_proj." in n for n in adapted) and any(".attn.to_q." in n for n in adapted)
    with_lora = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert with_lora.shape == (1, 3, 64, 64) and torch.isfinite(with_lora).all()
    assert not torch.equal(with_lora, without)
    # The ComfyUI file (BFL's layout) read back by diffusers' own converter gives the same image.
    pipe.unload_lora_weights()
    pipe.load_lora_weights(str(export / COMFY_FILE))
    from_comfy = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    torch.testing.assert_close(from_comfy, with_lora, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("overrides, match", [
    (["trainer.variant=pro"], r"trainer.variant='pro' is not a Flux.2 variant"),
    (["trainer.variant=klein", "trainer.guidance=3.5"], r"trainer.guidance=3.5: FLUX.2 klein has no guidance embedding"),
    (["export.lora_format=both", "model.train=lokr"], r"export.lora_format=both with model.train=lokr"),
    (["export.lora_format=kohya"], r"export.lora_format=kohya: diffusers cannot read a kohya-layout Flux.2 LoRA"),
    (["data.references=5"], r"data.references=5: Flux.2 takes at most 4"),
], ids=["variant", "klein-guidance", "comfy-lokr", "kohya", "too-many-references"])
def test_what_the_family_does_not_do_is_refused(overrides, match):
    with pytest.raises(UserError, match=match):
        build_trainer(compose_config([*FLUX2, "model.train=lora", *overrides]))


def test_the_published_size_builds_on_meta():
    """FLUX.2 dev: a 32 B transformer (8 double + 48 single blocks of width 6144) with Mistral-Small-3.1
    (24 B, vision tower included); the example batch has 128-channel tokens at 1/16 of 1024 px and the
    text stream at 3 x 5120."""
    trainer = build_trainer(compose_config([*FLUX2, "model.size=full", "model.train=lora", "data.references=1"]))
    models = trainer.build_models("meta")
    base = sum(p.numel() for n, p in models["transformer"].named_parameters() if "lora_" not in n)
    text = sum(p.numel() for p in models["text_encoder"].parameters())
    assert base == pytest.approx(32.2e9, rel=1e-2) and text == pytest.approx(24.0e9, rel=1e-2)
    ex = trainer.example_batch(2, "meta")
    assert tuple(ex["latents"].shape) == (2, 128, 64, 64)
    assert tuple(ex["prompt_embeds"].shape) == (2, 512, 15360)
    assert tuple(ex["reference_latents"].shape) == (2, 1, 128, 64, 64)


@pytest.mark.parametrize("variant, transformer, text, width", [("klein", 3.9e9, 4.0e9, 7680),
                                                              ("klein-9b", 9.1e9, 8.2e9, 12288)])
def test_klein_builds_on_meta(variant, transformer, text, width):
    """FLUX.2 klein 4B / 9B with Qwen3-4B / Qwen3-8B (counts of the configs in runner/families/flux2/architecture.py)."""
    trainer = build_trainer(compose_config([*FLUX2, "model.size=full", "model.train=lora", f"trainer.variant={variant}"]))
    models = trainer.build_models("meta")
    base = sum(p.numel() for n, p in models["transformer"].named_parameters() if "lora_" not in n)
    enc = sum(p.numel() for p in models["text_encoder"].parameters())
    assert base == pytest.approx(transformer, rel=0.05) and enc == pytest.approx(text, rel=0.05), (base, enc)
    assert tuple(trainer.example_batch(2, "meta")["prompt_embeds"].shape) == (2, 512, width)


@pytest.mark.parametrize("fixture", ["built", "klein"])
def test_a_sample_is_the_pipelines_image(request, fixture):
    """Flux2Sampling (runner/families/flux2/sampling.py) hands the pipeline precomputed embeddings and the reference as
    a PIL image, and decodes itself: the image equals the pipeline's own prompt-to-PIL call, byte for byte
    (klein with classifier-free guidance and its "" negative prompt)."""
    from contextlib import nullcontext

    trainer, models = request.getfixturevalue(fixture)
    family = trainer.sampling_family()
    assert family.takes_references and family.negative_prompt == trainer.klein
    image = reference_image()
    pixels = _to_tensor(image)[None, None]
    cond = {**family.encode(trainer, models, "make the circle red", torch.device("cpu")),
            **family.encode_reference(trainer, models, pixels, torch.device("cpu"))}
    negative = family.default_negative(4.0)
    negative = None if negative is None else family.encode(trainer, models, negative, torch.device("cpu"))
    ours = family.generate(trainer, models.modules, cond, negative, steps=2, guidance=4.0, resolution=64,
                           generator=torch.Generator().manual_seed(0), device=torch.device("cpu"),
                           vae_on_device=nullcontext)
    pipe = trainer.pipeline(models)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(image=[image], prompt="make the circle red", num_inference_steps=2, guidance_scale=4.0, height=64,
                  width=64, generator=torch.Generator().manual_seed(0)).images[0]
    assert ours.size == theirs.size == (64, 64)
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize("variant", ["dev", "klein"])
def test_a_full_fine_tune_exports_a_folder_that_loads_back_from_a_path_and_a_hub_id(tmp_path, monkeypatch, variant):
    """A full fine-tune's export is the family's diffusers folder (Flux2Pipeline / Flux2KleinPipeline); it
    loads back through model.path, and as a hub id (black-forest-labs/FLUX.2-dev) from the local hub cache,
    with every module's weights and the tokenizer (its chat template included) as written."""
    from original_layouts import hub_cache

    from runner.export.checkpoint import FULL_DIR

    task(compose_config([f"output_dir={tmp_path / 'run'}", *FLUX2, f"trainer.variant={variant}", "model.train=full",
                         "train.steps=1", "train.progress=false", "data.demo_size=2"]))
    folder = tmp_path / "run" / "checkpoints" / "step-00000001" / EXPORT_DIR / FULL_DIR
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == ("Flux2KleinPipeline" if variant == "klein" else "Flux2Pipeline")
    repo = "black-forest-labs/FLUX.2-klein-4B" if variant == "klein" else "black-forest-labs/FLUX.2-dev"
    hub_cache(tmp_path / "hub", repo, folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    trained = build_trainer(compose_config([*FLUX2, f"trainer.variant={variant}", f"model.path={folder}"]))
    from_path = trained.build_models("cpu")
    from_hub = build_trainer(compose_config([*FLUX2, f"trainer.variant={variant}", f"model.path={repo}"])).build_models("cpu")
    fresh, base = build(f"trainer.variant={variant}")  # the run's initial weights (same seed, same order)
    for name in ("transformer", "vae", "text_encoder"):
        ours, hub = from_path[name].state_dict(), from_hub[name].state_dict()
        assert all(torch.equal(hub[k], v) for k, v in ours.items()), name
    changed = [k for k, v in from_path["transformer"].state_dict().items()
               if not torch.equal(v, base["transformer"].state_dict()[k])]
    assert changed  # the fine-tuned transformer, not a fresh one, while the frozen VAE is the run's own:
    assert all(torch.equal(v, base["vae"].state_dict()[k]) for k, v in from_path["vae"].state_dict().items())
    assert trained.tokenizer("tokenizer").chat_template == fresh.tokenizer("tokenizer").chat_template


# BFL's FLUX.2 names of each diffusers weight (the facts diffusers' converter encodes), for writing a file in
# the original layout; q/k/v are fused below, and the final adaLN's halves are BFL's (shift, scale).
BFL_NAMES = (
    (r"x_embedder", "img_in"), (r"context_embedder", "txt_in"), (r"proj_out", "final_layer.linear"),
    (r"time_guidance_embed\.timestep_embedder\.linear_([12])", lambda m: f"time_in.{('in', 'out')[int(m[1]) - 1]}_layer"),
    (r"time_guidance_embed\.guidance_embedder\.linear_([12])", lambda m: f"guidance_in.{('in', 'out')[int(m[1]) - 1]}_layer"),
    (r"(double_stream_modulation_img|double_stream_modulation_txt|single_stream_modulation)\.linear", r"\1.lin"),
    (r"transformer_blocks\.(\d+)\.attn\.norm_q", r"double_blocks.\1.img_attn.norm.query_norm"),
    (r"transformer_blocks\.(\d+)\.attn\.norm_k", r"double_blocks.\1.img_attn.norm.key_norm"),
    (r"transformer_blocks\.(\d+)\.attn\.norm_added_q", r"double_blocks.\1.txt_attn.norm.query_norm"),
    (r"transformer_blocks\.(\d+)\.attn\.norm_added_k", r"double_blocks.\1.txt_attn.norm.key_norm"),
    (r"transformer_blocks\.(\d+)\.attn\.to_out\.0", r"double_blocks.\1.img_attn.proj"),
    (r"transformer_blocks\.(\d+)\.attn\.to_add_out", r"double_blocks.\1.txt_attn.proj"),
    (r"transformer_blocks\.(\d+)\.ff\.linear_in", r"double_blocks.\1.img_mlp.0"),
    (r"transformer_blocks\.(\d+)\.ff\.linear_out", r"double_blocks.\1.img_mlp.2"),
    (r"transformer_blocks\.(\d+)\.ff_context\.linear_in", r"double_blocks.\1.txt_mlp.0"),
    (r"transformer_blocks\.(\d+)\.ff_context\.linear_out", r"double_blocks.\1.txt_mlp.2"),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_qkv_mlp_proj", r"single_blocks.\1.linear1"),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_out", r"single_blocks.\1.linear2"),
    (r"single_transformer_blocks\.(\d+)\.attn\.norm_q", r"single_blocks.\1.norm.query_norm"),
    (r"single_transformer_blocks\.(\d+)\.attn\.norm_k", r"single_blocks.\1.norm.key_norm"),
)


def flux2_to_bfl(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import re

    out, state = {}, dict(state)
    for stream, parts, fused in (("img", ("to_q", "to_k", "to_v"), "img_attn.qkv"),
                                 ("txt", ("add_q_proj", "add_k_proj", "add_v_proj"), "txt_attn.qkv")):
        for key in [k for k in state if k.endswith(f".attn.{parts[0]}.weight")]:
            block = key.split(".")[1]
            qkv = [state.pop(f"transformer_blocks.{block}.attn.{p}.weight") for p in parts]
            out[f"model.diffusion_model.double_blocks.{block}.{fused}.weight"] = torch.cat(qkv)
    scale, shift = state.pop("norm_out.linear.weight").chunk(2)
    out["model.diffusion_model.final_layer.adaLN_modulation.1.weight"] = torch.cat([shift, scale])
    for key, value in state.items():
        module, param = key.rsplit(".", 1)
        name = next(re.sub(f"^{p}$", r, module) for p, r in BFL_NAMES if re.fullmatch(p, module))
        param = "scale" if "norm." in name else param
        out[f"model.diffusion_model.{name}.{param}"] = value
    return out


def test_bfls_flux2_file_loads_bit_for_bit(built, tmp_path):
    """flux2-dev.safetensors' layout (BFL's names under model.diffusion_model., fused qkv, (shift, scale)) is
    recognised as FLUX.2, not FLUX.1, and converted back to the model it was written from; trainer=flux
    refuses it naming its family."""
    from safetensors.torch import save_file

    _, models = built
    file = tmp_path / "flux2-dev.safetensors"
    save_file({k: v.contiguous() for k, v in flux2_to_bfl(models["transformer"].state_dict()).items()}, str(file))
    loaded = build_trainer(compose_config([*FLUX2, f"model.path={file}"]))
    assert loaded.layout is not None and loaded.layout.family == "flux2"
    theirs = loaded.build_models("cpu")["transformer"].state_dict()
    ours = models["transformer"].state_dict()
    assert set(theirs) == set(ours) and all(torch.equal(theirs[k], v) for k, v in ours.items())
    with pytest.raises(UserError, match="original FLUX.2 layout.*not a flux checkpoint"):
        build_trainer(compose_config(["trainer=flux", "train.device=cpu", f"model.path={file}"]))
