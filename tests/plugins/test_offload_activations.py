"""Activation offload (offload=activations): saved tensors to the host and back, same numbers.

On the CPU the twin ``offload_activations(..., always_copy=True)`` makes every offloaded activation
a real copy (the device is the host there), so equality is BIT-EXACT (torch.equal); the plugin
itself installs nothing on a CPU target, so a CPU plan and a CPU run agree. Device and host bytes
are measured on fake tensors (device ``meta``, host fake ``cpu``) with the live-bytes tracker.
"""
from __future__ import annotations

import logging

import pytest
import torch
from tiny_training import assert_identical_training, fake_unet_inputs, tiny_trainer
from torch import nn

from runner.cli.compose import compose_config
from runner.checks import validate
from runner.errors import UserError
from runner.memory.live_bytes import LiveBytesTracker
from runner.plugins.checkpoint import apply_activation_checkpointing
from runner.plugins.offload_activations import ActivationOffloader, offload_activations
from runner.plugins.stream import apply_stream_offload

# One intra-op thread (tests/conftest.py): faster tiny ops, bitwise-reproducible runs.
pytestmark = pytest.mark.usefixtures("one_thread")


def steps(family: str, train: str, offload: bool, ckpt: bool, stream: bool = False, n: int = 3):
    tr = tiny_trainer(family, train)
    torch.manual_seed(0)
    models = tr.build_models("cpu")
    name = next(iter(models.trained))
    module, blocks = models[name], models.blocks[name]
    module.train()
    if stream:
        from runner.plugins.stream import minimum_device_bytes

        apply_stream_offload(module, blocks, minimum_device_bytes(module, blocks, 1), 1, "cpu", "cpu", always_copy=True)
    if ckpt:
        apply_activation_checkpointing(blocks)
    offloader = offload_activations("cpu", "cpu", always_copy=True, skip_modules=[module]) if offload else None
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    batch = tr.example_batch(2, "cpu")
    losses, grads = [], []
    for _ in range(n):
        with offloader() if offloader is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = tr.loss(models, batch)
            loss.backward()
        losses.append(loss.detach())
        grads.append({k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None})
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    weights = {k: p.detach().clone() for k, p in module.named_parameters()}
    return losses, grads, weights, offloader


@pytest.mark.parametrize("family,train", [("sdxl", "full"), ("sdxl", "lora"), ("flux", "full")])
@pytest.mark.parametrize("ckpt", [False, True])
def test_offloaded_activations_give_identical_training(family, train, ckpt):
    base = steps(family, train, offload=False, ckpt=ckpt)
    off = steps(family, train, offload=True, ckpt=ckpt)
    assert_identical_training(base, off)
    st = off[3].stats
    assert st.offloaded > 0 and st.offloaded_bytes > 0 and st.kept > 0
    assert st.live_host_bytes == 0  # every host copy was freed with its graph


def test_composes_with_stream_offload():
    """Streamed blocks' saved-tensor hooks keep the weights and hand activations to ours."""
    base = steps("sdxl", "full", offload=False, ckpt=True)
    both = steps("sdxl", "full", offload=True, ckpt=True, stream=True)
    assert_identical_training(base, both)
    assert both[3].stats.offloaded > 0


def test_weights_small_and_strided_tensors_stay_on_the_device():
    off = ActivationOffloader("cpu", "cpu", min_bytes=1024, always_copy=True)
    w = nn.Parameter(torch.randn(64, 64))
    buf = torch.randn(64, 64)
    off2 = ActivationOffloader("cpu", "cpu", min_bytes=1024, always_copy=True, skip=[buf])
    big = torch.randn(64, 64)
    assert not off._offloadable(w) and not off._offloadable(w.t())  # parameters and their views
    assert not off._offloadable(torch.randn(8))  # 32 bytes < 1 KiB
    assert not off._offloadable(torch.randn(64, 1).expand(64, 64))  # expanded: not dense
    assert not off._offloadable(big[:, ::2])  # strided slice: not dense
    assert off._offloadable(big) and off._offloadable(big.t()) and off._offloadable(big[:32])
    assert not off2._offloadable(buf)  # module buffers are not activations
    assert not ActivationOffloader("cpu", "cpu")._offloadable(big)  # a CPU run: nothing to move


