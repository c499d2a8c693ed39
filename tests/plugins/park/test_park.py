"""offload=park: frozen modules parked on the host, encoder outputs cached to disk.

Equality is tested exactly (``==`` on losses): a cached run must draw the same VAE posterior
sample per sample seed and feed the denoiser the same tensors as an uncached run. Bytes come
from the live-bytes tracker; "device" on this CPU-only machine is either the CPU itself (same
code path, no copies) or ``meta``, which stands in for a second device where a test must see
weights arrive and leave.
"""
from __future__ import annotations

import logging
import weakref
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed
from test_swap import module_bytes, tiny_vae  # tests/plugins/park/test_swap.py
from torch import nn

from runner.parts import build_plugins, build_trainer, idle_parts, make_context, prepare_models
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.context import RunContext
from runner.data import FolderDataset, collate
from runner.data.order import SampleOrder
from runner.errors import UserError
from runner.module_changes import marked
from runner.loop import train
from runner.memory.live_bytes import LiveBytesTracker
from runner.plugin import PluginSchedule
from runner.plugins.park import (
    Park,
    ParkConfig,
    ParkedModule,
    park_and_cache,
)
from runner.plugins.park.cache import (
    EncoderCache,
    SampleFingerprints,
    fill_cache,
    plan_cache,
)
from runner.resolved import resolve
from runner.session import make_accelerator
from runner.trainer import ModelSet, encode

ASSETS = Path(__file__).resolve().parents[3] / "tests" / "assets"


# One intra-op thread (tests/conftest.py): faster tiny ops, bitwise-reproducible runs.
pytestmark = pytest.mark.usefixtures("one_thread")


# ---- runs ---------------------------------------------------------------------------------------
def start(tmp: Path, *overrides: str, before_apply=None) -> RunContext:
    """The steps of runner.__main__.run up to the loop, returning the context."""
    cfg = compose_config([f"output_dir={tmp}", "train.progress=false", "data.demo_size=4", "train.steps=3", *overrides])
    validate(cfg)
    run = resolve(cfg)
    ctx = make_context(cfg, run, build_plugins(cfg, run), tmp)
    ctx.run_phase("configure_process")
    ctx.trainer = build_trainer(cfg, run)
    set_seed(run.seed)
    ctx.models = prepare_models(ctx.trainer.build_models("cpu"), cfg.model, run)
    ctx.accelerator = make_accelerator(run)
    if before_apply is not None:
        before_apply(ctx)
    ctx.apply_setup_phases()
    return ctx


def run_losses(tmp: Path, *overrides: str, before_apply=None) -> tuple[list[float], RunContext]:
    ctx = start(tmp, *overrides, before_apply=before_apply)
    try:
        result = train(ctx)
    finally:
        ctx.teardown()
    return result.losses, ctx


def count_calls(ctx: RunContext, calls: dict[str, int]) -> None:
    """Count every call of every submodule of the frozen modules (convs, linears, embeddings)."""
    for name, module in ctx.models.frozen().items():
        calls.setdefault(name, 0)
        for sub in module.modules():
            def hook(mod, args, _name=name):
                calls[_name] += 1
            sub.register_forward_pre_hook(hook)


def cache_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.safetensors"))


def test_sdxl_cached_runs_equal_uncached_and_second_run_never_calls_encoders(tmp_path, caplog):
    cache = tmp_path / "cache"
    park = ["offload=park", f"offload.park.cache_dir={cache}"]
    base, _ = run_losses(tmp_path / "base")

    first_calls: dict[str, int] = {}
    with caplog.at_level(logging.INFO, logger="runner"):
        first, ctx1 = run_losses(tmp_path / "first", *park, before_apply=lambda c: count_calls(c, first_calls))
    assert "encoding 8 entries (latents: 4, text: 4) in batches of 2" in caplog.text
    files = cache_files(cache)
    assert len(files) == 8 and not list(cache.rglob(".tmp-*"))
    mtimes = [f.stat().st_mtime_ns for f in files]
    assert all(n > 0 for n in first_calls.values())  # the pre-pass ran every encoder

    second_calls: dict[str, int] = {}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="runner"):
        second, ctx2 = run_losses(tmp_path / "second", *park, before_apply=lambda c: count_calls(c, second_calls))
    assert "latents 4/4 entries cached, text 4/4 entries cached" in caplog.text
    assert "encoding" not in caplog.text

    # Identical losses, bit for bit: the posterior sample is drawn from each sample's seed.
    assert base == first == second, (base, first, second)
    # The second run never called an encoder, and they are gone from the ModelSet.
    assert second_calls == {"vae": 0, "text_encoder": 0, "text_encoder_2": 0}
    assert set(ctx2.models.modules) == {"unet"}
    assert ctx2.facts.encode_on_device is False
    assert ctx2.facts.dropped == {"text_encoder", "text_encoder_2", "vae"}
    assert [f.stat().st_mtime_ns for f in cache_files(cache)] == mtimes  # nothing rewritten
    # teardown restored the trainer's own encode and dataset
    assert "encode" not in ctx2.trainer.__dict__ and "dataset" not in ctx2.trainer.__dict__


