"""The data options in whole runs of the tiny SDXL model, on images of several aspect ratios.

What must hold with aspect-ratio buckets and per-visit captions, bit for bit on CPU (one thread):

* a run whose encoder outputs come from the cache (offload=park) equals an uncached one, with
  caption dropout (the empty caption is one more cache entry) and with shuffled tags (text
  encoders parked, latents cached);
* a run resumed mid-epoch continues the same bucketed order and captions;
* an out-of-memory split of a bucketed step equals a run configured with the smaller micro-batch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.output.report import read_metrics
from runner.plugin import Plugin, PluginConfig
from runner.registry import register_plugin

pytestmark = pytest.mark.usefixtures("one_thread")

# (width, height): two portraits, two landscapes, two squares -> three buckets of two at 64 px, step 16
SIZES = [(60, 90), (90, 60), (64, 64), (48, 80), (120, 72), (70, 70)]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("aspect")
    for i, (w, h) in enumerate(SIZES):
        img = Image.new("RGB", (w, h), (40 * i, 120, 200 - 30 * i))
        img.paste((250, 250, 20), (w // 4, h // 4, w // 2, h // 2))
        img.save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"shape {i}, yellow, square, blue", encoding="utf-8")
    return folder


def common(images: Path) -> list[str]:
    return ["train.device=cpu", "train.progress=false", "train.preflight=false", f"data.path={images}",
            "data.buckets=true", "data.bucket_step=16", "train.batch_size=2", "export.enabled=false"]


def train(out: Path, *overrides: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    task(compose_config([f"output_dir={out}", *overrides]))
    rows = read_metrics(out / "metrics.jsonl")
    step = rows[-1]["step"]
    weights = load_file(str(out / "checkpoints" / f"step-{step:08d}" / "trainable.safetensors"))
    return [r["loss"] for r in rows], weights


def assert_same(a: tuple, b: tuple) -> None:
    assert a[0] == b[0], (a[0], b[0])
    bad = [k for k in a[1] if not torch.equal(a[1][k], b[1][k])]
    assert a[1].keys() == b[1].keys() and not bad, bad[:3]


def test_cached_runs_equal_uncached_with_buckets_and_caption_dropout(images, tmp_path):
    cache = tmp_path / "cache"
    base = [*common(images), "train.steps=3", "data.caption_dropout=0.5"]
    park = ["offload=park", f"offload.park.cache_dir={cache}"]
    plain = train(tmp_path / "plain", *base)
    filling = train(tmp_path / "fill", *base, *park)
    cached = train(tmp_path / "cached", *base, *park)
    assert_same(plain, filling)
    assert_same(plain, cached)
    entries = {p.parent.parent.name: [] for p in cache.rglob("*.safetensors")}
    for p in cache.rglob("*.safetensors"):
        entries[p.parent.parent.name].append(p)
    assert len(entries["latents"]) == 6  # one per image, at its bucket's shape
    assert {tuple(load_file(str(p))["latent_mean"].shape) for p in entries["latents"]} == {(4, 10, 6), (4, 6, 10), (4, 8, 8)}
    assert len(entries["text"]) == 7  # six captions and the empty one of the dropped visits


def test_shuffled_tags_with_cached_latents_equal_uncached(images, tmp_path):
    base = [*common(images), "train.steps=3", "data.shuffle_tags=true", "data.keep_tokens=1", "data.caption_dropout=0.2"]
    plain = train(tmp_path / "plain", *base)
    park = ["offload=park", f"offload.park.cache_dir={tmp_path / 'cache'}", "offload.park.cache_text=false"]
    train(tmp_path / "fill", *base, *park)
    assert_same(plain, train(tmp_path / "cached", *base, *park))


def test_resume_mid_epoch_continues_the_bucketed_order_and_captions(images, tmp_path):
    base = [*common(images), "data.shuffle_tags=true", "data.caption_dropout=0.3", "train.save_every=1",
            "train.keep_saved=10", "data.center_crop=false"]
    whole = train(tmp_path / "whole", *base, "train.steps=5")
    train(tmp_path / "part", *base, "train.steps=2")  # 3 batches per epoch: step 2 is mid-epoch
    resumed = train(tmp_path / "part", *base, "train.steps=5", f"train.resume={tmp_path / 'part'}")
    assert_same(whole, resumed)


# ---- out of memory in a bucketed step -------------------------------------------------------------
@dataclass
class BucketOOMConfig(PluginConfig):
    name: str = "test_bucket_oom"


SHAPES: list[tuple[int, ...]] = []


@register_plugin
class BucketOOM(Plugin):
    """Test only: the U-Net runs out of memory in step 1 while a micro-batch has 2 samples; records
    the latent shape of every micro-batch."""

    kind = "tiling"
    name = "test_bucket_oom"
    Config = BucketOOMConfig
    description = "test only: out of memory in step 1 for micro-batches of 2"

    def wrap_execution(self, ctx):
        self.step = 0
        unet = ctx.models["unet"]

        def hook(module, args):
            SHAPES.append(tuple(args[0].shape))
            if self.step == 1 and args[0].shape[0] > 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected)")

        handle = unet.register_forward_pre_hook(hook)
        ctx.hooks.add(unet, "test_bucket_oom", self.key, handle=handle, undo=handle.remove)

    def on_step_start(self, ctx, step):
        self.step = step + 1


def test_out_of_memory_split_of_a_bucketed_step_equals_the_smaller_micro_batch(images, tmp_path):
    base = [*common(images), "train.steps=3", "data.caption_dropout=0.5"]
    configured = train(tmp_path / "micro1", *base, "train.grad_accum=2")
    SHAPES.clear()
    split = train(tmp_path / "split", *base, "tiling=test_bucket_oom")
    assert_same(configured, split)
    rows = read_metrics(tmp_path / "split" / "metrics.jsonl")
    assert [r["oom_retries"] for r in rows] == [1, 0, 0] and [r["micro_batch_size"] for r in rows] == [1, 1, 1]
    # the failed attempt (2 samples) and the retry's two passes of one: all of the step's bucket
    assert SHAPES[0][0] == 2 and SHAPES[1][1:] == SHAPES[2][1:] == SHAPES[0][1:]
    state = json.loads((tmp_path / "split" / "checkpoints" / "step-00000003" / "state.json").read_text())
    assert state["micro_batch_size"] == 1


def test_a_users_trainer_that_uses_runner_data_gets_buckets_and_sets(images, tmp_path, caplog):
    """tests/assets/custom_trainer.py builds its dataset with runner.data.build_dataset: the options apply."""
    import sys

    assets = str(Path(__file__).resolve().parents[2] / "assets")
    sys.path.insert(0, assets)
    seen: list[tuple[int, ...]] = []
    try:
        import custom_trainer

        loss = custom_trainer.PixelDiffusionTrainer.loss

        def recording(self, models, batch):
            seen.append(tuple(batch["pixel_values"].shape))
            return loss(self, models, batch)

        custom_trainer.PixelDiffusionTrainer.loss = recording
        caplog.set_level("INFO", logger="runner")
        sets = f"data.sets=[{{path:{images},repeats:2}},{{path:{images},resolution:32}}]"
        task(compose_config([f"output_dir={tmp_path}", "trainer=custom", "train.device=cpu", "train.progress=false",
                            "trainer._target_=custom_trainer.PixelDiffusionTrainer", "data.resolution=16",
                            "data.buckets=true", "data.bucket_step=8", sets, "data.caption_dropout=0.5",
                            "train.steps=6", "train.batch_size=2", "export.enabled=false", "train.preflight=false"]))
    finally:
        custom_trainer.PixelDiffusionTrainer.loss = loss
        sys.path.remove(assets)
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 6
    assert len(seen) == 6 and len(set(seen)) > 1  # several sizes, one per batch
    assert "2 sets, 12 images" in caplog.text and "batch order:" in caplog.text
