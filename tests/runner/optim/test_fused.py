"""Fused backward (runner/optim/fused.py): the same weights as the normal step, the bytes it saves, and what
happens around it (NaN guard, OOM, checkpoints and resume, refusals: prodigy and adamw_schedulefree, whose
update couples the parameters, are refused in tests/runner/optim/test_optimizers.py).

Equality claim: with ``train.max_grad_norm=0`` and ``train.grad_accum=1`` each optimizer here
updates every parameter from that parameter's gradient alone, so stepping them one at a time inside
backward executes the same kernels on the same values as one ``step()`` after it: the weights
are bit-identical (``torch.equal``, one intra-op thread). A skipped, repeated or reordered update
would not be.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from planner_truth import _Phases, prepared_step
from safetensors.torch import load_file

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.cli.launch import run_job
from runner.checks import validate
from runner.errors import UserError
from runner.memory.live_bytes import LiveBytesTracker
from runner.optim.fused import FusedBackward, NotFused, fusion_of
from runner.output.report import read_metrics
from runner.plan import plan_step
from runner.plugin import Plugin, PluginConfig
from runner.registry import register_plugin

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[3]
ASSETS = ROOT / "tests" / "assets"
PIXEL = ["trainer=custom", "trainer._target_=custom_trainer.PixelDiffusionTrainer", "data.resolution=16"]
COMMON = ["train.device=cpu", "train.progress=false", "train.preflight=false", "data.demo_size=4", "export.enabled=false",
          "train.max_grad_norm=0", "train.batch_size=2"]


@pytest.fixture(autouse=True)
def _assets_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ASSETS))


def train_job(out: Path, *overrides: str) -> int:
    """One job as `python -m runner` runs it; its exit code."""
    try:
        run_job(task, compose_config([f"output_dir={out}", *COMMON, *overrides]))
        return 0
    except SystemExit as e:
        return int(e.code)


def weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / f"step-{step:08d}" / "trainable.safetensors")


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} of {len(a)} tensors differ, e.g. {different[:3]}"


# ---- the same result as the normal step -------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adafactor", "lion", "lion8bit", "came"])
def test_fused_backward_gives_the_normal_steps_weights_bit_for_bit(tmp_path, optimizer):
    # A schedule that changes the rate every step: the scheduler must reach the fused steps too.
    run_args = [*PIXEL, f"optimizer={optimizer}", "train.steps=3", "train.lr_scheduler=linear",
                "train.lr_warmup_steps=1", "optimizer.lr=1e-3"]
    assert train_job(tmp_path / "normal", *run_args) == 0
    assert train_job(tmp_path / "fused", *run_args, "optimizer.fused_backward=true") == 0
    assert_same(weights(tmp_path / "normal", 3), weights(tmp_path / "fused", 3))
    normal, fused = read_metrics(tmp_path / "normal" / "metrics.jsonl"), read_metrics(tmp_path / "fused" / "metrics.jsonl")
    assert [r["loss"] for r in normal] == [r["loss"] for r in fused]
    assert [r["lr"] for r in normal] == [r["lr"] for r in fused] and len({r["lr"] for r in fused}) > 1


def test_fused_backward_with_lora_on_the_sdxl_unet(tmp_path):
    args = ["data.resolution=32", "model.train=lora", "train.steps=2", "optimizer.lr=1e-3"]
    assert train_job(tmp_path / "normal", *args) == 0
    assert train_job(tmp_path / "fused", *args, "optimizer.fused_backward=true") == 0
    assert_same(weights(tmp_path / "normal", 2), weights(tmp_path / "fused", 2))


def test_a_fused_checkpoint_resumes_exactly_with_fusion_on_or_off(tmp_path):
    args = [*PIXEL, "optimizer=adamw8bit", "train.save_every=1", "train.keep_saved=3"]
    assert train_job(tmp_path / "straight", *args, "train.steps=3", "optimizer.fused_backward=true") == 0
    assert train_job(tmp_path / "cut", *args, "train.steps=1", "optimizer.fused_backward=true") == 0
    for fused in ("true", "false"):  # the checkpoint holds the plain optimizer's state: either way resumes it
        out = tmp_path / f"resumed_{fused}"
        code = train_job(out, *args, "train.steps=3", f"optimizer.fused_backward={fused}",
                         f"train.resume={tmp_path / 'cut'}")
        assert code == 0
        assert_same(weights(tmp_path / "straight", 3), weights(out, 3))


def test_per_parameter_clipping_clips_each_gradient_by_its_own_norm():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    twin.load_state_dict(net.state_dict())
    fused = FusedBackward(torch.optim.SGD(net.parameters(), lr=0.5), max_grad_norm=0.01)
    plain = torch.optim.SGD(twin.parameters(), lr=0.5)
    x = torch.randn(16, 4)
    net(x).pow(2).sum().backward()
    twin(x).pow(2).sum().backward()
    for p in twin.parameters():  # what fused backward does in each hook
        torch.nn.utils.clip_grad_norm_([p], 0.01)
    plain.step()
    assert all(p.grad is None for p in net.parameters())  # each freed in its hook
    for a, b in zip(net.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert fused.stepped == 4 and not fused.skipped



def test_a_gradient_left_after_backward_steps_in_step_and_is_reported(caplog):
    """A parameter whose hook never ran (its gradient set outside autograd, as a wrapper replacing the
    parameters would leave it) still steps, in ``step()``, and the run says so once: the memory fused
    backward promises was not freed for it (the FSDP test asserts this message never appears)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    fused = FusedBackward(torch.optim.SGD(net.parameters(), lr=0.5))
    before = net.weight.detach().clone()
    net.weight.grad = torch.ones_like(net.weight)
    with caplog.at_level("WARNING", logger="runner"):
        fused.step()
        net.weight.grad = torch.ones_like(net.weight)
        fused.step()
    assert torch.equal(net.weight.detach(), before - 1.0)  # stepped twice with lr 0.5
    assert net.weight.grad is None and fused.stepped == 2
    assert [r.getMessage() for r in caplog.records].count(
        "fused backward: 1 parameters still held a gradient after backward and stepped only then (their "
        "post-accumulate-grad hooks did not run), e.g. parameter (2, 4)") == 1
    net(torch.randn(3, 4)).sum().backward()  # a normal backward: every gradient stepped and freed in its hook
    assert net.weight.grad is None and net.bias.grad is None and fused.stepped == 4

