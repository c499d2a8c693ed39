"""Streamed weight offload (offload=stream): same numbers as no offload, fewer device bytes.

Equality is BIT-EXACT (torch.equal): streaming moves weights, it does not change the math, and
on the CPU the synchronous path runs the same kernels in the same order. ``always_copy=True``
makes the CPU run copy every weight between distinct host and "device" tensors, so a gradient
that did not reach the host parameter, or an update that did not reach the next forward, would
show. Device bytes are measured with fake tensors (device ``meta``, host fake ``cpu``), where a
weight read in backward after it was released is a device-mismatch error, so those runs also
check the load/release order; and at full size through the planner.
"""
from __future__ import annotations

import math

import pytest
import torch
from tiny_training import assert_identical_training, fake_unet_inputs, tiny_trainer
from torch import nn

from runner.blocks import find_repeated_blocks
from runner.parts import build_trainer
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.errors import UserError
from runner.memory.live_bytes import LiveBytesTracker
from runner.plugins.checkpoint import apply_activation_checkpointing
from runner.plugins.host_buffers import GiB, HostRegion, host_copy
from runner.plugins.stream import (
    apply_stream_offload,
    guess_execution_order,
    minimum_device_bytes,
    plan_stream,
)

STEPS = 3


# One intra-op thread (tests/conftest.py): faster tiny ops, bitwise-reproducible runs.
pytestmark = pytest.mark.usefixtures("one_thread")


def build(family: str, train: str):
    tr = tiny_trainer(family, train)
    torch.manual_seed(0)
    models = tr.build_models("cpu")
    name = next(iter(models.trained))
    return tr, models, name


