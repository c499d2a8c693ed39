"""EMA of the trained weights (runner/ema/average.py): the formula, the schedule, skipped and retried steps,
checkpoints and resume, sampling with the EMA weights, hosted mode.

The reference is computed here from the weights each step saved (``train.save_every=1``) and the
initial weights (built as the run builds them: same seed), in float64, with the documented
formula; the runner's float32 ``lerp`` must agree to float32 rounding. Resume must be bit-exact.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed
from safetensors import safe_open
from safetensors.torch import load_file

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.ema.average import EMA, FILE, NoEMA, build_ema
from runner.errors import UserError
from runner.output.report import read_metrics
from runner.resolved import resolve

pytestmark = pytest.mark.usefixtures("one_thread")

ASSETS = Path(__file__).resolve().parents[3] / "tests" / "assets"
PIXEL = ["trainer=custom", "trainer._target_=custom_trainer.PixelDiffusionTrainer", "data.resolution=16"]
COMMON = ["train.device=cpu", "train.progress=false", "train.preflight=false", "data.demo_size=4",
          "train.batch_size=2", "optimizer.lr=1e-3", "train.save_every=1", "train.keep_saved=10"]


@pytest.fixture(autouse=True)
def assets_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS))


def overrides(out: Path, *extra: str) -> list[str]:
    return [f"output_dir={out}", *PIXEL, *COMMON, *extra]


def train(out: Path, *extra: str) -> list[dict]:
    task(compose_config(overrides(out, *extra)))
    return read_metrics(out / "metrics.jsonl")


def ckpt(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}"


def initial_weights(*extra: str) -> dict[str, torch.Tensor]:
    """The trained parameters before step 1, built as the run builds them (same seed)."""
    cfg = compose_config([*PIXEL, *COMMON, *extra])
    r = resolve(cfg)
    trainer = build_trainer(cfg, r)
    set_seed(r.seed)
    models = prepare_models(trainer.build_models("cpu"), cfg.model, r)
    return {n: p.detach().clone() for n, p in models.named_trainable_parameters()}


def reference(out: Path, steps: int, *, decay: float, warmup: bool, every: int, start: int,
              skipped: tuple[int, ...] = (), extra: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], int]:
    """The documented schedule and formula, in float64, on the weights each step saved."""
    ema = {n: w.double() for n, w in initial_weights(*extra).items()}
    k = 0
    for s in range(1, steps + 1):
        w = load_file(str(ckpt(out, s) / "trainable.safetensors"))
        if s == start:
            ema, k = {n: v.double() for n, v in w.items()}, 0
            continue
        if s in skipped or s <= start or (s - start) % every:
            continue
        d = min(decay, (1 + k) / (10 + k)) if warmup else decay
        ema = {n: d * ema[n] + (1 - d) * w[n].double() for n in ema}
        k += 1
    return ema, k


def saved_ema(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path / FILE), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def assert_matches(ema: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]):
    assert ema.keys() == ref.keys() == weights.keys() and ema
    for n in ema:
        assert ema[n].dtype == torch.float32
        torch.testing.assert_close(ema[n].double(), ref[n], rtol=1e-6, atol=1e-7, msg=n)
    assert any(not torch.equal(ema[n], weights[n]) for n in ema)  # an average, not the weights


@pytest.mark.parametrize("decay, warmup, every, start", [(0.9, True, 2, 0), (0.6, False, 2, 1), (0.8, True, 1, 0)],
                         ids=["warmup-every2", "no-warmup-start1", "warmup-every1"])
def test_ema_equals_the_reference_formula(tmp_path, decay, warmup, every, start):
    steps = 5
    train(tmp_path, f"train.steps={steps}", "ema.enabled=true", f"ema.decay={decay}", f"ema.warmup={warmup}",
          f"ema.every={every}", f"ema.start={start}")
    ref, k = reference(tmp_path, steps, decay=decay, warmup=warmup, every=every, start=start)
    ema, meta = saved_ema(ckpt(tmp_path, steps))
    assert int(meta["updates"]) == k == (steps - start) // every
    assert_matches(ema, ref, load_file(str(ckpt(tmp_path, steps) / "trainable.safetensors")))


def test_a_skipped_nonfinite_step_is_not_averaged_in(tmp_path):
    """FlakyTrainer: step 3's loss is NaN, its update is skipped; the average skips it too."""
    flaky = ["trainer._target_=flaky_trainer.FlakyTrainer", "+trainer.options.nan_positions=[4]"]
    rows = train(tmp_path, *flaky, "train.steps=4", "ema.enabled=true", "ema.decay=0.5")
    assert [r["nonfinite_skips"] for r in rows] == [0, 0, 1, 1]
    ref, k = reference(tmp_path, 4, decay=0.5, warmup=True, every=1, start=0, skipped=(3,), extra=tuple(flaky))
    ema, meta = saved_ema(ckpt(tmp_path, 4))
    assert int(meta["updates"]) == k == 3
    assert_matches(ema, ref, load_file(str(ckpt(tmp_path, 4) / "trainable.safetensors")))