# ---- bytes: planned and tracked peaks drop by about the gradient bytes ----------------------------------
SAVING = ["train.device=cpu", "data.resolution=64", "train.max_grad_norm=0", "checkpoint=blocks"]


def tracked_peak(cfg) -> tuple[int, int]:
    """(peak, gradient bytes) of the second of two real CPU steps, tracked with the loop's own code."""
    from runner.loop import forward_backward
    from runner.optim.fused import fuse_into_backward

    ctx, params, raw, micro = prepared_step(cfg)
    ctx.optimizer = fuse_into_backward(ctx.optimizer, cfg.optimizer, ctx.run)
    tracker = LiveBytesTracker()
    for name, m in ctx.models.items():
        tracker.track(m, "weights", module=name)
    tracker.track({k: v for k, v in raw.items() if isinstance(v, torch.Tensor)}, "other")
    grads = 0
    try:
        with tracker:
            for step in range(2):
                if step == 1:
                    tracker.reset_peaks()
                forward_backward(ctx, raw, micro, _Phases(tracker))
                grads = max(grads, sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None))
                with tracker.phase("optimizer"):
                    ctx.optimizer.step()
                ctx.optimizer.zero_grad(set_to_none=True)
    finally:
        ctx.teardown()
    return tracker.snapshot()["devices"]["cpu"]["peak_bytes"], grads


def test_planned_and_tracked_peaks_drop_by_about_the_gradient_bytes():
    normal = compose_config(SAVING)
    fused = compose_config([*SAVING, "optimizer.fused_backward=true"])
    validate(normal), validate(fused)
    plan_n, plan_f = plan_step(normal), plan_step(fused)
    grad_bytes = plan_n.by_category["gradients"]
    n_params = sum(p.numel() for p in prepared_step(normal)[1])
    assert grad_bytes == 4 * n_params  # float32 gradients of the whole U-Net are alive at the normal peak
    # at most the gradient of the parameter whose hook is running (its update's one-parameter copies peak there)
    largest = max(p.numel() for p in prepared_step(normal)[1]) * 4
    assert plan_f.by_category.get("gradients", 0) <= largest
    assert 0.8 * grad_bytes <= plan_n.peak_bytes - plan_f.peak_bytes <= grad_bytes
    assert plan_f.optimizer_state_bytes == plan_n.optimizer_state_bytes  # the same state, alive all along
    (real_n, real_grads), (real_f, fused_grads) = tracked_peak(normal), tracked_peak(fused)
    assert real_grads == grad_bytes and fused_grads == 0
    assert 0.8 * grad_bytes <= real_n - real_f <= grad_bytes
    assert plan_f.peak_bytes == pytest.approx(real_f, rel=0.05)


# ---- the NaN guard -----------------------------------------------------------------------------------
@dataclass
class PoisonConfig(PluginConfig):
    name: str = "test_poison_grad"
    step: int = 2  # 1-based step in which the gradient is poisoned
    parameter: str = "conv_out.bias"  # of the trained unet
    oom: bool = False  # raise torch.OutOfMemoryError instead of poisoning


