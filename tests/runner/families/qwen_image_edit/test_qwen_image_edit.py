"""Qwen-Image-Edit (runner/families/qwen_image_edit/trainer.py) against diffusers' ``QwenImageEditPipeline`` and
``QwenImageEditPlusPipeline``, tiny model (a Qwen2.5-VL with a vision tower, built from config), CPU, offline.

* the text encoding is the pipeline's ``encode_prompt`` with the reference image (Edit: the image as
  given; Plus: resized to 384^2 area with "Picture 1: "), and it changes with the reference: the cached
  embedding is a function of (instruction, reference);
* the transformer call is the pipeline's: one pipeline step on a reference image gives the reference
  tokens, ``img_shapes`` and velocity that ``encode_references`` + ``predict`` give for the same inputs;
* a LoRA trains on the paired demo set, writes samples made with the reference, and its diffusers file
  loads into ``QwenImageEditPipeline`` and changes its output, with no NaN;
* the family's limits are refused before anything is built.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from accelerate.utils import set_seed
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus_module
from PIL import Image

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.data import collate
from runner.data.demo import demo_reference
from runner.errors import UserError
from runner.export.checkpoint import EXPORT_DIR, INFO_FILE
from runner.export.lora import DIFFUSERS_FILE
from runner.families.common.pixels import to_pil
from runner.families.qwen_image_edit.trainer import QwenImageEditTrainer
from runner.output.report import read_metrics
from runner.resolved import resolve

pytestmark = pytest.mark.usefixtures("one_thread")

EDIT = ["trainer=qwen_image_edit", "data.references=1", "train.device=cpu"]
CAPTION = "make the circle red"


def build(*overrides: str):
    cfg = compose_config([*EDIT, *overrides])
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    set_seed(run.seed)
    return trainer, prepare_models(trainer.build_models("cpu"), cfg.model, run)


@pytest.fixture(scope="module", params=["edit", "plus"])
def built(request):
    trainer, models = build(f"trainer.variant={request.param}")
    assert isinstance(trainer, QwenImageEditTrainer)
    for m in models.modules.values():
        m.requires_grad_(False)
    return trainer, models


def test_the_text_encoding_is_the_pipelines_encode_prompt_with_the_reference(built):
    """Ours encodes the data set's reference pixels; the pipeline's ``encode_prompt`` is handed the image its
    ``__call__`` would hand it (Edit: the image; Plus: resized to CONDITION_IMAGE_SIZE's area): equal valid
    tokens (vision tokens and instruction after the 64-token system line), zero-padded and masked after."""
    trainer, models = built
    pipe = trainer.pipeline(models)
    assert type(pipe).__name__ == ("QwenImageEditPlusPipeline" if trainer.variant == "plus" else "QwenImageEditPipeline")
    pixels = demo_reference(3, 64, 0)
    image = to_pil(pixels)
    if trainer.variant == "plus":
        w, h = plus_module.calculate_dimensions(plus_module.CONDITION_IMAGE_SIZE, 1.0)
        image = [pipe.image_processor.resize(image, h, w)]
    theirs, _ = pipe.encode_prompt(prompt=CAPTION, image=image, device=torch.device("cpu"))
    ours = trainer.encode_text(models, [CAPTION], pixels[None, None], torch.device("cpu"))
    n = int(ours["prompt_embeds_mask"][0].sum())
    assert n == theirs.shape[1]
    torch.testing.assert_close(ours["prompt_embeds"][0, :n], theirs[0], rtol=1e-5, atol=1e-5)
    assert not ours["prompt_embeds"][0, n:].any() and not ours["prompt_embeds_mask"][0, n:].any()
    # the vision tokens: Plus's 384^2 image is 392^2 after Qwen2-VL's rounding to 28 px, (392 / 28)^2 = 196
    # merged tokens; Edit's 64 px reference rounds to 56 px, 4 of them
    grid = trainer.image_processor()(images=trainer.vl_images(pixels[None]), return_tensors="pt")["image_grid_thw"]
    ids, _ = trainer.prompt_ids(CAPTION, grid)
    pad = trainer.tokenizer("tokenizer").convert_tokens_to_ids("<|image_pad|>")
    assert int((ids == pad).sum()) == (196 if trainer.variant == "plus" else 4)


def test_the_embedding_is_keyed_by_instruction_and_reference(built):
    """The text part reads the references (so park's cache keys it by both) and its value follows them."""
    trainer, models = built
    assert trainer.encode_parts()["text"].inputs == ("caption", "references")
    cpu = torch.device("cpu")
    a, b = demo_reference(3, 64, 0), demo_reference(1, 64, 0)
    ea = trainer.encode_text(models, [CAPTION], a[None, None], cpu)["prompt_embeds"]
    assert torch.equal(ea, trainer.encode_text(models, [CAPTION], a[None, None], cpu)["prompt_embeds"])
    assert not torch.allclose(ea, trainer.encode_text(models, [CAPTION], b[None, None], cpu)["prompt_embeds"])
    assert not torch.allclose(ea, trainer.encode_text(models, ["make it blue"], a[None, None], cpu)["prompt_embeds"])


def test_predict_is_the_pipelines_transformer_call(built):
    """A pipeline step (target 64 px, the reference resized by the pipeline to ~1 MP and VAE-encoded by it):
    our normalised reference latents of the same pixels are its reference tokens, and ``predict`` on its
    target tokens equals its output cut to the target's tokens, with the same ``img_shapes``."""
    trainer, models = built
    pipe = trainer.pipeline(models)
    cpu = torch.device("cpu")
    image = to_pil(demo_reference(3, 64, 0))
    cond = trainer.encode_text(models, [CAPTION], demo_reference(3, 64, 0)[None, None], cpu)
    n = int(cond["prompt_embeds_mask"][0].sum())
    seen = {}

    def capture(module, args, kwargs, out):
        if seen:  # the first step's call (one step is 0/0 in the scheduler's shift_terminal stretch)
            return
        seen.update(hidden=kwargs["hidden_states"], shapes=kwargs["img_shapes"], t=kwargs["timestep"],
                    text=kwargs["encoder_hidden_states"], out=out[0])

    handle = models["transformer"].register_forward_hook(capture, with_kwargs=True)
    try:
        pipe(image=image, prompt_embeds=cond["prompt_embeds"][:, :n], num_inference_steps=2, height=64, width=64,
             output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    tokens = (64 // 16) ** 2
    side = 1024 // 8  # calculate_dimensions(1024 * 1024, 1) on the latent grid
    assert seen["shapes"] == [[(1, 4, 4), (1, side // 2, side // 2)]]
    assert seen["hidden"].shape[1] == tokens + (side // 2) ** 2
    pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(image, 1024, 1024), 1024, 1024)
    mean = trainer.encode_references(models, pixels[:, None])
    reference = trainer.finish_encode({"latents": {"latent_mean": mean[:, 0], "latent_std": mean[:, 0].abs(),
                                                   "reference_mean": mean}, "text": {}},
                                      {"sample_seed": torch.zeros(1, dtype=torch.int64)})["reference_latents"]
    torch.testing.assert_close(trainer.pack(reference[:, 0]), seen["hidden"][:, tokens:], rtol=1e-4, atol=1e-4)
    latents = pipe._unpack_latents(seen["hidden"][:, :tokens], 64, 64, pipe.vae_scale_factor)[:, :, 0]
    batch = {"prompt_embeds": seen["text"], "prompt_embeds_mask": torch.ones(seen["text"].shape[:2], dtype=torch.bool),
             "reference_latents": reference}
    with torch.no_grad():
        ours = trainer.predict(models, latents, seen["t"], batch)
    torch.testing.assert_close(ours, seen["out"][:, :tokens], rtol=1e-5, atol=1e-5)


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
    assert a.shape == trainer.pack(enc["latents"]).shape  # the loss's target: the target's tokens only
    assert not torch.allclose(a, b)


def test_a_lora_trains_on_the_paired_demo_set_samples_with_the_reference_and_loads_into_the_pipeline(tmp_path):
    task(compose_config([f"output_dir={tmp_path}", *EDIT, "model.train=lora", "model.lora_rank=4",
                         "train.steps=4", "train.progress=false", "train.batch_size=2", "data.demo_size=4",
                         "optimizer.lr=1e-2", "sample.every=4", f"sample.prompts=[{CAPTION}]", "sample.steps=2"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["nonfinite_skips"] == 0 for r in rows)
    export = tmp_path / "checkpoints" / "step-00000004" / EXPORT_DIR
    assert DIFFUSERS_FILE in json.loads((export / INFO_FILE).read_text())["files"]
    samples = {p.parent.name: np.asarray(Image.open(p).convert("RGB")) for p in (tmp_path / "samples").glob("*/*.png")}
    assert sorted(samples) == ["step-0", "step-4"] and samples["step-0"].shape == (64, 64, 3)
    assert not np.array_equal(samples["step-0"], samples["step-4"])

    trainer, base = build("model.train=full")
    pipe = trainer.pipeline(base)
    assert type(pipe).__name__ == "QwenImageEditPipeline"
    kwargs = {"image": to_pil(demo_reference(3, 64, 0)), "prompt": CAPTION, "num_inference_steps": 2, "height": 64,
              "width": 64, "output_type": "pt"}
    without = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(str(export / DIFFUSERS_FILE))
    with_lora = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert with_lora.shape == (1, 3, 64, 64) and torch.isfinite(with_lora).all()
    assert not torch.equal(with_lora, without)


@pytest.mark.parametrize("overrides, match", [
    (["data.references=0"], r"data.references=0.*Set data.references=1"),
    (["data.references=2"], r"data.references=2: Qwen-Image-Edit takes at most 1"),
    (["data.references=4", "trainer.variant=plus"], r"data.references=4: Qwen-Image-Edit takes at most 3"),
    (["data.references=1", "trainer.variant=2509"], r"trainer.variant='2509' is not valid.*edit.*plus"),
], ids=["none", "too-many", "plus-too-many", "variant"])
def test_the_familys_limits_are_refused(overrides, match):
    with pytest.raises(UserError, match=match):
        build_trainer(compose_config(["trainer=qwen_image_edit", *overrides, "train.device=cpu"]))


def test_the_published_size_builds_on_meta_with_the_longer_sequences_in_the_example_batch():
    """Qwen-Image-Edit is Qwen-Image's 20.4 B MMDiT with Qwen2.5-VL-7B (vision tower included, 8.3 B); the
    planner's example batch carries a reference latent of the target's size and the text stream at the edit
    prompt's length: the 1 MP reference's vision tokens ((1036 / 28)^2, Qwen2-VL rounding 1024 px to 28 px
    patches merged 2x2), the vision markers, the 512 instruction tokens and the template's closing tokens."""
    trainer = build_trainer(compose_config([*EDIT, "model.size=full", "model.train=lora"]))
    models = trainer.build_models("meta")
    base = sum(p.numel() for n, p in models["transformer"].named_parameters() if "lora_" not in n)
    vl = sum(p.numel() for p in models["text_encoder"].parameters())
    assert base == pytest.approx(20.43e9, rel=1e-2) and vl == pytest.approx(8.29e9, rel=1e-2)
    ex = trainer.example_batch(2, "meta")
    assert tuple(ex["latents"].shape) == (2, 16, 128, 128) and tuple(ex["reference_latents"].shape) == (2, 1, 16, 128, 128)
    vision = (round(1024 / 28) * 28 // 28) ** 2
    closing = len(trainer.tokenizer("tokenizer")("<|im_end|>\n<|im_start|>assistant\n").input_ids)
    assert ex["prompt_embeds"].shape[1] == vision + 2 + 512 + closing


def test_a_lora_trains_with_the_embeddings_cached_per_instruction_and_reference(tmp_path):
    """offload=park caches the latents (target and reference) and the text part keyed by caption and reference
    (both orientations under data.random_flip): the losses equal the uncached run's bit for bit."""
    common = [*EDIT, "data.demo_size=4", "data.random_flip=true", "model.train=lora", "train.steps=3",
              "train.batch_size=2", "train.progress=false", "export.enabled=false", "optimizer.lr=1e-2"]
    task(compose_config([f"output_dir={tmp_path / 'plain'}", *common]))
    task(compose_config([f"output_dir={tmp_path / 'park'}", *common, "offload=park",
                         f"offload.park.cache_dir={tmp_path / 'cache'}"]))
    plain, park = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("plain", "park"))
    assert len(plain) == 3 and all(math.isfinite(r["loss"]) for r in plain)
    assert [r["loss"] for r in plain] == [r["loss"] for r in park]
    assert len(list((tmp_path / "cache").glob("text/*/*.safetensors"))) == 8  # 4 pairs x 2 orientations


def test_the_diffusers_folder_saves_and_loads_back_through_model_path(tmp_path):
    """The pipeline's folder (what a full fine-tune exports): model_index.json names the processor as the
    published folder does (transformers' Qwen2VLProcessor, its preprocessor_config.json and tokenizer files);
    model.path reads it back: equal weights, the same image processor settings and the same valid embedding."""
    trainer, models = build()
    trainer.pipeline(models).save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "model_index.json").read_text())["processor"] == ["transformers",
                                                                                           "Qwen2VLProcessor"]
    assert (tmp_path / "saved" / "processor" / "preprocessor_config.json").is_file()
    loaded, back = build(f"model.path={tmp_path / 'saved'}")
    for name in ("transformer", "vae", "text_encoder"):
        theirs = back[name].state_dict()
        assert all(torch.equal(theirs[k], v) for k, v in models[name].state_dict().items()), name
    assert loaded.image_processor().size == trainer.image_processor().size
    cpu, ref = torch.device("cpu"), demo_reference(2, 64, 0)[None, None]
    a, b = (t.encode_text(m, [CAPTION], ref, cpu) for t, m in ((trainer, models), (loaded, back)))
    n = int(a["prompt_embeds_mask"].sum())
    assert n == int(b["prompt_embeds_mask"].sum())  # a folder pads to the pipeline's 512, the tiny default to 96
    torch.testing.assert_close(a["prompt_embeds"][:, :n], b["prompt_embeds"][:, :n], rtol=0, atol=0)


def test_a_plus_lora_trains_on_two_references_and_loads_into_the_plus_pipeline(tmp_path):
    """trainer.variant=plus with data.references=2: both references' tokens join the sequence and both images
    are in the prompt ("Picture 1: ... Picture 2: ..."); the LoRA loads into QwenImageEditPlusPipeline, handed
    the two images, and changes its output without NaN."""
    plus = ["trainer.variant=plus", "data.references=2"]
    task(compose_config([f"output_dir={tmp_path}", *EDIT, *plus, "model.train=lora", "model.lora_rank=4",
                         "train.steps=2", "train.progress=false", "train.batch_size=2", "data.demo_size=2",
                         "optimizer.lr=1e-2"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    trainer, base = build("model.train=full", *plus)
    pipe = trainer.pipeline(base)
    assert type(pipe).__name__ == "QwenImageEditPlusPipeline"
    kwargs = {"image": [to_pil(demo_reference(3, 64, 0)), to_pil(demo_reference(1, 64, 0))], "prompt": CAPTION,
              "num_inference_steps": 2, "height": 64, "width": 64, "output_type": "pt"}
    without = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(str(tmp_path / "checkpoints" / "step-00000002" / EXPORT_DIR / DIFFUSERS_FILE))
    with_lora = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert with_lora.shape == (1, 3, 64, 64) and torch.isfinite(with_lora).all()
    assert not torch.equal(with_lora, without)


def test_a_comfyui_file_and_a_hub_id_load(tmp_path, monkeypatch):
    """A single transformer file in diffusers' names (the layout of Qwen-Image's ComfyUI diffusion_models/ files,
    which the family shares): model.path reads one back bit for bit; a hub id (Qwen/Qwen-Image-Edit)
    resolves to its diffusers folder in the local hub cache."""
    from original_layouts import hub_cache
    from safetensors.torch import save_file

    trainer, models = build()
    file = tmp_path / "qwen_image_edit.safetensors"
    save_file({k: v.contiguous() for k, v in models["transformer"].state_dict().items()}, str(file))
    loaded = build_trainer(compose_config([*EDIT, f"model.path={file}"])).build_models("cpu")
    for k, v in models["transformer"].state_dict().items():
        assert torch.equal(loaded["transformer"].state_dict()[k], v), k

    folder = tmp_path / "saved"
    trainer.pipeline(models).save_pretrained(folder)
    cache = tmp_path / "hub"
    hub_cache(cache, "Qwen/Qwen-Image-Edit", folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    from_hub = build_trainer(compose_config([*EDIT, "model.path=Qwen/Qwen-Image-Edit"])).build_models("cpu")
    for name in ("transformer", "vae", "text_encoder"):
        theirs = from_hub[name].state_dict()
        assert all(torch.equal(theirs[k], v) for k, v in models[name].state_dict().items()), name


def test_a_2511_transformers_zero_cond_t_is_honoured_and_predict_is_the_plus_pipelines_call(tmp_path):
    """Qwen-Image-Edit-2511 (``trainer.variant=plus``) ships its transformer with ``zero_cond_t: true`` in
    config.json: the reference tokens are modulated at t=0 (``modulate_index`` from ``img_shapes``). The flag is
    the transformer's config, so a folder that sets it (model.path) builds a transformer that has it, and
    ``predict`` (the pipeline's ``img_shapes``) equals the Plus pipeline's transformer call; the same weights
    without the flag predict otherwise, so a dropped flag would fail here."""
    trainer, models = build("trainer.variant=plus", "model.train=full")
    trainer.pipeline(models).save_pretrained(tmp_path / "saved")
    config_file = tmp_path / "saved" / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    assert not config.get("zero_cond_t")  # Qwen-Image's (and 2509's) transformer: off
    config_file.write_text(json.dumps({**config, "zero_cond_t": True}))
    loaded, back = build("trainer.variant=plus", "model.train=full", f"model.path={tmp_path / 'saved'}")
    assert back["transformer"].config.zero_cond_t is True
    for m in [*back.modules.values(), *models.modules.values()]:
        m.requires_grad_(False)
    seen = {}

    def capture(module, args, kwargs, out):
        if not seen:  # the first step's call
            seen.update(hidden=kwargs["hidden_states"], shapes=kwargs["img_shapes"], t=kwargs["timestep"],
                        text=kwargs["encoder_hidden_states"], out=out[0])

    pipe = loaded.pipeline(back)
    assert type(pipe).__name__ == "QwenImageEditPlusPipeline"
    handle = back["transformer"].register_forward_hook(capture, with_kwargs=True)
    try:
        pipe(image=[to_pil(demo_reference(3, 64, 0))], prompt=CAPTION, num_inference_steps=2, height=64, width=64,
             output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    tokens = (64 // 16) ** 2
    (_, rh, rw) = seen["shapes"][0][1]
    assert seen["shapes"] == [[(1, 4, 4), (1, rh, rw)]]
    vae = pipe.vae_scale_factor
    target = pipe._unpack_latents(seen["hidden"][:, :tokens], 64, 64, vae)[:, :, 0]
    reference = pipe._unpack_latents(seen["hidden"][:, tokens:], rh * 2 * vae, rw * 2 * vae, vae)[:, :, 0]
    batch = {"prompt_embeds": seen["text"], "prompt_embeds_mask": torch.ones(seen["text"].shape[:2], dtype=torch.bool),
             "reference_latents": reference[:, None]}
    with torch.no_grad():
        ours = loaded.predict(back, target, seen["t"], batch)
        without = trainer.predict(models, target, seen["t"], batch)  # the same weights, zero_cond_t off
    torch.testing.assert_close(ours, seen["out"][:, :tokens], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(without, ours, rtol=1e-3, atol=1e-3)


def test_trainer_zero_cond_t_builds_2511_where_no_folder_says_and_plans(tmp_path):
    """``trainer.zero_cond_t=true``: a random build (and so a single file, built with the same config) has 2511's
    flag and the plan runs its modulation; with variant=edit, or against a folder whose config.json says
    otherwise, it is refused before anything is built."""
    plus = ["trainer.variant=plus", "trainer.zero_cond_t=true"]
    trainer, models = build(*plus)
    assert models["transformer"].config.zero_cond_t is True
    assert build("trainer.variant=plus")[1]["transformer"].config.zero_cond_t is False  # 2509: off
    assert task(compose_config([*EDIT, *plus, "mode=plan", f"output_dir={tmp_path / 'plan'}"])) is None
    assert json.loads((tmp_path / "plan" / "plan.json").read_text())["peak_bytes"] > 0
    with pytest.raises(UserError, match=r"trainer.zero_cond_t=true is Qwen-Image-Edit-2511's.*trainer.variant=plus"):
        build("trainer.zero_cond_t=true")
    trainer.pipeline(build("trainer.variant=plus", "model.train=full")[1]).save_pretrained(tmp_path / "saved")
    with pytest.raises(UserError, match=r"trainer.zero_cond_t=true but model.path's transformer/config.json says "
                                        r"zero_cond_t: false"):
        build(*plus, f"model.path={tmp_path / 'saved'}")