def train_steps(family: str, train: str, offload: str | None, ckpt: str = "none", micro_batches: int = 1,
                prefetch: int = 1, use_diffusers_ckpt: bool = False):
    """STEPS optimizer steps; per step the loss and every trainable gradient; then the weights."""
    tr, models, name = build(family, train)
    module = models[name]
    module.train()
    blocks = models.blocks[name]
    handle = None
    if ckpt == "before":
        apply_activation_checkpointing(blocks)
    if use_diffusers_ckpt:
        module.enable_gradient_checkpointing()
    if offload == "stream":
        # SDXL: half of the weight bytes on the device; Flux (3 tiny blocks): the smallest budget.
        budget = int(0.5 * sum(p.numel() * p.element_size() for p in module.parameters())) if family == "sdxl" \
            else minimum_device_bytes(module, blocks, prefetch)
        handle = apply_stream_offload(module, blocks, budget, prefetch, "cpu", "cpu", always_copy=True, name=name)
        assert handle.plan.streamed, "the test must stream something"
    if ckpt == "after":
        apply_activation_checkpointing(blocks)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, foreach=False)
    batch = tr.example_batch(2 * micro_batches, "cpu")
    losses, grads = [], []
    for _ in range(STEPS):
        total = 0.0
        for i in range(micro_batches):
            mb = {k: (v[2 * i:2 * i + 2] if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in batch.items()}
            loss = tr.loss(models, mb) / micro_batches
            loss.backward()
            total += loss.detach()
        losses.append(total)
        # (Qwen-Image's last block computes a text stream nothing reads: those weights get no gradient.)
        grads.append({n: p.grad.detach().clone() for n, p in module.named_parameters()
                      if p.requires_grad and p.grad is not None})
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    return losses, grads, weights, handle


_BASELINES: dict[tuple, tuple] = {}


def baseline(family: str, train: str, micro_batches: int = 1):
    key = (family, train, micro_batches)
    if key not in _BASELINES:
        _BASELINES[key] = train_steps(family, train, None, micro_batches=micro_batches)
    return _BASELINES[key]


# ---- equality with the plain run ------------------------------------------------------------------
@pytest.mark.parametrize("family", ["sdxl", "flux"])
@pytest.mark.parametrize("train", ["full", "lora"])
@pytest.mark.parametrize("ckpt", ["none", "after", "before"])
def test_stream_equals_no_offload(family, train, ckpt):
    """Losses, every gradient of every step and the trained weights after 3 AdamW steps are
    bit-identical, for full fine-tune (gradients via the host) and LoRA, with activation
    checkpointing applied after the offload (the runner's order) or before it."""
    streamed = train_steps(family, train, "stream", ckpt)
    assert_identical_training(baseline(family, train), streamed)
    stats = streamed[3].stats
    assert stats.loads > 0 and stats.h2d_bytes > 0 and stats.late == 0
    if train == "full":
        assert stats.d2h_bytes > 0  # streamed trained parameters' gradients went to the host
    else:
        assert stats.d2h_bytes == 0  # frozen weights are never copied back
    assert stats.peak_device_bytes <= streamed[3].plan.window_bytes


@pytest.mark.parametrize("family", ["qwen_image", "wan"])
@pytest.mark.parametrize("train", ["full", "lora"])
def test_qwen_image_and_wan_stream_like_the_plain_run(family, train):
    """The Qwen-Image MMDiT and the Wan 3-D transformer (a clip batch) stream their blocks with
    checkpointing applied after the offload, as the runner orders them: bit-identical training."""
    streamed = train_steps(family, train, "stream", "after")
    assert_identical_training(baseline(family, train), streamed)
    assert streamed[3].stats.loads > 0 and streamed[3].stats.late == 0


def test_gradient_accumulation_on_the_host_equals_device_accumulation():
    streamed = train_steps("sdxl", "full", "stream", "after", micro_batches=2, prefetch=2)
    assert_identical_training(baseline("sdxl", "full", micro_batches=2), streamed)


def test_composes_with_fp8_storage_and_keeps_bitsandbytes_blocks_resident():
    """quantization=fp8 stores frozen weights as plain uint8 parameters that its autograd function
    saves for backward: they stream like any weight (same losses and LoRA gradients). bitsandbytes
    parameters carry their quantization state with them: their blocks stay resident, and a budget
    that would need them streamed is a UserError that says so."""
    from runner.plugins.quantization.bnb import apply_bnb_quantization
    from runner.plugins.quantization.fp8 import apply_fp8_storage

    def run(stream: bool):
        tr, models, name = build("sdxl", "lora")
        unet, blocks = models[name], models.blocks[name]
        apply_fp8_storage(unet, compute_dtype=torch.float32)
        if stream:
            handle = apply_stream_offload(unet, blocks, minimum_device_bytes(unet, blocks, 1), 1, "cpu", "cpu",
                                          always_copy=True)
            assert handle.plan.streamed and any(p.dtype == torch.uint8 for s in handle._all_slots() for p in [s.host])
        batch = tr.example_batch(2, "cpu")
        loss = tr.loss(models, batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in unet.named_parameters() if p.requires_grad}

    (la, ga), (lb, gb) = run(False), run(True)
    assert torch.equal(la, lb) and ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)

    tr, models, name = build("sdxl", "lora")
    unet, blocks = models[name], models.blocks[name]
    apply_bnb_quantization(unet, "nf4", compute_dtype=torch.float32)
    plan = plan_stream(unet, blocks, 10**12, 1)
    quantized = [b for b in plan.blocks if b.why_resident]
    assert quantized and all("Params4bit" in b.why_resident for b in quantized)
    with pytest.raises(UserError, match="nf4/int8 weights stay resident"):
        plan_stream(unet, blocks, 1, 1)


def test_diffusers_gradient_checkpointing_recomputes_with_the_weights_loaded():
    """diffusers' own checkpointing calls the blocks (hooks inside the checkpoint): recomputation
    runs the pre hooks in backward, which must load, and must not push saved-tensor hooks."""
    streamed = train_steps("sdxl", "full", "stream", use_diffusers_ckpt=True)
    assert_identical_training(baseline("sdxl", "full"), streamed)


# ---- the byte-budget strategy ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def full_unet():
    tr = build_trainer(compose_config(["trainer=sdxl", "model.size=full", "model.train=full"]))
    unet = tr.build_models("meta")["unet"]
    return unet, find_repeated_blocks(unet)