def test_random_flip_cached_runs_equal_uncached_with_both_orientations_cached(tmp_path, caplog):
    """data.random_flip flips per visit: the cache holds each image in both orientations (kohya's
    flip_aug), each visit reads the one its seed chose, and the losses equal the uncached run's."""
    cache = tmp_path / "cache"
    flip = ["data.random_flip=true", "train.steps=4"]
    park = ["offload=park", f"offload.park.cache_dir={cache}"]
    plain, _ = run_losses(tmp_path / "plain", "train.steps=4")
    base, _ = run_losses(tmp_path / "base", *flip)
    assert base != plain  # the flips are applied (some visits of the 4 images are mirrored)
    with caplog.at_level(logging.INFO, logger="runner"):
        first, ctx = run_losses(tmp_path / "first", *flip, *park)
    assert "encoding 12 entries (latents: 8, text: 4)" in caplog.text  # 4 images x 2 orientations; text once
    second, ctx2 = run_losses(tmp_path / "second", *flip, *park)
    assert base == first == second, (base, first, second)
    assert set(ctx2.models.modules) == {"unet"}  # every orientation cached: the encoders are dropped
    # A run without flips reads only the unflipped entries, which the flip run wrote too.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="runner"):
        unflipped, _ = run_losses(tmp_path / "unflipped", "train.steps=4", *park)
    assert "latents 4/4 entries cached, text 4/4 entries cached" in caplog.text
    assert unflipped == plain


def step_bytes(ctx: RunContext, positions: tuple[int, int] = (0, 2)) -> dict:
    """One encode + loss + backward on the run's first batch under the tracker (weights tracked)."""
    trainer, models = ctx.trainer, ctx.models
    dataset = trainer.dataset()
    order = SampleOrder(len(dataset), ctx.cfg.train.seed)
    raw = collate([dataset[i] for i in order.indices(*positions)])
    raw["sample_seed"] = order.sample_seeds(*positions)
    for _, m in models.items():
        m.zero_grad(set_to_none=True)
    tracker = LiveBytesTracker()
    weights = sum(tracker.track(m, "weights") for _, m in models.items())
    with tracker:
        with tracker.phase("forward"):
            loss = trainer.loss(models, encode(trainer, models, raw))
        with tracker.phase("backward"):
            loss.backward()
    snap = tracker.snapshot()["devices"]["cpu"]
    return {"weights": weights, "peak": snap["peak_bytes"], "loss": loss.item()}


def test_full_cache_step_holds_no_encoder_weights(tmp_path, capsys):
    cache = tmp_path / "cache"
    base = start(tmp_path / "base")
    frozen = {n: module_bytes(m) for n, m in base.models.frozen().items()}
    start(tmp_path / "fill", "offload=park", f"offload.park.cache_dir={cache}")  # fills the cache
    refs = {}
    cached = start(tmp_path / "cached", "offload=park", f"offload.park.cache_dir={cache}",
                   before_apply=lambda c: refs.update({n: weakref.ref(m) for n, m in c.models.frozen().items()}))
    assert sorted(refs) == ["text_encoder", "text_encoder_2", "vae"]
    assert all(r() is None for r in refs.values())  # freed, not just moved

    b, c = step_bytes(base), step_bytes(cached)
    with capsys.disabled():
        print(f"\ntiny SDXL step, weights: uncached {b['weights']} B, full cache {c['weights']} B "
              f"(encoders {sum(frozen.values())} B: {frozen}); step peak: {b['peak']} B vs {c['peak']} B")
    assert b["loss"] == c["loss"]
    assert c["weights"] == module_bytes(cached.models["unet"])
    assert b["weights"] - c["weights"] == sum(frozen.values())  # exactly the VAE and both text encoders
    assert b["peak"] - c["peak"] >= sum(frozen.values())  # and their activations and the pixels on top