def fake_step(offload: bool, ckpt: bool):
    """Tiny SDXL U-Net forward+backward on fake tensors (device meta, host fake cpu)."""
    from runner.plan import fake_module, simulation_mode

    tr = tiny_trainer("sdxl", "full")
    mode = simulation_mode()
    models = tr.build_models("meta")
    unet, blocks = models["unet"], models.blocks["unet"]
    unet.train()
    with mode:
        fake_module(unet, torch.device("meta"), {})
        if ckpt:
            apply_activation_checkpointing(blocks)
        x, t, ehs, cond = fake_unet_inputs(tr.example_batch(2, "cpu"), torch.float32)
    offloader = offload_activations("meta", "cpu", skip_modules=[unet])
    tracker = LiveBytesTracker(count_inputs=False)
    tracker.track(unet, "weights")
    with mode, tracker:
        with offloader() if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            with tracker.phase("forward"):
                loss = unet(x, t, encoder_hidden_states=ehs, added_cond_kwargs=cond).sample.float().pow(2).mean()
            fwd = tracker.snapshot()["devices"]
            with tracker.phase("backward"):
                loss.backward()
    return fwd, tracker.snapshot()["devices"], offloader


@pytest.mark.parametrize("ckpt", [False, True])
def test_device_activation_bytes_move_to_the_host(ckpt, capsys):
    fwd_b, _, _ = fake_step(offload=False, ckpt=ckpt)
    fwd_o, end_o, off = fake_step(offload=True, ckpt=ckpt)
    saved_b = fwd_b["meta"]["current_by_category"]["activations"]  # alive after forward: saved for backward
    saved_o = fwd_o["meta"]["current_by_category"]["activations"]
    host_o = fwd_o["cpu"]["current_by_category"]["activations"]
    with capsys.disabled():
        print(f"\ntiny SDXL U-Net (ckpt={ckpt}) activations kept for backward: device {saved_b:,} B without offload, "
              f"{saved_o:,} B with it, host {host_o:,} B; {off.stats.offloaded} tensors offloaded")
    # The host holds exactly what was offloaded, and the device freed about as much: each saved
    # span is copied once (x and x.t() share one copy); only distinct, overlapping slices of one
    # storage are copied separately (under 2% here). What stays is weights' views, small and
    # strided tensors and the output.
    assert host_o == off.stats.offloaded_bytes == off.stats.peak_host_bytes
    assert off.stats.deduplicated > 0
    assert saved_b - saved_o >= 0.98 * off.stats.offloaded_bytes
    assert saved_o < 0.2 * saved_b
    assert end_o["cpu"]["current_bytes"] == 0 and off.stats.live_host_bytes == 0


def test_checkpointing_leaves_only_block_inputs_to_offload():
    _, _, plain = fake_step(offload=True, ckpt=False)
    _, _, ckpt = fake_step(offload=True, ckpt=True)
    assert 0 < ckpt.stats.offloaded_bytes < 0.5 * plain.stats.offloaded_bytes
    assert ckpt.stats.offloaded < plain.stats.offloaded


def test_host_ram_warning(caplog):
    tr = tiny_trainer("sdxl", "lora")
    torch.manual_seed(0)
    models = tr.build_models("cpu")
    off = ActivationOffloader("cpu", "cpu", always_copy=True, ram_warn_pct=0.01)
    with caplog.at_level(logging.WARNING, logger="runner"):
        with off():
            tr.loss(models, tr.example_batch(1, "cpu")).backward()
    assert any("host RAM" in r.getMessage() for r in caplog.records)