def test_plan_keeps_a_full_size_unet_within_byte_budgets(full_unet):
    unet, blocks = full_unet
    total = sum(p.numel() * p.element_size() for p in unet.parameters()) + sum(
        b.numel() * b.element_size() for b in unet.buffers())
    sizes = {b.nbytes for b in plan_stream(unet, blocks, total, 1).blocks}
    assert len(sizes) > 5  # resnets and attention stacks of very different sizes
    previous = None
    for gib in (8.0, 6.0, 4.0, 3.0):
        plan = plan_stream(unet, blocks, int(gib * GiB), prefetch=1, name="unet")
        streamed = plan.streamed
        assert plan.device_weight_bytes <= gib * GiB
        assert plan.window_bytes == sum(sorted((b.nbytes for b in streamed), reverse=True)[:2])
        # every byte is either resident or streamed (streamed blocks are counted with alignment padding)
        assert plan.resident_bytes + sum(b.raw_bytes for b in streamed) == total
        assert all(0 <= b.nbytes - b.raw_bytes < 256 * 64 for b in streamed)
        if previous is not None:
            assert plan.streamed_bytes >= previous  # a smaller budget streams more
        previous = plan.streamed_bytes
    # Largest blocks go first: the 10-layer attention stacks of the 1280-channel stages.
    plan = plan_stream(unet, blocks, int(8 * GiB), prefetch=1)
    assert min(b.nbytes for b in plan.streamed) >= max(b.nbytes for b in plan.blocks if not b.streamed)
    assert plan_stream(unet, blocks, total, 1).streamed == []  # everything fits: nothing streamed
    minimum = minimum_device_bytes(unet, blocks, 1)
    assert plan_stream(unet, blocks, minimum, 1).device_weight_bytes == minimum
    with pytest.raises(UserError, match=r"at least [0-9.]+ GiB"):
        plan_stream(unet, blocks, minimum - 1, 1)


def test_plan_spreads_equal_blocks_of_a_dit():
    """Flux at full size: 19 double and 38 single blocks; equal blocks are streamed spread over
    the model (resident compute in between hides the copies), double blocks (larger) first."""
    tr = build_trainer(compose_config(["trainer=flux", "model.size=full", "model.train=lora", "model.dtype=bfloat16"]))
    transformer = tr.build_models("meta")["transformer"]
    blocks = find_repeated_blocks(transformer)
    assert len(blocks) == 57
    total = sum(p.numel() * p.element_size() for p in transformer.parameters())
    plan = plan_stream(transformer, blocks, int(0.75 * total), prefetch=1)
    streamed = [b.index for b in plan.streamed]
    assert all(i < 19 for i in streamed)  # only double blocks are needed at this budget
    assert max(streamed) - min(streamed) >= 12 and len(streamed) < 19  # spread, not a contiguous run
    assert plan.device_weight_bytes <= 0.75 * total


def test_execution_order_guess_matches_the_recorded_order():
    tr, models, name = build("sdxl", "full")
    unet, blocks = models[name], models.blocks[name]
    guess = guess_execution_order(unet, blocks)
    assert guess != list(range(len(blocks)))  # module order is not the U-Net's execution order
    handle = apply_stream_offload(unet, blocks, int(0.5 * sum(p.numel() * 4 for p in unet.parameters())), 1,
                                  "cpu", "cpu", always_copy=True)
    with torch.no_grad():
        tr.loss(models, tr.example_batch(1, "cpu"))
    assert handle._seen == guess and handle._learned
    handle.remove()


def test_bad_settings_are_user_errors():
    for override, match in (("offload.stream.device_fraction=0", r"offload\.stream\.device_fraction=0"),
                            ("offload.stream.prefetch=-1", r"offload\.stream\.prefetch=-1"),
                            ("offload.stream.device_budget_gb=-2", r"offload\.stream\.device_budget_gb=-2")):
        with pytest.raises(UserError, match=match):
            validate(compose_config(["offload=stream", override]))
    # fp16 applies where the step runs in fp16: a GPU target (mode=plan plans for one), or a CPU
    # with train.cpu_autocast=true. A plain CPU run trains in float32 (runner/resolved.py).
    for target in ("mode=plan", "train.cpu_autocast=true"):
        with pytest.raises(UserError, match="bf16"):
            validate(compose_config(["offload=stream", "train.mixed_precision=fp16", "model.train=full", target]))


