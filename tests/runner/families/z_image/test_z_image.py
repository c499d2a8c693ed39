"""Z-Image (runner/families/z_image/trainer.py) against diffusers' ``ZImagePipeline``, on the tiny model (CPU, offline).

* the text conditioning is the pipeline's ``encode_prompt``: the chat-formatted caption through
  Qwen3 with the tokenizer's mask, the second-to-last hidden state of the caption's tokens;
* ``predict`` is the pipeline's transformer call with its two conventions (timestep ``1 - sigma``,
  output the negative velocity): one pipeline step's noise prediction equals ``predict``;
* the issue's checks as for the other families: the loss goes down, the planner agrees with a real
  CPU step within 5 %, cached and uncached losses are equal, the exported LoRA loads into
  ``ZImagePipeline``, makes its transformer compute what training left and generates without NaN;
* the full-size configs have the published parameter counts; the preset trains at tiny size.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed
from planner_truth import assert_plan_matches_a_real_cpu_step

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.errors import UserError
from runner.export.checkpoint import EXPORT_DIR
from runner.export.comfy import COMFY_FILE
from runner.export.lora import DIFFUSERS_FILE, KOHYA_FILE
from runner.families.z_image.trainer import ZImageTrainer, caption_lengths
from runner.output.report import read_metrics
from runner.resolved import resolve
from runner.state.checkpoint import load_trainable_weights

pytestmark = pytest.mark.usefixtures("one_thread")

CAPTIONS = ["a photo of a cat", "a red bicycle leaning on a wall, oil painting"]
COMMON = ["trainer=z_image", "train.device=cpu", "train.progress=false", "data.demo_size=2"]


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # offload=park's default cache stays in tmp


def train(out: Path, *overrides: str) -> list[dict]:
    task(compose_config([*COMMON, f"output_dir={out}", *overrides]))
    return read_metrics(out / "metrics.jsonl")


def fresh(*overrides: str, frozen: bool = True):
    """(trainer, models) built as a run builds them (same seed); ``frozen``: no gradients anywhere."""
    cfg = compose_config([*COMMON, *overrides])
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    assert isinstance(trainer, ZImageTrainer)
    set_seed(run.seed)
    models = prepare_models(trainer.build_models("cpu"), cfg.model, run)
    for m in models.modules.values() if frozen else ():
        m.requires_grad_(False)
    return trainer, models


@pytest.fixture(scope="module")
def built():
    return fresh()


def test_full_size_configs_have_the_published_parameter_counts():
    from runner.families.common.loading import build_module

    trainer = build_trainer(compose_config(["trainer=z_image", "model.size=full"]))

    def count(name):
        cls = trainer.module_classes()[name]
        return sum(p.numel() for p in build_module(cls, trainer.size_configs()[name], "meta", torch.bfloat16).parameters())

    assert count("transformer") == 6_154_908_736  # Z-Image-Turbo: "6B"
    assert count("text_encoder") == 4_022_468_096  # Qwen3-4B (tied embeddings)
    assert count("vae") == 83_819_683  # FLUX.1's VAE


def test_text_conditioning_is_the_pipelines(built):
    trainer, models = built
    ours = trainer.encode_part(models, "text", {"caption": list(CAPTIONS), "sample_seed": torch.zeros(2, dtype=torch.int64)})
    pipe = trainer.pipeline(models)
    with torch.no_grad():
        theirs, _ = pipe.encode_prompt(list(CAPTIONS), device="cpu", do_classifier_free_guidance=False,
                                       max_sequence_length=trainer.max_sequence_length)
    lengths = caption_lengths(ours["prompt_embeds_mask"])
    assert lengths == [t.shape[0] for t in theirs] and lengths[0] < lengths[1] < trainer.max_sequence_length
    for i, n in enumerate(lengths):
        torch.testing.assert_close(ours["prompt_embeds"][i, :n], theirs[i], rtol=0, atol=0)
        assert not ours["prompt_embeds"][i, n:].any()  # padding zeroed: the cache holds no stray values


def test_predict_is_the_pipelines_transformer_call(built):
    """One pipeline step, captured at the transformer: ``predict`` on the same latents, sigma and
    embeddings gives the velocity the scheduler stepped with (the negated output)."""
    trainer, models = built
    cond = trainer.encode_part(models, "text", {"caption": list(CAPTIONS), "sample_seed": torch.zeros(2, dtype=torch.int64)})
    pipe = trainer.pipeline(models)
    seen = {}

    def capture(module, args, kwargs, out):
        seen.update(x=torch.stack(args[0]).squeeze(2), t=args[1], out=torch.stack(out[0]).squeeze(2))

    handle = models["transformer"].register_forward_hook(capture, with_kwargs=True)
    try:
        embeds = [cond["prompt_embeds"][i, :n] for i, n in enumerate(caption_lengths(cond["prompt_embeds_mask"]))]
        pipe(prompt_embeds=embeds, num_inference_steps=2, guidance_scale=0.0, height=64, width=64,
             output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    sigma = 1.0 - seen["t"]  # the pipeline passes (1000 - t) / 1000
    assert 0.0 < float(sigma[0]) < 1.0 and len(sigma) == 2
    with torch.no_grad():
        ours = trainer.predict(models, seen["x"], sigma, cond)
    torch.testing.assert_close(ours, -seen["out"], rtol=1e-5, atol=1e-6)


def test_the_planners_masks_count_every_caption_at_the_runs_longest():
    mask = torch.zeros(2, 7, dtype=torch.bool, device="meta")
    assert caption_lengths(mask) == [7, 7]  # no longest given: the padded length
    assert caption_lengths(mask, 5) == [5, 5] and caption_lengths(mask, 9) == [7, 7]
    assert caption_lengths(torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool), 3) == [2, 1]  # values: read


def test_the_longest_caption_is_the_datas_through_the_chat_template(built):
    """The planner's caption length: the longest of the data set's captions (with dropout, the empty
    one too) as encode_part tokenizes them; shuffled tags cannot be listed: max_sequence_length."""
    trainer, models = built
    data = trainer.dataset()
    captions = [data.caption(i) for i in range(len(data))]
    masks = trainer.encode_part(models, "text", {"caption": captions, "sample_seed": torch.zeros(len(captions))})
    assert trainer.longest_caption_tokens() == max(caption_lengths(masks["prompt_embeds_mask"]))
    assert trainer.longest_caption_tokens() < trainer.max_sequence_length
    shuffled, _ = fresh("data.shuffle_tags=true")
    assert shuffled.longest_caption_tokens() == shuffled.max_sequence_length


def test_loss_goes_down_over_a_short_run(tmp_path):
    losses = [r["loss"] for r in train(tmp_path, "train.steps=10", "optimizer.lr=3e-3", "export.enabled=false")]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses


def test_planned_peak_matches_a_real_cpu_step():
    """With every caption truncated to ``trainer.max_sequence_length`` (24 tokens: fewer than any demo
    caption with its chat template), the real step has the planner's caption lengths: within 5 %."""
    cfg = compose_config([*COMMON, "data.resolution=128", "trainer.max_sequence_length=24"])
    validate(cfg)
    assert_plan_matches_a_real_cpu_step(cfg)