def test_config_errors_and_runner_run(tmp_path):
    for override, match in (("offload.activations.min_bytes=-1", r"offload\.activations\.min_bytes"),
                            ("offload.activations.max_fwd_stash=0", r"offload\.activations\.max_fwd_stash"),
                            ("offload.activations.ram_warn_pct=0", r"offload\.activations\.ram_warn_pct")):
        with pytest.raises(UserError, match=match):
            validate(compose_config(["offload=activations", override]))
    from runner.__main__ import task
    from runner.output.report import read_metrics

    losses = {}
    for name in ("none", "activations"):
        out = tmp_path / name
        task(compose_config([f"output_dir={out}", "train.progress=false", "train.steps=2", "checkpoint=blocks",
                            f"offload={name}"]))
        losses[name] = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
    assert losses["activations"] == losses["none"]


PLAN_BYTES = ("peak_bytes", "by_category", "phases", "host_peak_bytes", "host_pinned_bytes", "peak_phase")


def test_plugin_on_a_cpu_target_is_a_no_op_and_the_cpu_plan_equals_the_run(tmp_path):
    """On a CPU target the device is the host: offload=activations installs no hooks and notes
    nothing, so the run trains exactly like offload=none, and the CPU plan (mode=plan
    train.device=cpu) is the run's own preflight plan and the plan without the plugin, byte for byte."""
    import json

    from runner.__main__ import task as run_main
    from runner.parts import (
        build_plugins,
        build_trainer,
        make_context,
        prepare_models,
    )
    from runner.output.report import read_metrics
    from runner.plan import plan_step
    from runner.resolved import resolve
    from runner.session import make_accelerator

    common = ["train.device=cpu", "checkpoint=blocks", "train.progress=false"]
    cfg = compose_config([*common, "offload=activations"])
    run = resolve(cfg)
    assert run.target == "cpu"
    schedule = build_plugins(cfg, run)
    ctx = make_context(cfg, run, schedule, None)
    ctx.trainer = build_trainer(cfg, run)
    torch.manual_seed(0)
    ctx.models = prepare_models(ctx.trainer.build_models("cpu"), cfg.model, run)
    ctx.accelerator = make_accelerator(run)
    try:
        ctx.apply_setup_phases()
        assert [p.key for p in schedule.plugins if p.kind == "offload"] == ["offload/activations"]
        assert ctx.step_contexts == []  # no saved-tensor hooks: nothing to move on a CPU
        assert ctx.facts.pinned_host_bytes == 0 and not ctx.facts.placed
    finally:
        ctx.teardown()
    assert not any(k.startswith("activations:") for k in ctx.notes)
    assert ctx.facts.pinned_host_bytes == 0

    plans, losses = {}, {}
    for name in ("none", "activations"):
        out = tmp_path / name
        run_main(compose_config([*common, f"offload={name}", f"output_dir={out}", "train.steps=2"]))
        losses[name] = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
        preflight = json.loads((out / "plan.json").read_text())
        planned = plan_step(compose_config([*common, f"offload={name}", "mode=plan"])).to_dict()
        assert planned["target"] == preflight["target"] == "cpu"
        assert {k: planned[k] for k in PLAN_BYTES} == {k: preflight[k] for k in PLAN_BYTES}, name
        plans[name] = {k: planned[k] for k in PLAN_BYTES}
    assert plans["activations"] == plans["none"]
    assert losses["activations"] == losses["none"]


@pytest.mark.gpu
def test_cuda_activation_offload_with_streams_lowers_the_peak():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=64, block_out_channels=(64, 128, 256), layers_per_block=2,
                                cross_attention_dim=256, attention_head_dim=8,
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D")).cuda()
    g = torch.Generator().manual_seed(1)
    x, ehs = torch.randn(4, 4, 64, 64, generator=g).cuda(), torch.randn(4, 77, 256, generator=g).cuda()
    t = torch.tensor([10, 200, 500, 900], device="cuda")

    def step(ctx):
        unet.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with ctx:
            out = unet(x, t, ehs).sample
            out.float().pow(2).mean().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, out.detach(), {n: p.grad.clone() for n, p in unet.named_parameters()}

    peak_a, out_a, g_a = step(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    off = offload_activations("cuda", "cpu", skip_modules=[unet])
    peak_b, out_b, g_b = step(off())
    print(f"\nCUDA peak above weights: {peak_a / 2**20:.1f} MiB resident, {peak_b / 2**20:.1f} MiB offloaded; {off.stats}")
    assert off.use_streams and off.pin and off.stats.offloaded > 0
    torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-6)
    for n in g_a:
        torch.testing.assert_close(g_b[n], g_a[n], rtol=1e-4, atol=1e-6, msg=n)
    assert peak_b < 0.8 * peak_a