# ---- memory: fake tensors on the simulated device -------------------------------------------------
def fake_models(tr, mode, where: str):
    from runner.plan import fake_module

    models = tr.build_models("meta")
    with mode:
        memo: dict = {}
        for _, m in models.items():
            fake_module(m, torch.device(where), memo)
    return models


def fake_step(family: str, train: str, stream: bool, ckpt: bool, cuda_like: bool | None = None):
    """Forward + backward on fake tensors; (tracker snapshot per device, handle). ``cuda_like``: the
    target the handle takes its branch for (None: the device's own, so meta takes the synchronous
    one)."""
    from runner.plan import simulation_mode

    tr = tiny_trainer(family, train)
    mode = simulation_mode()
    models = fake_models(tr, mode, "cpu" if stream else "meta")
    name = next(iter(models.trained))
    module, blocks = models[name], models.blocks[name]
    module.train()
    handle = None
    with mode:
        if stream:
            budget = int(0.5 * sum(p.numel() * p.element_size() for p in module.parameters()))
            handle = apply_stream_offload(module, blocks, budget, 1, "meta", "cpu", name=name, cuda_like=cuda_like)
        if ckpt:
            apply_activation_checkpointing(blocks)
        dt = next(p.dtype for p in module.parameters() if p.is_floating_point())
        x, t, ehs, cond = fake_unet_inputs(tr.example_batch(2, "cpu"), dt)
    tracker = LiveBytesTracker(count_inputs=False)
    tracker.track(module, "weights")
    at_rest = dict(tracker.current)
    with mode, tracker:
        with tracker.phase("forward"):
            out = module(x, t, encoder_hidden_states=ehs, added_cond_kwargs=cond, return_dict=False)[0]
            loss = out.float().pow(2).mean()
        with tracker.phase("backward"):
            loss.backward()
    return at_rest, tracker.snapshot()["devices"], handle


def test_the_side_stream_branch_keeps_the_same_bytes_as_the_synchronous_one():
    """A CUDA target takes the side-stream branch in the planner too (simulated streams, in order:
    runner/side_streams.py), and the live bytes on the device, at the peak and after the step, are those
    of the synchronous branch: what stays is decided by the handle's window in both."""
    _, sync, h_sync = fake_step("sdxl", "full", stream=True, ckpt=True, cuda_like=False)
    _, side, h_side = fake_step("sdxl", "full", stream=True, ckpt=True, cuda_like=True)
    assert not h_sync.async_copies and h_side.async_copies
    assert side["meta"]["peak_bytes"] == sync["meta"]["peak_bytes"]
    assert side["meta"]["current_bytes"] == sync["meta"]["current_bytes"]
    assert h_side.stats.h2d_bytes == h_sync.stats.h2d_bytes > 0
    assert h_side.stats.d2h_bytes == h_sync.stats.d2h_bytes > 0  # full fine-tune: gradients go to the host


@pytest.mark.parametrize("ckpt", [False, True])
def test_device_bytes_drop_by_the_streamed_weights_and_stay_in_the_window(ckpt, capsys):
    """Tiny SDXL U-Net, full fine-tune, on fake tensors: weights at rest on the device are exactly
    the plan's resident bytes; streamed weights and their gradients live on the host; the
    streamed bytes on the device never exceed the window; the step's device peak drops by at
    least the streamed weights minus the window."""
    at_rest_b, base, _ = fake_step("sdxl", "full", stream=False, ckpt=ckpt)
    at_rest_s, snap, handle = fake_step("sdxl", "full", stream=True, ckpt=ckpt)
    plan = handle.plan
    host_weights = handle.host_bytes()
    assert at_rest_s["meta"] == plan.resident_bytes  # exactly: weights + buffers that stay
    assert at_rest_s["cpu"] == host_weights
    assert at_rest_b["meta"] == plan.resident_bytes + host_weights
    assert handle.stats.peak_device_bytes <= plan.window_bytes
    assert handle.device_bytes() == 0  # nothing streamed is left on the device after backward
    # gradients of streamed parameters are on the host, those of resident ones on the device
    assert snap["cpu"]["current_by_category"]["other"] + snap["cpu"]["current_by_category"]["gradients"] >= host_weights
    drop = base["meta"]["peak_bytes"] - snap["meta"]["peak_bytes"]
    with capsys.disabled():
        print(f"\ntiny SDXL full FT (ckpt={ckpt}) device peak: no offload {base['meta']['peak_bytes']:,} B, "
              f"stream {snap['meta']['peak_bytes']:,} B (streamed {host_weights:,} B, window {plan.window_bytes:,} B, "
              f"resident {plan.resident_bytes:,} B); host peak {snap['cpu']['peak_bytes']:,} B")
    assert drop >= host_weights - plan.window_bytes