def test_an_oom_retry_updates_the_average_once(tmp_path):
    """Every micro-batch of 2 runs out of memory: step 1 is retried at micro-batch 1 (and the rest run at 1)."""
    oom = ["trainer._target_=oom_trainer.OOMPixelTrainer", "+trainer.options.oom_above=1"]
    rows = train(tmp_path, *oom, "train.steps=3", "ema.enabled=true", "ema.decay=0.5")
    assert [r["oom_retries"] for r in rows] == [1, 0, 0] and rows[-1]["micro_batch_size"] == 1
    ref, k = reference(tmp_path, 3, decay=0.5, warmup=True, every=1, start=0, extra=tuple(oom))
    ema, meta = saved_ema(ckpt(tmp_path, 3))
    assert int(meta["updates"]) == k == 3
    assert_matches(ema, ref, load_file(str(ckpt(tmp_path, 3) / "trainable.safetensors")))


def test_resume_is_bit_exact_with_the_average(tmp_path):
    ema = ["ema.enabled=true", "ema.decay=0.9", "ema.every=2", "ema.device=cpu"]
    full = train(tmp_path / "full", "train.steps=5", *ema)
    train(tmp_path / "a", "train.steps=3", *ema)
    resumed = train(tmp_path / "b", "train.steps=5", *ema, f"train.resume={ckpt(tmp_path / 'a', 3)}")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]]
    a, meta_a = saved_ema(ckpt(tmp_path / "full", 5))
    b, meta_b = saved_ema(ckpt(tmp_path / "b", 5))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert meta_a["updates"] == meta_b["updates"] == "2"
    wa = load_file(str(ckpt(tmp_path / "full", 5) / "trainable.safetensors"))
    wb = load_file(str(ckpt(tmp_path / "b", 5) / "trainable.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_may_turn_the_average_on_or_off_and_move_it(tmp_path, caplog):
    """On: it starts from the resumed weights; off: the checkpoint keeps its copy; device: only storage."""
    train(tmp_path / "plain", "train.steps=2")
    with caplog.at_level(logging.INFO, logger="runner"):
        train(tmp_path / "on", "train.steps=3", "ema.enabled=true", "ema.decay=0.5",
              f"train.resume={ckpt(tmp_path / 'plain', 2)}")
    assert "has no EMA of the weights; the average starts from the resumed weights" in caplog.text
    ema, meta = saved_ema(ckpt(tmp_path / "on", 3))
    w2 = load_file(str(ckpt(tmp_path / "plain", 2) / "trainable.safetensors"))
    w3 = load_file(str(ckpt(tmp_path / "on", 3) / "trainable.safetensors"))
    assert meta["updates"] == "1"
    for n in ema:  # the first update after the resume: 0.1 * resumed weights + 0.9 * step 3's weights
        torch.testing.assert_close(ema[n].double(), 0.1 * w2[n].double() + 0.9 * w3[n].double(), rtol=1e-6, atol=1e-7)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="runner"):
        train(tmp_path / "off", "train.steps=4", f"train.resume={ckpt(tmp_path / 'on', 3)}", "ema.enabled=false")
    assert "this run does not continue it (ema.enabled=false)" in caplog.text
    assert not (ckpt(tmp_path / "off", 4) / FILE).exists() and (ckpt(tmp_path / "on", 3) / FILE).exists()
    # in-process, the saved command line is not known: repeat the EMA settings
    on = ["ema.enabled=true", "ema.decay=0.5", f"train.resume={ckpt(tmp_path / 'on', 3)}"]
    train(tmp_path / "moved", "train.steps=4", *on, "ema.device=cpu")
    train(tmp_path / "kept", "train.steps=4", *on)
    a, _ = saved_ema(ckpt(tmp_path / "moved", 4))
    b, _ = saved_ema(ckpt(tmp_path / "kept", 4))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the device is storage only: the same average


def test_a_corrupt_ema_file_is_refused_with_its_name(tmp_path):
    train(tmp_path / "a", "train.steps=1", "ema.enabled=true")
    (ckpt(tmp_path / "a", 1) / FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    with pytest.raises(UserError, match="ema.safetensors is corrupt"):
        train(tmp_path / "b", "train.steps=2", "ema.enabled=true", f"train.resume={ckpt(tmp_path / 'a', 1)}")


# ---- the object on its own ------------------------------------------------------------------------------
def _params(dtype=torch.float32) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(0)
    return [(f"p{i}", torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)))
            for i, shape in enumerate([(3, 4), (5,), (2, 2, 2)])]