def test_flux_text_only_cache_parks_the_vae(tmp_path):
    """flux_24gb's proposal: cache the embeddings (T5 + CLIP dropped), keep the VAE parked."""
    common = ["trainer=flux", "data.resolution=32"]
    base, _ = run_losses(tmp_path / "base", *common)
    park = [*common, "offload=park", f"offload.park.cache_dir={tmp_path / 'cache'}", "offload.park.cache_latents=false"]
    first, ctx1 = run_losses(tmp_path / "first", *park)
    second, ctx2 = run_losses(tmp_path / "second", *park)
    assert base == first == second
    assert set(ctx2.models.modules) == {"transformer", "vae"}
    assert ctx2.facts.parked == {"vae"} and ctx2.facts.encode_on_device is True
    assert "vae" in ctx2.facts.placed
    assert {p.parent.parent.name for p in cache_files(tmp_path / "cache")} == {"text"}


def test_simulate_drops_cached_modules_without_touching_disk(tmp_path):
    ctx = start(tmp_path, "trainer=sdxl")
    trainer = ctx.trainer
    models = trainer.build_models("meta")
    # (the planner's host is fake ``cpu``; plain meta tensors cannot be copied to a real host)
    result = park_and_cache(trainer, models, "meta", host="meta", cache_dir=str(tmp_path / "never"), cache_text=True,
                            cache_latents=False, simulate=True)
    assert set(models.modules) == {"unet", "vae"} and sorted(result.dropped) == ["text_encoder", "text_encoder_2"]
    assert not (tmp_path / "never").exists()


# ---- cache keys ---------------------------------------------------------------------------------
def write_folder(root: Path, captions: dict[str, str]) -> None:
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    for i, (name, caption) in enumerate(captions.items()):
        Image.new("RGB", (40, 48), (40 * i, 100, 200)).save(root / f"{name}.png")
        (root / f"{name}.txt").write_text(caption)


def test_keys_follow_content_and_settings(tmp_path):
    data = tmp_path / "data"
    write_folder(data, {"a": "a cat", "b": "a cat", "c": "a dog"})
    ctx = start(tmp_path / "run", f"data.path={data}", "data.resolution=32")
    trainer = ctx.trainer
    cache = EncoderCache(tmp_path / "cache")
    ds = trainer.dataset()
    assert isinstance(ds, FolderDataset)
    plan = plan_cache(trainer, ds, ["latents", "text"], cache)
    assert len(set(plan.keys["latents"])) == 3
    assert plan.keys["text"][0] == plan.keys["text"][1] != plan.keys["text"][2]  # same caption, one entry
    assert plan.missing == {"latents": [0, 1, 2], "text": [0, 2]}

    n = fill_cache(trainer, ctx.models, ds, plan, cache, batch_size=2, device="cpu")
    assert n == 5 and len(cache_files(cache.root)) == 5
    assert plan_cache(trainer, ds, ["latents", "text"], cache).missing_count() == 0

    # A changed image changes its latent key only; a changed caption its text key only.
    from PIL import Image

    Image.new("RGB", (40, 48), (1, 2, 3)).save(data / "c.png")
    (data / "a.txt").write_text("a red cat")
    again = plan_cache(trainer, trainer.dataset(), ["latents", "text"], cache)
    assert again.keys["latents"][:2] == plan.keys["latents"][:2] and again.keys["latents"][2] != plan.keys["latents"][2]
    assert again.keys["text"][0] != plan.keys["text"][0] and again.keys["text"][1:] == plan.keys["text"][1:]
    # Settings: resolution changes latents, not text; a runner setting (e.g. tiling) changes both.
    other = start(tmp_path / "run2", f"data.path={data}", "data.resolution=64").trainer
    res = plan_cache(other, other.dataset(), ["latents", "text"], cache)
    assert res.keys["text"] == again.keys["text"] and set(res.keys["latents"]).isdisjoint(again.keys["latents"])
    tiled = plan_cache(trainer, trainer.dataset(), ["latents", "text"], cache, {"tiling": {"name": "vae"}})
    assert set(tiled.keys["text"]).isdisjoint(again.keys["text"])


def test_demo_fingerprints_are_pixel_hashes_with_the_orientation(tmp_path):
    from runner.data import DemoDataset

    fps = SampleFingerprints(DemoDataset(8, 32))
    assert fps.image(3) != fps.image(3, flip=True) and fps.image(3) != fps.image(4)
    assert fps.image(3)["pixels_sha256"] == fps.image(3, flip=True)["pixels_sha256"]  # one image, two views
    assert fps.caption(3) == SampleFingerprints(DemoDataset(8, 32)).caption(3)