# ---- the GPU's branch (side stream, stash, prefetch), run in order on the CPU (runner/side_streams.py) ------
def deep_blocks(n: int = 16, width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n)])


def stream_step(model: nn.Module, offloader, x: torch.Tensor):
    ctx = offloader() if offloader is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with ctx:
        loss = model(x).square().mean()
        loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_prefetch_window_is_bounded_on_the_stream_branch(prefetch):
    """16 blocks, the side-stream branch: at every unpack at most ``prefetch`` regions are prefetched
    (in flight or ready) beyond the one in use; the old window grew by one region per unpack."""
    from runner.side_streams import SIMULATED

    model, x = deep_blocks(), torch.randn(8, 64)
    want_loss, want_grads = stream_step(model, None, x)
    off = offload_activations("cpu", "cpu", always_copy=True, min_bytes=0, prefetch=prefetch, max_fwd_stash=2,
                              streams=SIMULATED)
    assert off.use_streams
    windows = []
    unpack = off._unpack

    def watched(packed):
        out = unpack(packed)
        windows.append(len(off._ready))
        return out

    off._unpack = watched
    loss, grads = stream_step(model, off, x)
    assert torch.equal(loss, want_loss) and all(torch.equal(grads[k], want_grads[k]) for k in want_grads)
    assert len(windows) >= 16 and off.stats.offloaded >= 32
    assert max(windows) <= prefetch, windows
    if prefetch:
        assert off.stats.prefetched > 0 and max(windows) == prefetch  # the window is used, not just bounded
    assert not off._ready and not off._fwd_stash  # nothing left on the device after backward


def test_the_planner_counts_the_stream_branchs_stash_and_window():
    """On fake tensors (device ``meta``) with the CUDA target's simulated streams, the forward stash
    and the backward prefetch window hold device bytes the synchronous path frees at once: the
    planner's tracker counts them. At every unpack the window adds at most ``prefetch`` regions."""
    from runner.side_streams import SIMULATED
    from runner.plan import fake_module, simulation_mode

    width, rows = 256, 64
    region = rows * width * 4  # one block's saved input (Linear) or pre-activation (GELU)

    def run(streams, prefetch):
        mode = simulation_mode()
        with torch.device("meta"):
            model = deep_blocks(12, width)
        with mode:
            fake_module(model, torch.device("meta"), {})
            x = torch.randn(rows, width, device="meta")
        off = offload_activations("meta", "cpu", min_bytes=0, prefetch=prefetch, max_fwd_stash=3, streams=streams,
                                  skip_modules=[model])
        tracker = LiveBytesTracker(count_inputs=False)
        tracker.track(model, "weights")
        levels = []
        unpack = off._unpack

        def watched(packed):
            out = unpack(packed)
            levels.append(tracker.current_bytes("meta"))
            return out

        off._unpack = watched
        with mode, tracker:
            with off():
                loss = model(x).square().mean()
                forward = tracker.take_max_since_mark()["meta"]
                loss.backward()
        return forward, levels, off

    sync_fwd, _, _ = run(None, 2)
    stash_fwd, no_window, off0 = run(SIMULATED, 0)
    _, window, off2 = run(SIMULATED, 2)
    assert off0.use_streams and off2.stats.prefetched > 0 and len(window) == len(no_window) >= 24
    assert stash_fwd > sync_fwd  # the forward stash keeps block inputs on the device while their copies run
    extra = [w - n for w, n in zip(window, no_window)]
    assert max(extra) > 0 and all(e <= 2 * region for e in extra), extra  # bounded by the window of 2
