"""Flux.1 Kontext (runner/families/flux_kontext/trainer.py) against diffusers' ``FluxKontextPipeline``, tiny model, CPU, offline.

* the transformer call is the pipeline's: one pipeline step on a reference image gives the
  reference tokens, ids and velocity that ``encode`` + ``predict`` give for the same inputs;
* the reference is conditioning, not target: changing it changes the prediction, whose tokens are the target's;
* a LoRA trains on the paired demo set (a reference per target), writes samples made with the
  reference, and its diffusers file loads into ``FluxKontextPipeline`` and changes its output, with no NaN;
* the family's limits on ``data.references`` are refused before anything is built.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from accelerate.utils import set_seed
from PIL import Image
from runner_setup import prepared_context

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.data import collate
from runner.data.demo import demo_reference
from runner.data.images import _to_tensor
from runner.errors import UserError
from runner.export.checkpoint import EXPORT_DIR, INFO_FILE
from runner.export.lora import DIFFUSERS_FILE, KOHYA_FILE
from runner.families.flux.dit import _pack_latents
from runner.families.flux_kontext.trainer import FluxKontextTrainer
from runner.output.report import read_metrics
from runner.resolved import resolve
from runner.sampling import build_sampler

pytestmark = pytest.mark.usefixtures("one_thread")

KONTEXT = ["trainer=flux_kontext", "data.references=1", "train.device=cpu"]


def build(*overrides: str):
    cfg = compose_config([*KONTEXT, *overrides])
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    set_seed(run.seed)
    return trainer, prepare_models(trainer.build_models("cpu"), cfg.model, run)


@pytest.fixture(scope="module")
def built():
    trainer, models = build()
    assert isinstance(trainer, FluxKontextTrainer)
    for m in models.modules.values():
        m.requires_grad_(False)
    return trainer, models


def reference_image(index: int = 3) -> Image.Image:
    """The paired demo set's reference of sample ``index`` as a PIL image (what a user hands the pipeline)."""
    pixels = demo_reference(index, 64, 0)
    return Image.fromarray(((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy())


def test_predict_is_the_pipelines_transformer_call(built):
    """The pipeline encodes the reference itself (its image processor, its VAE call); ours encodes the
    same pixels: equal reference tokens, equal ids (target grid, then first coordinate 1), and the
    velocity ``predict`` gives equals the pipeline's output cut to the target's tokens."""
    trainer, models = built
    pipe = trainer.pipeline(models)
    image = reference_image()
    seed = torch.zeros(1, dtype=torch.int64)
    cond = trainer.encode_part(models, "text", {"caption": ["make the circle red"], "sample_seed": seed})
    seen = {}

    def capture(module, args, kwargs, out):
        seen.update(hidden=kwargs["hidden_states"], ids=kwargs["img_ids"], t=kwargs["timestep"], out=out[0])

    handle = models["transformer"].register_forward_hook(capture, with_kwargs=True)
    try:
        pipe(image=image, prompt_embeds=cond["prompt_embeds"], pooled_prompt_embeds=cond["pooled_prompt_embeds"],
             num_inference_steps=1, guidance_scale=1.0, height=64, width=64, max_area=64 * 64, output_type="latent",
             _auto_resize=False, generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    tokens = (64 // 16) ** 2
    assert seen["hidden"].shape[1] == 2 * tokens  # target + reference along the sequence
    pixels = _to_tensor(image)[None, None]  # as the data set gives it; the pipeline's [-1, 1] rounds differently
    reference = trainer.normalize_latents(trainer.encode_references(models, pixels).float())
    torch.testing.assert_close(_pack_latents(reference[:, 0]), seen["hidden"][:, tokens:], rtol=1e-4, atol=1e-4)
    latents = pipe._unpack_latents(seen["hidden"][:, :tokens], 64, 64, pipe.vae_scale_factor)
    with torch.no_grad():
        ours = trainer.predict(models, latents, seen["t"], {**cond, "reference_latents": reference})
    assert ours.shape == seen["out"][:, :tokens].shape
    torch.testing.assert_close(ours, seen["out"][:, :tokens], rtol=1e-5, atol=1e-5)
    assert torch.equal(seen["ids"][tokens:, 0], torch.ones(tokens)) and not seen["ids"][:tokens, 0].any()


def test_the_reference_conditions_the_prediction_of_the_target_tokens(built):
    trainer, models = built
    ds = trainer.dataset()
    batch = collate([ds[0], ds[1]])
    batch["sample_seed"] = torch.arange(2)
    enc = trainer.encode(models, batch)
    assert enc["reference_latents"].shape == (2, 1, *enc["latents"].shape[1:])
    t = torch.tensor([0.5, 0.5])
    with torch.no_grad():
        a = trainer.predict(models, enc["latents"], t, enc)
        b = trainer.predict(models, enc["latents"], t, {**enc, "reference_latents": enc["reference_latents"].flip(0)})
    assert a.shape == _pack_latents(enc["latents"]).shape  # the loss's target: the target's tokens only
    assert not torch.allclose(a, b)


def test_a_lora_trains_on_the_paired_demo_set_samples_with_the_reference_and_loads_into_the_pipeline(tmp_path):
    task(compose_config([f"output_dir={tmp_path}", *KONTEXT, "model.train=lora", "model.lora_rank=4",
                         "train.steps=4", "train.progress=false", "train.batch_size=2", "data.demo_size=4",
                         "optimizer.lr=1e-2", "sample.every=4", "sample.prompts=[make the circle red]",
                         "sample.steps=2"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["nonfinite_skips"] == 0 for r in rows)
    export = tmp_path / "checkpoints" / "step-00000004" / EXPORT_DIR
    assert json.loads((export / INFO_FILE).read_text())["files"] == [DIFFUSERS_FILE, KOHYA_FILE]
    samples = {p.parent.name: np.asarray(Image.open(p).convert("RGB")) for p in (tmp_path / "samples").glob("*/*.png")}
    assert sorted(samples) == ["step-0", "step-4"] and samples["step-0"].shape == (64, 64, 3)
    assert not np.array_equal(samples["step-0"], samples["step-4"])

    trainer, base = build("model.train=full")
    pipe = trainer.pipeline(base)
    assert type(pipe).__name__ == "FluxKontextPipeline"
    kwargs = {"image": reference_image(), "prompt": "make the circle red", "num_inference_steps": 2, "height": 64,
              "width": 64, "max_area": 64 * 64, "output_type": "pt", "_auto_resize": False,
              "max_sequence_length": trainer.t5_max_length()}
    without = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(str(export / DIFFUSERS_FILE))
    with_lora = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert with_lora.shape == (1, 3, 64, 64) and torch.isfinite(with_lora).all()
    assert not torch.equal(with_lora, without)


def test_a_sample_reference_changes_the_sample(tmp_path):
    """``sample.references`` (one file per prompt) replaces training sample i's reference: other pixels in,
    another image out, from the same seed and weights."""
    ref = tmp_path / "ref.png"
    Image.new("RGB", (96, 64), (250, 250, 250)).save(ref)
    common = [*KONTEXT, "train.steps=1", "train.progress=false", "data.demo_size=2", "sample.every=1",
              "sample.prompts=[make the circle red]", "sample.steps=2"]
    task(compose_config([f"output_dir={tmp_path / 'a'}", *common]))
    task(compose_config([f"output_dir={tmp_path / 'b'}", *common, f"sample.references=[{ref}]"]))
    a = np.asarray(Image.open(next((tmp_path / "a" / "samples" / "step-0").glob("*.png"))))
    b = np.asarray(Image.open(next((tmp_path / "b" / "samples" / "step-0").glob("*.png"))))
    assert a.shape == b.shape == (64, 64, 3) and not np.array_equal(a, b)


@pytest.mark.parametrize("overrides, match", [
    (["trainer=flux_kontext", "data.references=0"], r"data.references=0.*Set data.references=1"),
    (["trainer=flux_kontext", "data.references=2"], r"data.references=2: Flux.1 Kontext takes at most 1"),
    (["trainer=flux", "data.references=1"], r"data.references=1: Flux is not an edit model"),
    (["trainer=flux_kontext", "data.references=-1"], r"data.references=-1 is not valid"),
    (["trainer=flux", "sample.every=1", "sample.prompts=[a]", "sample.references=[x.png]"], r"FluxTrainer is not an edit model"),
    (["trainer=flux_kontext", "data.references=1", "sample.every=1", "sample.prompts=[a,b]",
      "sample.references=[x.png]"], r"1 file\(s\) for 2 prompt"),
], ids=["none", "too-many", "not-edit", "negative", "sample-not-edit", "sample-count"])
def test_the_familys_reference_limits_are_refused(tmp_path, overrides, match):
    if any(o.startswith("sample.") for o in overrides):
        with pytest.raises(UserError, match=match):
            build_sampler(prepared_context(tmp_path, *overrides))
        return
    with pytest.raises(UserError, match=match):
        build_trainer(compose_config([*overrides, "train.device=cpu"]))


# ---- where the model comes from: full size on meta, BFL's single file, a hub id ----------------------------
def test_the_published_size_builds_on_meta_with_the_reference_in_the_example_batch():
    """FLUX.1 Kontext dev is FLUX.1 dev's transformer (11.9 B) with CLIP-L and T5-XXL; the planner's example
    batch carries a reference latent of the target's size, so the planned sequence is target + reference."""
    trainer = build_trainer(compose_config([*KONTEXT, "model.size=full", "model.train=lora"]))
    models = trainer.build_models("meta")
    base = sum(p.numel() for n, p in models["transformer"].named_parameters() if "lora_" not in n)
    t5 = sum(p.numel() for p in models["text_encoder_2"].parameters())
    assert base == pytest.approx(11.9e9, rel=1e-2) and t5 == pytest.approx(4.76e9, rel=1e-2)
    ex = trainer.example_batch(2, "meta")
    assert tuple(ex["latents"].shape) == (2, 16, 128, 128) and tuple(ex["reference_latents"].shape) == (2, 1, 16, 128, 128)
    raw = trainer.example_raw_batch(2, "meta")
    assert tuple(raw["references"].shape) == (2, 1, 3, 1024, 1024)


def test_bfls_kontext_file_and_a_hub_id_load(built, tmp_path, monkeypatch):
    """flux1-kontext-dev.safetensors has FLUX.1 dev's original layout: it loads as Flux's does; a hub id
    (black-forest-labs/FLUX.1-Kontext-dev) resolves to its diffusers folder in the local hub cache."""
    from original_layouts import flux_to_original, hub_cache
    from safetensors.torch import save_file

    trainer, models = built
    file = tmp_path / "flux1-kontext-dev.safetensors"
    save_file({k: v.contiguous() for k, v in flux_to_original(models["transformer"].state_dict()).items()}, str(file))
    loaded = build_trainer(compose_config([*KONTEXT, f"model.path={file}"])).build_models("cpu")
    for k, v in models["transformer"].state_dict().items():
        assert torch.equal(loaded["transformer"].state_dict()[k], v), k

    folder = tmp_path / "saved"
    trainer.pipeline(models).save_pretrained(folder)
    cache = tmp_path / "hub"
    hub_cache(cache, "black-forest-labs/FLUX.1-Kontext-dev", folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    hub = build_trainer(compose_config([*KONTEXT, "model.path=black-forest-labs/FLUX.1-Kontext-dev"]))
    from_hub = hub.build_models("cpu")
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        theirs = from_hub[name].state_dict()
        assert all(torch.equal(theirs[k], v) for k, v in models[name].state_dict().items()), name


def test_a_training_reference_is_squared_to_the_sample_size():
    """A bucketed reference (64x96 here) becomes the square sample's size by its short side and the centre
    crop: the planner plans the sampling pass with a reference of the sample's size (runner/plan/sampling.py)."""
    from runner.sampling.references import square

    ramp = torch.linspace(-1, 1, 96).expand(1, 3, 64, 96).contiguous()
    out = square(ramp, 32)
    assert out.shape == (1, 3, 32, 32)
    # the centre two thirds of the ramp survive (its left and right sixths are cropped), left to right:
    # columns 16..79 of 96 span -1 + 2 * 16 / 95 = -0.66 .. 0.66
    assert -0.7 < float(out[0, 0, 0, 0]) < -0.6 and 0.6 < float(out[0, 0, 0, -1]) < 0.7
    assert torch.equal(square(out, 32), out)


def test_a_lora_trains_on_a_folder_of_pairs_with_buckets_flips_and_the_latent_cache(tmp_path):
    """A user's edit folder (targets, captions as instructions, references in control/ and as *_ref1 files),
    aspect-ratio buckets and per-visit flips, latents cached by offload=park: the losses are finite and
    those of the same run without the cache, bit for bit (the references' latents come back from it)."""
    data = tmp_path / "data"
    (data / "control").mkdir(parents=True)
    for i, (w, h) in enumerate([(96, 64), (96, 64), (64, 96), (64, 96)]):
        Image.fromarray(np.full((h, w, 3), 40 * i + 20, dtype=np.uint8)).save(data / f"t{i}.png")
        (data / f"t{i}.txt").write_text(f"make it shade {i}")
        ref = data / "control" / f"t{i}.png" if i % 2 else data / f"t{i}_ref1.png"
        Image.fromarray(np.full((h // 2, w // 2, 3), 200 - 30 * i, dtype=np.uint8)).save(ref)
    common = [*KONTEXT, f"data.path={data}", "data.resolution=64", "data.buckets=true", "data.bucket_step=16",
              "data.random_flip=true", "model.train=lora", "train.steps=3", "train.batch_size=2", "train.progress=false",
              "export.enabled=false", "optimizer.lr=1e-2"]
    task(compose_config([f"output_dir={tmp_path / 'plain'}", *common]))
    task(compose_config([f"output_dir={tmp_path / 'park'}", *common, "offload=park",
                         f"offload.park.cache_dir={tmp_path / 'cache'}"]))
    plain, park = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("plain", "park"))
    assert len(plain) == 3 and all(math.isfinite(r["loss"]) for r in plain)
    assert [r["loss"] for r in plain] == [r["loss"] for r in park]