# ---- validation ---------------------------------------------------------------------------------
def test_trainer_without_cacheable_encode_step_is_parked_not_cached(tmp_path, monkeypatch, caplog):
    """No longer refused at validation: with cache_latents/cache_text on (the defaults) the run proceeds,
    caches nothing and parks the frozen modules."""
    monkeypatch.syspath_prepend(str(ASSETS))
    custom = ["trainer=custom", "trainer._target_=custom_trainer.PixelDiffusionTrainer", "data.resolution=16"]
    park = ["offload=park", f"offload.park.cache_dir={tmp_path / 'cache'}"]
    validate(compose_config([*custom, *park]))

    def add_frozen(ctx: RunContext) -> None:  # the pixel trainer has no frozen module of its own
        ctx.models.modules["frozen"] = tiny_vae()

    base, _ = run_losses(tmp_path / "base", *custom, before_apply=add_frozen)
    with caplog.at_level(logging.INFO, logger="runner"):
        parked, ctx = run_losses(tmp_path / "park", *custom, *park, before_apply=add_frozen)
    assert len(parked) == 3 and base == parked
    assert "PixelDiffusionTrainer has no cacheable encode step (encode_parts); frozen modules are parked, nothing is cached" \
        in caplog.text
    assert ctx.facts.parked == {"frozen"} and "frozen" in ctx.facts.placed
    assert not ctx.facts.dropped and not ctx.facts.cached_parts and not ctx.facts.encode_replaced
    assert ctx.facts.encode_on_device is False  # the trainer has no encode step at all
    assert not (tmp_path / "cache").exists()  # nothing cached, nothing written
    assert "encode" not in ctx.trainer.__dict__ and "dataset" not in ctx.trainer.__dict__
    assert marked(ctx.models["frozen"], "park") is None  # teardown unparked it


def test_validation_errors(tmp_path):
    with pytest.raises(UserError, match=r"offload.park.encode_batch_size=0 is not valid"):
        validate(compose_config(["offload=park", "offload.park.encode_batch_size=0", f"offload.park.cache_dir={tmp_path}"]))


def test_unwritable_cache_dir_is_a_user_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    # Refused before training starts (at validation or when park sets up its cache).
    with pytest.raises(UserError, match=r"offload.park.cache_dir='.*a_file/latents' is not a writable folder"):
        start(tmp_path / "run", "offload=park", f"offload.park.cache_dir={blocker}/latents")


def test_plugin_sets_planner_flags_and_order(tmp_path):
    cfg = compose_config(["offload=park", f"offload.park.cache_dir={tmp_path}", "checkpoint=blocks", "train.device=cpu"])
    run = resolve(cfg)
    schedule = build_plugins(cfg, run)
    assert [p.key for p in schedule.by_phase["place_models"]] == ["offload/park"]
    assert Park(ParkConfig(), run).implements("teardown")
    ctx = RunContext(run=run, schedule=PluginSchedule.build([Park(ParkConfig(cache_latents=False, cache_text=False), run)]), **idle_parts(run))
    ctx.models = ModelSet({"unet": nn.Linear(2, 2), "te": nn.Linear(2, 2).requires_grad_(False)}, trained={"unet"})
    ctx.run_phase("claim_modules")
    assert [(c.module, c.action, c.owner) for c in ctx.facts.claims] == [("te", "park", "offload/park")]
    ctx.run_phase("place_models")
    assert ctx.facts.parked == {"te"} and ctx.facts.dropped == set() and ctx.facts.placed == {"te"}
    assert isinstance(marked(ctx.models["te"], "park"), ParkedModule)
    ctx.teardown()
    assert marked(ctx.models["te"], "park") is None