def test_the_update_is_float32_for_bf16_weights_and_chunked():
    named = _params(torch.bfloat16)
    ema = EMA(named, decay=0.99, warmup=False, chunk_bytes=40)  # a chunk per tensor or two
    assert len(list(ema._chunks())) > 1 and all(s.dtype == torch.float32 for s in ema.shadow)
    start = [s.clone() for s in ema.shadow]
    with torch.no_grad():
        for _, p in named:
            p.add_(1.0)
    ema.update(1, applied=True)
    for s, s0, (_, p) in zip(ema.shadow, start, named):
        torch.testing.assert_close(s, 0.99 * s0 + 0.01 * p.float(), rtol=1e-6, atol=1e-6)
    before = [s.clone() for s in ema.shadow]
    ema.update(2, applied=False)  # a skipped step: nothing to average in
    assert all(torch.equal(a, b) for a, b in zip(before, ema.shadow)) and ema.updates == 1


def test_applied_swaps_the_average_in_and_the_weights_back_exactly():
    named = _params()
    ema = EMA(named, decay=0.5, warmup=False)
    with torch.no_grad():
        for _, p in named:
            p.mul_(3.0).add_(0.1)
    ema.update(1, applied=True)
    weights = [p.detach().clone() for _, p in named]
    with ema.applied():
        assert all(torch.equal(p, s) for (_, p), s in zip(named, ema.shadow))
    assert all(torch.equal(p, w) for (_, p), w in zip(named, weights))


def test_disabled_is_a_no_op_and_bad_values_are_refused(tmp_path):
    assert isinstance(NoEMA().applied().__enter__(), type(None))
    for bad, needle in [("ema.decay=1.0", "ema.decay=1.0"), ("ema.every=0", "ema.every=0"),
                        ("ema.start=-1", "ema.start=-1"), ("ema.device=cuda", "Valid values: cpu, device"),
                        ("ema.dtype=float16", "ema.dtype='float16'"), ("ema.dtype=bfloat16", "model.train_dtype")]:
        with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(".", r"\.")):
            validate(compose_config([f"output_dir={tmp_path}", "ema.enabled=true", bad]))
    with pytest.raises(UserError, match="sample.use_ema=true"):
        validate(compose_config([f"output_dir={tmp_path}", "sample.every=1", "sample.prompts=[a]",
                                 "sample.use_ema=true"]))
    with pytest.raises(UserError, match=r"Did you mean 'decay'"):
        compose_config(["ema.decya=0.9"])


def test_the_ema_dtype_is_decided_once_in_the_resolved_run():
    bf16 = ["model.train_dtype=bfloat16", "train.mixed_precision=bf16", "ema.enabled=true"]
    assert resolve(compose_config(["ema.enabled=true"]), target="cuda", device=torch.device("meta")).ema_dtype \
        == torch.float32
    assert resolve(compose_config(bf16), target="cuda", device=torch.device("meta")).ema_dtype == torch.float32
    assert resolve(compose_config([*bf16, "ema.dtype=bfloat16"]), target="cuda",
                   device=torch.device("meta")).ema_dtype == torch.bfloat16
    assert resolve(compose_config([*bf16, "ema.dtype=bfloat16"]), target="cpu").ema_dtype == torch.float32  # CPU policy
    assert resolve(compose_config([])).ema_dtype is None