FULL_SDXL = ["model.size=full", "data.resolution=1024", "train.batch_size=1", "checkpoint=blocks",
             "train.mixed_precision=bf16", "model.dtype=bfloat16", "optimizer=adamw", "budget_gb=24"]


@pytest.mark.slow
@pytest.mark.parametrize("train", ["lora", "full"])
def test_planner_full_size_sdxl_peak_drops_by_the_streamed_weights(train, capsys):
    """runner.plan simulates offload=[park,stream] at full SDXL size (1024 px, bf16 autocast, block
    checkpointing, AdamW): against offload=park (the frozen encoders handled the same way), the
    planned device peak drops by the streamed weights minus the window loaded at the peak (LoRA:
    frozen weights only; full fine-tune with float32 master weights: their gradients and AdamW's
    two moments move to the host too), the U-Net's weights on the device stay within
    offload.stream.device_budget_gb, and the streamed weights are reported as pinned host memory."""
    from runner.plan import plan_step

    common = [*FULL_SDXL, f"model.train={train}"]
    cfg = compose_config([*common, "offload=park"])
    validate(cfg)
    before = plan_step(cfg)
    cfg = compose_config([*common, "offload=[park,stream]", "offload.stream.device_budget_gb=4"])
    validate(cfg)
    after = plan_step(cfg)
    notes = after.notes
    streamed, window = notes["stream: weight bytes on the host"], notes["stream: planned window bytes"]
    drop = before.peak_bytes - after.peak_bytes
    with capsys.disabled():
        print(f"\nplanner, SDXL {train} at full size: peak {before.peak_bytes / GiB:.2f} GiB -> {after.peak_bytes / GiB:.2f} "
              f"GiB (streamed {streamed / GiB:.2f} GiB, window {window / GiB:.2f} GiB, pinned "
              f"{after.host_pinned_bytes / GiB:.2f} GiB)")
    assert notes["stream: planned device weight bytes"] <= 4 * GiB
    assert notes["stream: peak streamed bytes on the device"] <= window
    assert after.host_pinned_bytes >= streamed
    if train == "lora":  # only the frozen weights move
        assert abs(drop - (streamed - window)) <= 0.02 * streamed
    else:  # float32 weights, their gradients and AdamW's two float32 moments of the streamed blocks
        assert drop >= 3 * streamed - window


# ---- the runner -------------------------------------------------------------------------------
def run_losses(tmp, *overrides):
    from runner.__main__ import task
    from runner.output.report import read_metrics

    cfg = compose_config([f"output_dir={tmp}", "train.progress=false", *overrides])
    task(cfg)
    return [r["loss"] for r in read_metrics(tmp / "metrics.jsonl")]


def test_runner_offload_stream_gives_the_same_losses(tmp_path):
    """The whole loop (composition, validation, preflight plan, park + stream, checkpointing,
    2 micro-batches, clipping, AdamW, checkpoint saving): identical losses to offload=none."""
    common = ["train.steps=3", "train.grad_accum=2", "checkpoint=blocks"]
    plain = run_losses(tmp_path / "none", *common)
    streamed = run_losses(tmp_path / "stream", *common, "offload=[park,stream]",
                          "offload.stream.device_fraction=0.5", f"offload.park.cache_dir={tmp_path / 'cache'}")
    assert streamed == plain
    assert (tmp_path / "stream" / "checkpoints" / "step-00000003" / "trainable.safetensors").is_file()


def test_budget_too_small_for_the_model_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r"offload\.stream\.device_budget_gb"):
        run_losses(tmp_path, "train.steps=1", "offload=stream", "offload.stream.device_budget_gb=0.000001")