def test_the_plan_at_the_datas_longest_caption_matches_a_real_cpu_step():
    """Default length (512): the plan counts every caption at the demo set's longest (far fewer tokens;
    it counted all 512 before), and agrees with a real step within 5 %."""
    cfg = compose_config([*COMMON, "data.resolution=128"])
    validate(cfg)
    assert_plan_matches_a_real_cpu_step(cfg)


def test_cached_and_uncached_losses_are_equal(tmp_path):
    park = ["offload=park", f"offload.park.cache_dir={tmp_path / 'cache'}"]
    steps = ["train.steps=3", "export.enabled=false"]
    base = [r["loss"] for r in train(tmp_path / "base", *steps)]
    first = [r["loss"] for r in train(tmp_path / "first", *steps, *park)]
    second = [r["loss"] for r in train(tmp_path / "second", *steps, *park)]
    assert base == first == second, (base, first, second)
    assert len(list((tmp_path / "cache").rglob("*.safetensors"))) == 4  # two samples: latents and text each


def test_exported_lora_loads_into_the_pipeline_and_generates(tmp_path):
    lora = ["model.train=lora", "model.lora_rank=4", "model.lora_alpha=8"]
    train(tmp_path, "train.steps=2", "optimizer.lr=0.01", "train.batch_size=1", *lora)
    export = tmp_path / "checkpoints" / "step-00000002" / EXPORT_DIR
    assert (export / DIFFUSERS_FILE).is_file() and (export / COMFY_FILE).is_file()
    assert not (export / KOHYA_FILE).exists()

    trainer, trained = fresh(*lora, frozen=False)
    load_trainable_weights(tmp_path / "checkpoints" / "step-00000002", trained)
    batch = trainer.example_batch(1, "cpu")
    t = torch.tensor([0.5])

    def denoise(transformer):
        with torch.no_grad():
            return trainer.predict({"transformer": transformer}, batch["latents"], t, batch)

    expected = denoise(trained["transformer"])
    _, base = fresh()  # no adapters: a pipeline as a user builds it
    for file in (DIFFUSERS_FILE, COMFY_FILE):
        pipe = trainer.pipeline(base)
        before = denoise(pipe.transformer)
        pipe.load_lora_weights(str(export / file), adapter_name=file.split(".")[0])
        after = denoise(pipe.transformer)
        assert (after - before).abs().max() > 1e-4, file  # the LoRA changes the output ...
        torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-5)  # ... exactly as training left it
        pipe.set_progress_bar_config(disable=True)
        out = pipe(prompt="a red circle", height=32, width=32, num_inference_steps=2, guidance_scale=1.5,
                   generator=torch.Generator().manual_seed(0), output_type="pt").images
        assert out.shape == (1, 3, 32, 32) and torch.isfinite(out).all()
        pipe.unload_lora_weights()