def test_hosted_mode_averages_after_each_logged_step(tmp_path):
    from runner.hosted import session

    hosted = session(["train.device=cpu", "ema.enabled=true", "ema.decay=0.5", "ema.warmup=false"], tmp_path)
    model = torch.nn.Linear(4, 2)
    model, opt, _ = hosted.prepare(model, lambda ps: torch.optim.SGD(ps, lr=0.1))
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    hosted.log(loss)
    hosted.finish()
    saved = load_file(str(tmp_path / FILE))
    for n, p in model.named_parameters():
        torch.testing.assert_close(saved[f"model.{n}"], 0.5 * w0[n] + 0.5 * p.detach(), rtol=1e-6, atol=1e-7)


def test_build_ema_follows_the_config(tmp_path):
    from runner_setup import prepared_context

    ctx = prepared_context(tmp_path, *PIXEL, "train.device=cpu", "data.demo_size=2")
    assert isinstance(build_ema(ctx), NoEMA)
    ctx = prepared_context(tmp_path, *PIXEL, "train.device=cpu", "data.demo_size=2", "ema.enabled=true",
                           "ema.device=cpu")
    ema = build_ema(ctx)
    assert ema.on_host and ema.nbytes() == {"cpu": sum(p.numel() * 4 for p in ctx.models.trainable_parameters())}
    assert json.loads(json.dumps(ema.metadata()))["updates"] == "0"


@pytest.mark.parametrize("on_host", [False, True], ids=["beside-weights", "cpu"])
def test_streamed_and_offloaded_weights_are_averaged_and_swapped_exactly(on_host):
    """offload=stream keeps streamed blocks' weights in host copies with device twins per use, and
    offload=optimizer steps host masters and copies them back (``always_copy``: distinct tensors on
    CPU too). The average must read the weights the optimizer updated, and ``applied()`` must make
    the next forward use the average (a stale device copy would show) and then the weights again."""
    from tiny_training import tiny_trainer

    from runner.plugins.optimizer_wrappers import HostStepOptimizer
    from runner.plugins.stream import apply_stream_offload

    tr = tiny_trainer("sdxl", "full")
    torch.manual_seed(0)
    models = tr.build_models("cpu")
    unet = models["unet"]
    unet.train()
    budget = int(0.5 * sum(p.numel() * p.element_size() for p in unet.parameters()))
    handle = apply_stream_offload(unet, models.blocks["unet"], budget, 1, "cpu", "cpu", always_copy=True, name="unet")
    assert handle.plan.streamed
    named = list(models.named_trainable_parameters())
    opt = HostStepOptimizer(torch.optim.AdamW([p for _, p in named], lr=1e-3, foreach=False), always_copy=True)
    ema = EMA(named, decay=0.5, warmup=False, on_host=on_host)
    ref = {n: p.detach().double().clone() for n, p in named}
    batch = tr.example_batch(2, "cpu")
    for step in (1, 2):
        tr.loss(models, batch).backward()
        opt.step()
        opt.zero_grad()
        ema.update(step, applied=True)
        ref = {n: 0.5 * ref[n] + 0.5 * p.detach().double() for n, p in named}
    for (n, _), s in zip(named, ema.shadow):
        torch.testing.assert_close(s.double(), ref[n], rtol=1e-6, atol=1e-7, msg=n)
    torch.manual_seed(0)
    plain = tr.build_models("cpu")  # the same architecture, not streamed, holding the average
    with torch.no_grad():
        for (n, _), s in zip(named, ema.shadow):
            plain["unet"].get_parameter(n.removeprefix("unet.")).copy_(s)
    unet.eval()
    plain["unet"].eval()
    with torch.no_grad():
        before = tr.loss(models, batch)
        with ema.applied():
            during = tr.loss(models, batch)
        after = tr.loss(models, batch)
        expected = tr.loss(plain, batch)
    assert torch.equal(before, after) and not torch.equal(before, during)
    torch.testing.assert_close(during, expected, rtol=1e-5, atol=1e-6)
    handle.remove()
    opt.remove()