def test_cache_keys_name_only_the_settings_that_touch_their_modules(tmp_path):
    """A text embedding's key does not hold the denoiser's quantization or the VAE's tiling (switching
    presets re-encoded every caption); the latents' key holds the VAE's tiling."""
    text, latents = ["text_encoder", "text_encoder_2"], ["vae"]
    plain = start(tmp_path / "plain", "model.train=lora")
    other = start(tmp_path / "other", "model.train=lora", "tiling=vae", "tiling.vae.vae_tiling=true",
                  "quantization=nf4", "quantization.nf4.modules=[unet]")
    try:
        assert other.facts.quantized.keys() == {"unet"}
        assert other.encoder_signature(text) == plain.encoder_signature(text)
        assert other.encoder_signature(latents) != plain.encoder_signature(latents)
        assert "tiling/vae" in other.encoder_signature(latents) and "quantization/nf4" not in other.encoder_signature(latents)
        assert {"tiling/vae", "quantization/nf4"} <= set(other.encoder_signature())  # the whole run's
        te = start(tmp_path / "te", "model.train=lora", "quantization=nf4", "quantization.nf4.modules=[text_encoder]")
        try:
            assert "quantization/nf4" in te.encoder_signature(text)  # a quantized encoder computes other embeddings
        finally:
            te.teardown()
    finally:
        plain.teardown()
        other.teardown()


def test_a_sample_that_encodes_to_nan_is_refused_by_name_not_cached(tmp_path):
    """A latent holding NaN (a broken image) was cached with a valid checksum and then skipped as a
    non-finite step on every visit, never named: it is refused when encoded, naming its file."""
    from PIL import Image

    data = tmp_path / "data"
    write_folder(data, {"a": "a cat", "b": "a dog", "c": "a cow"})
    Image.new("RGB", (40, 48), (255, 255, 255)).save(data / "b.png")  # the "broken" one: all white here

    def broken_pixels(ctx):
        encode = ctx.trainer.encode_part

        def encode_part(models, part, batch):
            out = encode(models, part, batch)
            if part == "latents":
                white = batch["pixel_values"].flatten(1).amin(1) > 0.99  # the all-white sample encodes to NaN
                out = {k: torch.where(white.view(-1, *[1] * (v.dim() - 1)), torch.nan, v) for k, v in out.items()}
            return out

        ctx.trainer.encode_part = encode_part

    with pytest.raises(UserError, match=r"The encoder cache's 'latents' entry of .*b\.png holds NaN or inf"):
        start(tmp_path / "run", f"data.path={data}", "data.resolution=32", "offload=park",
              f"offload.park.cache_dir={tmp_path / 'cache'}", before_apply=broken_pixels)
    from safetensors.torch import load_file

    for entry in (tmp_path / "cache").rglob("*.safetensors"):  # what was cached before the refusal is finite
        assert all(bool(torch.isfinite(v).all()) for v in load_file(str(entry)).values() if v.is_floating_point())


def test_a_run_waits_for_another_filling_the_same_cache_and_encodes_only_what_is_left(tmp_path, caplog):
    """Two runs sharing one cache encoded most entries twice: the second now waits for the first's fill
    (a lock on the cache) and plans again, finding its entries."""
    import fcntl
    import shutil
    import threading
    import time

    cache = tmp_path / "cache"
    args = ("data.demo_size=4", "offload=park", f"offload.park.cache_dir={cache}")
    first = start(tmp_path / "first", *args)
    park = next(p for p in first.schedule.plugins if p.key == "offload/park")
    assert park.result.encoded > 0
    first.teardown()
    saved = tmp_path / "saved"
    shutil.copytree(cache, saved, ignore=shutil.ignore_patterns(".filling.lock"))
    for part in [d for d in cache.iterdir() if d.is_dir()]:
        shutil.rmtree(part)  # as if the other run had not written them yet

    held, planned = threading.Event(), threading.Event()
    import runner.plugins.park as park_module

    plan_cache = park_module.plan_cache

    def planning(*a, **k):  # the second run found the entries missing: the other run may now finish
        out = plan_cache(*a, **k)
        planned.set()
        return out

    def other_run() -> None:  # holds the lock while it "encodes", writes the entries, releases
        with open(cache / ".filling.lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            held.set()
            planned.wait(60)
            time.sleep(0.3)
            shutil.copytree(saved, cache, dirs_exist_ok=True)
            fcntl.flock(f, fcntl.LOCK_UN)

    caplog.set_level("INFO", logger="runner")
    thread = threading.Thread(target=other_run)
    thread.start()
    held.wait(10)
    try:
        park_module.plan_cache = planning
        second = start(tmp_path / "second", *args)
    finally:
        park_module.plan_cache = plan_cache
        planned.set()
        thread.join()
    park = next(p for p in second.schedule.plugins if p.key == "offload/park")
    assert park.result.encoded == 0  # everything came from the other run
    assert any("another run is filling" in r.getMessage() for r in caplog.records)
    second.teardown()