@register_plugin
class PoisonGrad(Plugin):
    """Test only: in one step, one parameter's gradient becomes NaN (or its computation runs out of memory)."""

    kind = "tiling"
    name = "test_poison_grad"
    Config = PoisonConfig
    description = "test only: a NaN gradient or an OOM in backward"

    def wrap_execution(self, ctx):
        self.step = 0
        p = dict(ctx.models["unet"].named_parameters())[self.config.parameter]

        def hook(g):
            if self.step != self.config.step:
                return g
            if self.config.oom:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected in backward)")
            return torch.full_like(g, float("nan"))

        handle = p.register_hook(hook)
        ctx.hooks.add(ctx.models["unet"], "test_poison_grad", self.key, handle=handle, undo=handle.remove)

    def on_step_start(self, ctx, step):
        self.step = step + 1


def test_a_nan_gradient_leaves_that_parameter_alone_and_updates_the_others(tmp_path, caplog):
    out = tmp_path / "run"
    args = [*PIXEL, "train.steps=3", "train.save_every=1", "train.keep_saved=3", "optimizer.fused_backward=true",
            "tiling=test_poison_grad"]
    assert train_job(out, *args) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["nonfinite_skips"] for r in rows] == [0, 1, 1]
    before, poisoned = weights(out, 1), weights(out, 2)
    name = next(k for k in before if k.endswith("conv_out.bias"))
    assert torch.equal(before[name], poisoned[name])  # skipped: not updated
    assert sum(not torch.equal(before[k], poisoned[k]) for k in before) == len(before) - 1  # every other one was
    assert all(bool(torch.isfinite(t).all()) for t in poisoned.values())
    assert "non-finite gradients and were not updated" in caplog.text and "conv_out.bias" in caplog.text


def test_a_nan_loss_runs_no_backward_so_nothing_is_updated(tmp_path):
    out = tmp_path / "run"
    code = train_job(out, "trainer=custom", "trainer._target_=flaky_trainer.FlakyTrainer", "data.resolution=16",
                     "+trainer.options.nan_positions=[2]", "train.steps=3", "train.save_every=1", "train.keep_saved=3",
                     "optimizer.fused_backward=true")
    assert code == 0
    assert [r["nonfinite_skips"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 1]
    assert_same(weights(out, 1), weights(out, 2))


def test_stopping_after_a_partly_applied_step_saves_nothing_and_names_the_last_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code = train_job(out, *PIXEL, "train.steps=3", "train.save_every=1", "optimizer.fused_backward=true",
                     "tiling=test_poison_grad", "train.on_nonfinite=stop")
    err = capsys.readouterr().err
    assert code == 4
    assert "neither the last step's nor this one's" in err and "step-00000001" in err
    assert not (out / "checkpoints" / "step-00000002").exists()


# ---- out of memory ------------------------------------------------------------------------------------
def test_an_oom_in_fused_backward_is_not_split_and_saves_nothing_half_updated(tmp_path, capsys):
    out = tmp_path / "run"
    # conv_in's gradient is among the last of backward: most parameters have stepped by then.
    code = train_job(out, *PIXEL, "train.steps=3", "train.save_every=1", "optimizer.fused_backward=true",
                     "tiling=test_poison_grad", "tiling.test_poison_grad.oom=true",
                     "tiling.test_poison_grad.parameter=conv_in.weight")
    err = capsys.readouterr().err
    assert code == 3
    assert "cannot be split into smaller micro-batches" in err and "micro-batch 2" in err
    assert "were not saved" in err and "step-00000001" in err
    assert [r["micro_batch_size"] for r in read_metrics(out / "metrics.jsonl")] == [2]


# ---- refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, words", [
    (["train.grad_accum=2"], ["train.grad_accum=2", "fused_backward"]),
    (["train.mixed_precision=fp16", "train.device=auto"], ["fp16", "bf16"]),
    (["offload=optimizer"], ["offload=optimizer", "Choose one"]),
    (["offload=stream", "model.train=full"], ["offload=stream", "model.train=lora"]),
])
def test_combinations_fused_backward_cannot_do_are_refused(overrides, words):
    cfg = compose_config(["optimizer.fused_backward=true", "mode=plan", *overrides])
    with pytest.raises(UserError) as e:
        validate(cfg)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_fused_backward_with_lora_and_stream_is_allowed_and_planned():
    cfg = compose_config(["optimizer.fused_backward=true", "offload=stream", "model.train=lora", "mode=plan",
                          "train.device=cpu"])
    validate(cfg)
    assert "fused backward" in plan_step(cfg).run["optimizer"]


def test_the_loop_sees_a_no_op_view_without_fusion():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    view = fusion_of(opt)
    assert isinstance(view, NotFused) and view.intact and view.admits(torch.tensor(float("nan")))
    assert view.guard_norm(3.0) == 3.0 and view.unsaved_reason(None) is None