def test_samples_during_training(tmp_path):
    train(tmp_path, "sample.every=1", "sample.steps=2", "sample.prompts=[a red circle]", "train.steps=1",
          "export.enabled=false")
    from PIL import Image

    with Image.open(next((tmp_path / "samples" / "step-1").glob("*.png"))) as im:
        assert im.size == (64, 64)


def test_the_preset_trains_at_tiny_size(tmp_path):
    """nf4 base + LoRA, park with both caches, block checkpointing: finite losses, an exported LoRA."""
    task(compose_config(["+preset=z_image_16gb", *COMMON[1:], "train.steps=2", f"output_dir={tmp_path}"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert (tmp_path / "checkpoints" / "step-00000002" / EXPORT_DIR / DIFFUSERS_FILE).is_file()


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_bad_max_sequence_length_is_a_user_error(value):
    with pytest.raises(UserError, match=rf"trainer.max_sequence_length={value} is not valid"):
        build_trainer(compose_config(["trainer=z_image", f"trainer.max_sequence_length={value}", "train.device=cpu"]))


# The original Z-Image key layout (Tongyi-MAI's repository; ComfyUI's diffusion_models file): diffusers'
# name -> the original one, written here from that layout, independently of diffusers' converter that
# runner/families/common/single_file.py uses. to_q/to_k/to_v are fused row-wise into attention.qkv.
ORIGINAL_RENAMES = (("all_x_embedder.2-1.", "x_embedder."), ("all_final_layer.2-1.", "final_layer."),
                    (".attention.to_out.0.", ".attention.out."), (".attention.norm_q.", ".attention.q_norm."),
                    (".attention.norm_k.", ".attention.k_norm."))


def to_original(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q." in key:
            parts = [state[key.replace(".to_q.", f".to_{x}.")] for x in "qkv"]
            out[prefix + key.replace(".to_q.", ".qkv.")] = torch.cat(parts).contiguous()
            continue
        for new, old in ORIGINAL_RENAMES:
            key = key.replace(new, old)
        out[prefix + key] = value.contiguous()
    return out


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_an_original_z_image_file_loads_as_the_transformer(tmp_path, prefix):
    """ComfyUI's z_image_turbo file layout (fused qkv), bare or with ComfyUI's prefix: recognised as
    Z-Image's, converted, and the weights are the source's bit for bit."""
    from safetensors.torch import save_file

    _, models = fresh()
    want = models["transformer"].state_dict()
    file = tmp_path / "z_image_turbo_bf16.safetensors"
    original = to_original(want, prefix)
    assert any(".attention.qkv.weight" in k for k in original) and not any(".to_q." in k for k in original)
    save_file(original, str(file))
    loaded_trainer, loaded = fresh(f"model.path={file}", "model.train=full")
    assert loaded_trainer.layout is not None and loaded_trainer.layout.family == "z_image"
    got = loaded["transformer"].state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k].float(), want[k].float()) for k in want)


def test_another_familys_trainer_refuses_a_z_image_file(tmp_path):
    from safetensors.torch import save_file

    file = tmp_path / "z.safetensors"
    save_file({"layers.0.attention.qkv.weight": torch.zeros(6, 2), "layers.0.adaLN_modulation.0.weight": torch.zeros(8, 2)},
              str(file))
    with pytest.raises(UserError, match=r"original Z-Image layout.*not a flux checkpoint"):
        build_trainer(compose_config(["trainer=flux", f"model.path={file}", "train.device=cpu"]))


def test_a_full_fine_tune_exports_the_comfyui_single_file_that_reads_back(tmp_path):
    """export.full_format=both: the pipeline folder and ComfyUI's diffusion_models file (original layout,
    fused qkv); the file read back through model.path is the folder's transformer bit for bit."""
    from safetensors import safe_open

    train(tmp_path, "train.steps=1", "export.full_format=both")
    export = tmp_path / "checkpoints" / "step-00000001" / EXPORT_DIR
    file = export / "diffusion_model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        keys = list(f.keys())
    assert "layers.0.attention.qkv.weight" in keys and "x_embedder.weight" in keys
    assert not any(".to_q." in k or "all_x_embedder" in k for k in keys)
    _, folder = fresh(f"model.path={export / 'diffusers'}", "model.train=full")
    _, single = fresh(f"model.path={file}", "model.train=full")
    want, got = folder["transformer"].state_dict(), single["transformer"].state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_hub_id_in_the_local_cache_loads_every_module_and_encodes_alike(tmp_path, monkeypatch, built):
    """Tongyi-MAI/Z-Image-Turbo's folder as the hub cache keeps it (here the tiny pipeline saved by
    ZImagePipeline.save_pretrained): every module bit for bit, and the folder's tokenizer (with its chat
    template) gives the same caption embeddings."""
    from original_layouts import hub_cache

    trainer, models = built
    saved = tmp_path / "saved"
    trainer.pipeline(models).save_pretrained(saved)
    hub_cache(tmp_path / "hub", "tiny-org/tiny-z-image", saved)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    loaded_trainer, loaded = fresh("model.path=tiny-org/tiny-z-image")
    assert loaded_trainer.source[0] == "folder"
    for name in models.modules:
        want, got = models[name].state_dict(), loaded[name].state_dict()
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), name
    batch = {"caption": list(CAPTIONS), "sample_seed": torch.zeros(2, dtype=torch.int64)}
    a, b = trainer.encode_part(models, "text", batch), loaded_trainer.encode_part(loaded, "text", batch)
    assert torch.equal(a["prompt_embeds_mask"], b["prompt_embeds_mask"])
    torch.testing.assert_close(a["prompt_embeds"], b["prompt_embeds"], rtol=0, atol=0)