# ---- host memory -------------------------------------------------------------------------------
def test_host_regions_are_page_aligned_and_saveable(tmp_path):
    """Trained parameters get a host region of their own: page-aligned, and a tensor safetensors
    saves (one storage per tensor, as the runner's checkpoints need)."""
    from safetensors.torch import load_file, save_file

    region = HostRegion(1000, pin=False)  # no CUDA here: the same buffer, not page-locked
    assert region.nbytes % 4096 == 0 and region.tensor.data_ptr() % 4096 == 0 and not region.pinned
    w = torch.randn(10, 7)
    view = region.view(0, w)
    view.copy_(w)
    copy, _ = host_copy(w, pin=False)
    save_file({"a": view, "b": copy}, str(tmp_path / "w.safetensors"))
    loaded = load_file(str(tmp_path / "w.safetensors"))
    assert torch.equal(loaded["a"], w) and torch.equal(loaded["b"], w)


def test_remove_restores_a_plain_module():
    tr, models, name = build("sdxl", "lora")
    unet = models[name]
    ids = {n: id(p) for n, p in unet.named_parameters()}
    batch = tr.example_batch(1, "cpu")
    with torch.no_grad():
        before = tr.loss(models, batch)
    handle = apply_stream_offload(unet, models.blocks[name], int(0.5 * sum(p.numel() * p.element_size()
                                  for p in unet.parameters())), 1, "cpu", "cpu", always_copy=True)
    with torch.no_grad():
        during = tr.loss(models, batch)
    handle.remove()
    assert {n: id(p) for n, p in unet.named_parameters()} == ids  # parameter identity kept throughout
    assert not unet._forward_hooks and not unet._forward_pre_hooks
    with torch.no_grad():
        after = tr.loss(models, batch)
    assert torch.equal(before, during) and torch.equal(before, after)
    handle.remove()  # twice is harmless


# ---- CUDA ----------------------------------------------------------------------------------------
def mid_unet(device: str) -> nn.Module:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=64, block_out_channels=(64, 128, 256), layers_per_block=2, cross_attention_dim=256,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=8,
    ).to(device)


def cuda_steps(stream: bool, ckpt: bool, prefetch: int = 1):
    unet = mid_unet("cpu")
    blocks = find_repeated_blocks(unet)
    handle = None
    if stream:
        total = sum(p.numel() * p.element_size() for p in unet.parameters())
        handle = apply_stream_offload(unet, blocks, int(0.4 * total), prefetch, "cuda", "cpu")
    else:
        unet.cuda()
    if ckpt:
        apply_activation_checkpointing(blocks)
    params = [p for p in unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 64, 64, generator=g).cuda()
    ehs = torch.randn(2, 77, 256, generator=g).cuda()
    t = torch.tensor([10, 500], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses = []
    for _ in range(3):
        loss = unet(x, t, ehs).sample.float().pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    weights = {n: p.detach().float().cpu() for n, p in unet.named_parameters()}
    return losses, weights, peak, handle


@pytest.mark.gpu
@pytest.mark.parametrize("ckpt", [False, True])
def test_cuda_stream_trains_like_resident_weights_with_less_memory(ckpt):
    """Side streams, events, pinned host memory and host gradients on a real GPU: the losses and
    weights after 3 full fine-tune steps match the resident run, and the CUDA peak is lower."""
    base_losses, base_w, base_peak, _ = cuda_steps(False, ckpt)
    losses, w, peak, handle = cuda_steps(True, ckpt)
    print(f"\nCUDA peak: resident {base_peak / 2**20:.1f} MiB, streamed {peak / 2**20:.1f} MiB; {handle.stats}")
    assert handle.async_copies and handle.pinned_bytes() > 0
    for a, b in zip(base_losses, losses):
        assert math.isclose(a, b, rel_tol=1e-5), (base_losses, losses)
    for n in base_w:
        torch.testing.assert_close(w[n], base_w[n], rtol=1e-4, atol=1e-6, msg=n)
    assert peak < base_peak
    assert handle.stats.peak_device_bytes <= handle.plan.window_bytes
    handle.remove()
