"""The optimizer group (adamw, adamw8bit, paged_adamw8bit, adafactor, prodigy, adamw_schedulefree, lion,
lion8bit, came) and model.train_dtype.

State bytes are measured on real optimizers after real steps (the live-bytes tracker's
"optimizer_state" category and a sum over ``optimizer.state``), and asserted exactly against
the per-optimizer formulas written out below and against the planner's simulation.
"""
from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torch import nn

from runner.parts import build_trainer
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.errors import UserError
from runner.memory.live_bytes import LiveBytesTracker
from runner.optim.build import (
    OPTIMIZERS,
    SimulatedOptimizer,
    build_optimizer,
    optimizer_state_bytes,
    optimizer_state_bytes_by_device,
    simulate_state_bytes,
)

CPU_OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "prodigy", "adamw_schedulefree", "lion", "lion8bit", "came")
# Each optimizer's own scale: Prodigy's lr multiplies its own step-size estimate (1.0 is its authors' value).
TEST_LR = {"prodigy": "1.0", "came": "1e-3"}  # CAME: RMS-normalised steps of lr per element


def lr_override(name: str) -> str:
    return f"optimizer.lr={TEST_LR.get(name, '1e-2')}"


# One intra-op thread (tests/conftest.py): faster tiny ops, bitwise-reproducible runs.
pytestmark = pytest.mark.usefixtures("one_thread")


def opt_cfg(name: str, *overrides: str):
    return compose_config([f"optimizer={name}", *overrides]).optimizer


def tiny_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    """Two matrices above bitsandbytes' min_8bit_size (4096 elements) and two small biases below it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 300), nn.Tanh(), nn.Linear(300, 16)).to(dtype)


def batch(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 64, generator=g).to(dtype), torch.randn(32, 16, generator=g).to(dtype)


def compute_grads(model: nn.Module) -> float:
    x, y = batch(next(model.parameters()).dtype)
    model.zero_grad(set_to_none=True)
    loss = (model(x) - y).float().pow(2).mean()
    loss.backward()
    return loss.item()


# Expected state after one step, per parameter tensor (written out from each library's source).
def adamw_bytes(p: torch.Tensor) -> int:
    return 2 * p.numel() * p.element_size() + 4  # exp_avg, exp_avg_sq + a float32 step on the host


def adamw8bit_bytes(p: torch.Tensor) -> int:
    n = p.numel()
    if n < 4096:
        return 8 * n  # two float32 moments
    return 2 * n + 2 * 4 * math.ceil(n / 256)  # two uint8 moments + two float32 absmax per 256-block


def adafactor_bytes(p: torch.Tensor) -> int:
    rms = 4
    if p.dim() >= 2:
        rows, cols = p.shape
        return 4 * (rows + cols) + rms  # factored second moment
    return 4 * p.numel() + rms


def prodigy_bytes(p: torch.Tensor) -> int:
    # exp_avg, exp_avg_sq, s and p0 (the initial weights, always of the parameter's size here:
    # runner/optim/build.py), all in the parameter's dtype; "step" is a Python int
    return 4 * p.numel() * p.element_size()


def schedulefree_bytes(p: torch.Tensor) -> int:
    return 2 * p.numel() * p.element_size()  # z and exp_avg_sq; its step count is per group


def lion_bytes(p: torch.Tensor) -> int:
    return 4 * p.numel()  # one float32 moment (bitsandbytes' 32-bit state, whatever the weights' dtype)


def lion8bit_bytes(p: torch.Tensor) -> int:
    n = p.numel()
    if n < 4096:
        return 4 * n
    return n + 4 * math.ceil(n / 256)  # one uint8 moment + a float32 absmax per 256-block


def came_bytes(p: torch.Tensor) -> int:
    rms = p.element_size()  # the weights' RMS, a 0-dim tensor of their dtype
    if p.dim() >= 2:
        rows, cols = p.shape
        return 4 * p.numel() + 2 * 4 * (rows + cols) + rms  # first moment + factored squared grad and instability
    return 4 * p.numel() + 4 * p.numel() + rms


def expected_state_bytes(name: str, params: list[torch.Tensor]) -> int:
    if name == "adamw":
        return sum(adamw_bytes(p) for p in params)
    if name == "adamw8bit":
        quantile_maps = 2 * 256 * 4  # signed + unsigned 8-bit code, once per optimizer
        return sum(adamw8bit_bytes(p) for p in params) + quantile_maps
    if name == "lion8bit":
        return sum(lion8bit_bytes(p) for p in params) + 256 * 4  # one (signed) quantile map
    per = {"adafactor": adafactor_bytes, "prodigy": prodigy_bytes, "adamw_schedulefree": schedulefree_bytes,
           "lion": lion_bytes, "came": came_bytes}[name]
    return sum(per(p) for p in params)


@pytest.mark.parametrize("name", CPU_OPTIMIZERS)
def test_three_steps_exact_state_bytes_and_simulation(name, capsys):
    model = tiny_model()
    params = list(model.parameters())
    initial = [p.detach().clone() for p in params]
    cfg = opt_cfg(name, lr_override(name))
    optimizer = build_optimizer(cfg, params)
    tracker = LiveBytesTracker()
    tracker.track(model, "weights")
    losses = []
    with tracker:
        for step in range(3):
            losses.append(compute_grads(model))
            tracker.track_gradients(model)
            with tracker.phase("optimizer"):
                optimizer.step()
            if step == 0:
                # AdamW's step counters come from torch.tensor(0.0), which no dispatched op returns: the
                # tracker first sees them as inputs ("other"). Label the state; anything else born in
                # the step and still alive would stay in the category and break the equality below.
                tracker.track(optimizer.state, "optimizer_state")
                after_first = tracker.category_bytes("cpu")["optimizer_state"]
        final_loss = compute_grads(model)

    want = expected_state_bytes(name, params)
    assert after_first == want  # what the tracker saw born in the first optimizer step and survive
    assert tracker.category_bytes("cpu")["optimizer_state"] == want  # steps 2 and 3 allocate no more state
    assert optimizer_state_bytes(optimizer) == want
    assert simulate_state_bytes(cfg, params) == {"cpu": want}
    assert all(not torch.equal(a, p) for a, p in zip(initial, params))
    assert final_loss < losses[0]

    # The planner's path: the same state, allocated on meta parameters, nothing updated.
    meta_model = copy.deepcopy(model).to("meta")
    meta_params = list(meta_model.parameters())
    for p in meta_params:
        p.grad = torch.empty_like(p)
    simulated = build_optimizer(cfg, meta_params, simulate=True)
    assert isinstance(simulated, SimulatedOptimizer)
    simulated.step()
    by_device = optimizer_state_bytes_by_device(simulated)
    assert sum(by_device.values()) == want
    assert by_device == simulate_state_bytes(cfg, meta_params)  # adamw's step counters on "cpu", the rest on meta
    for real_state, sim_state in zip(optimizer.state.values(), simulated.state.values()):
        real_tensors = {k: (tuple(v.shape), v.dtype) for k, v in real_state.items() if isinstance(v, torch.Tensor)}
        sim_tensors = {k: (tuple(v.shape), v.dtype) for k, v in sim_state.items()}
        assert real_tensors == sim_tensors
    n = sum(p.numel() for p in params)
    with capsys.disabled():
        print(f"\n{name}: {want} state bytes for {n} params ({want / n:.3f} B/param)")


def test_simulation_on_fake_tensors_allocates_fake_state():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    model = tiny_model()
    mode = FakeTensorMode()
    fake = [mode.from_tensor(p.detach()) for p in model.parameters()]
    for p in fake:
        p.grad = mode.from_tensor(torch.zeros(p.shape))
    cfg = opt_cfg("adamw8bit")
    optimizer = build_optimizer(cfg, fake, simulate=True)
    optimizer.step()
    tensors = [v for st in optimizer.state.values() for v in st.values()]
    assert tensors and all(isinstance(t, FakeTensor) for t in tensors)
    assert optimizer_state_bytes(optimizer) == expected_state_bytes("adamw8bit", list(model.parameters()))


def test_adamw8bit_tracks_adamw():
    """Same gradients, three steps: 8-bit blockwise moments change the update only slightly."""
    results = {}
    for name in ("adamw", "adamw8bit"):
        model = tiny_model()
        start = [p.detach().clone() for p in model.parameters()]
        optimizer = build_optimizer(opt_cfg(name, "optimizer.lr=1e-3"), model.parameters())
        for _ in range(3):
            compute_grads(model)
            optimizer.step()
        results[name] = [p.detach() - s for p, s in zip(model.parameters(), start)]
    for (name, p), u32, u8 in zip(tiny_model().named_parameters(), results["adamw"], results["adamw8bit"]):
        rel = ((u8 - u32).norm() / u32.norm()).item()
        # Matrices: 8-bit moments in 256-element blocks; measured 1.4% / 1.3% relative difference of
        # the 3-step update. Biases are under min_8bit_size (32-bit moments); they differ only through
        # the gradients, which follow the matrices after step 1: measured 0.018% / 0.0015%.
        # A broken update (wrong sign, scale or none) differs by 100% or more.
        bound = 1e-3 if p.numel() < 4096 else 0.05
        assert rel < bound, (name, rel)


def test_8bit_and_adafactor_train_bf16_weights():
    """model.train_dtype=bfloat16 is compatible with the memory-saving optimizers (kohya's full_bf16)."""
    for name in ("adamw8bit", "adafactor", "lion8bit", "came", "prodigy", "adamw_schedulefree"):
        model = tiny_model(torch.bfloat16)
        start = [p.detach().clone() for p in model.parameters()]
        # Prodigy's step size starts at d0 (1e-6) and grows over tens of steps; 3 steps need a larger start.
        extra = ["optimizer.d0=1e-3"] if name == "prodigy" else []
        optimizer = build_optimizer(opt_cfg(name, lr_override(name), *extra), model.parameters())
        losses = [compute_grads(model)]
        for _ in range(3):
            optimizer.step()
            losses.append(compute_grads(model))
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        assert all(not torch.equal(a, p) for a, p in zip(start, model.parameters()))
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], (name, losses)
        assert optimizer_state_bytes(optimizer) == expected_state_bytes(name, list(model.parameters()))


@pytest.mark.parametrize("name", CPU_OPTIMIZERS)
def test_state_dict_round_trip(name):
    """Checkpoints save optimizer.state_dict(); a resumed optimizer must continue identically."""
    model = tiny_model()
    cfg = opt_cfg(name, "optimizer.lr=1e-2")
    optimizer = build_optimizer(cfg, model.parameters())
    for _ in range(2):
        compute_grads(model)
        optimizer.step()
    twin = copy.deepcopy(model)
    resumed = build_optimizer(cfg, twin.parameters())
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for m, opt in ((model, optimizer), (twin, resumed)):
        compute_grads(m)
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_state_bytes_reported_once_after_first_step(caplog):
    model = tiny_model()
    notes: dict = {}
    optimizer = build_optimizer(opt_cfg("adamw8bit"), model.parameters(), notes=notes)
    with caplog.at_level(logging.INFO, logger="runner"):
        compute_grads(model)
        optimizer.step()
        want = expected_state_bytes("adamw8bit", list(model.parameters()))
        assert notes == {"optimizer state bytes": want}
        notes.clear()
        compute_grads(model)
        optimizer.step()
    assert notes == {}  # a one-shot hook
    lines = [r.getMessage() for r in caplog.records if "state after the first step" in r.getMessage()]
    assert len(lines) == 1 and f"{want} bytes" in lines[0] and "optimizer=adamw8bit" in lines[0]


# ---- config ----------------------------------------------------------------------------------------
def test_every_optimizer_composes_with_its_own_schema():
    assert set(OPTIMIZERS) == {"adamw", "adamw8bit", "paged_adamw8bit", "adafactor", "prodigy", "adamw_schedulefree",
                               "lion", "lion8bit", "came"}
    for name in CPU_OPTIMIZERS:
        validate(compose_config([f"optimizer={name}"]))
    cfg = compose_config(["optimizer=adamw8bit", "optimizer.min_8bit_size=0", "optimizer.lr=3e-5"])
    assert (cfg.optimizer.min_8bit_size, cfg.optimizer.lr) == (0, 3e-5)
    cfg = compose_config(["optimizer=adafactor", "optimizer.beta1=0.9"])
    assert cfg.optimizer.beta1 == 0.9 and cfg.optimizer.eps == [1e-30, 1e-3]
    model = tiny_model()
    opt = build_optimizer(cfg.optimizer, model.parameters())
    assert opt.defaults["relative_step"] is False and opt.defaults["scale_parameter"] is False
    assert opt.defaults["lr"] == cfg.optimizer.lr


@pytest.mark.parametrize("overrides,words", [
    (["optimizer=paged_adamw8bit", "train.device=cpu"], ["optimizer=paged_adamw8bit", "train.device=cpu", "optimizer=adamw8bit"]),
    (["optimizer.name=adamw8bit"], ["optimizer.name=adamw8bit", "optimizer=adamw8bit"]),
    (["optimizer.betas=[0.9]"], ["optimizer.betas"]),
    (["optimizer=adamw8bit", "optimizer.lr=0"], ["optimizer.lr"]),
    (["optimizer=adamw", "optimizer.min_8bit_size=0"], ["optimizer.min_8bit_size"]),
    (["optimizer=adam"], ["optimizer", "adamw"]),
    (["optimizer=came", "optimizer.betas=[0.9,0.999]"], ["optimizer.betas", "optimizer=came", "three"]),
    (["optimizer=prodigy", "optimizer.slice_p=0"], ["optimizer.slice_p"]),
    (["optimizer=adamw_schedulefree", "optimizer.warmup_steps=-1"], ["optimizer.warmup_steps"]),
    (["optimizer=lion", "optimizer.min_8bit_size=0"], ["optimizer.min_8bit_size"]),
    (["optimizer=prodigy", "optimizer.fused_backward=true"], ["optimizer.fused_backward=true", "optimizer=prodigy",
                                                              "optimizer.fused_backward=false"]),
    (["optimizer=adamw_schedulefree", "optimizer.fused_backward=true"], ["optimizer.fused_backward=true",
                                                                         "optimizer=adamw_schedulefree"]),
    (["optimizer=prodigy", "offload=optimizer", "offload.optimizer.step_on_host=false"],
     ["optimizer=prodigy", "offload.optimizer.step_on_host=false", "offload.optimizer.step_on_host=true"]),
    (["optimizer=adamw_schedulefree", "offload=optimizer", "offload.optimizer.implementation=torchao"],
     ["optimizer=adamw_schedulefree", "offload.optimizer.implementation=torchao", "implementation=builtin"]),
    (["optimizer=adamw_schedulefree", "ema.enabled=true"], ["optimizer=adamw_schedulefree", "ema.enabled=true"]),
    (["model.train_dtype=float16"], ["model.train_dtype", "bfloat16"]),
    (["model.train_dtype=bfloat16", "train.mixed_precision=fp16"], ["model.train_dtype=bfloat16", "train.mixed_precision=fp16"]),
])
def test_bad_optimizer_settings_are_user_errors(overrides, words):
    with pytest.raises(UserError) as e:
        validate(compose_config(overrides))
    for w in words:
        assert w in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message of train.device=auto")
def test_paged_optimizer_without_cuda_auto():
    with pytest.raises(UserError, match="no CUDA device is available.*optimizer=adamw8bit"):
        validate(compose_config(["optimizer=paged_adamw8bit"]))


def test_paged_optimizer_refuses_cpu_parameters():
    with pytest.raises(UserError, match="optimizer=adamw8bit"):
        build_optimizer(opt_cfg("paged_adamw8bit"), tiny_model().parameters())


# ---- model.train_dtype -------------------------------------------------------------------------------
def _bytes(module: nn.Module) -> int:
    return LiveBytesTracker().track(module, "weights")


def test_train_dtype_bfloat16_halves_trained_weights():
    full = {}
    for dtype in ("float32", "bfloat16"):
        cfg = compose_config([f"model.train_dtype={dtype}"])
        validate(cfg)
        models = build_trainer(cfg).build_models("cpu")
        unet = models["unet"]
        assert {p.dtype for p in unet.parameters()} == {getattr(torch, dtype)}
        assert all(p.requires_grad for p in unet.parameters())
        full[dtype] = _bytes(unet), _bytes(models["text_encoder"])
    assert full["bfloat16"][0] * 2 == full["float32"][0]  # the trained U-Net: exactly half
    assert full["bfloat16"][1] == full["float32"][1]  # frozen modules follow model.dtype, untouched

    cfg = compose_config(["model.train=lora", "model.train_dtype=bfloat16", "model.dtype=float16"])
    validate(cfg)
    unet = build_trainer(cfg).build_models("meta")["unet"]
    trained = {p.dtype for p in unet.parameters() if p.requires_grad}
    frozen = {p.dtype for p in unet.parameters() if not p.requires_grad}
    assert trained == {torch.bfloat16} and frozen == {torch.float16}


# ---- GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_paged_adamw8bit_on_cuda():
    model = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 8)).cuda()  # 524288 elements: paged; 4096: not
    cfg = opt_cfg("paged_adamw8bit", "train.device=cuda")
    optimizer = build_optimizer(cfg, model.parameters())
    x = torch.randn(4, 1024, device="cuda")
    model(x).pow(2).mean().backward()
    optimizer.step()
    big = optimizer.state[model[0].weight]
    small = optimizer.state[model[1].weight]
    assert getattr(big["state1"], "is_paged", False) and not getattr(small["state1"], "is_paged", False)
    sim = simulate_state_bytes(cfg, list(model.parameters()))
    assert sim["paged"] == 2 * 1024 * 512
    assert sum(sim.values()) == optimizer_state_bytes(optimizer)


# ---- the optimizers whose update couples the parameters ----------------------------------------------
def test_prodigy_steps_exactly_as_prodigyopt_with_a_fixed_size_state():
    """Ours keeps the initial weights p0 of an all-zero parameter as a tensor of its size (prodigyopt keeps
    a 0-dim zero, which the planner's fake tensors cannot foresee); the weights are prodigyopt's, bit for bit."""
    from prodigyopt import Prodigy

    runs = {}
    for which in ("ours", "prodigyopt"):
        model = tiny_model()
        with torch.no_grad():
            model[0].bias.zero_()  # as LoRA's B matrices and fresh norm biases are
        cfg = opt_cfg("prodigy", "optimizer.weight_decay=0.01", "optimizer.d0=1e-3")
        if which == "ours":
            optimizer = build_optimizer(cfg, model.parameters())
        else:
            optimizer = Prodigy(model.parameters(), lr=1.0, weight_decay=0.01, d0=1e-3)
        for _ in range(3):
            compute_grads(model)
            optimizer.step()
        runs[which] = model, optimizer
    (ours, ours_opt), (theirs, theirs_opt) = runs["ours"], runs["prodigyopt"]
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert ours_opt.param_groups[0]["d"] == theirs_opt.param_groups[0]["d"] > 1e-3  # d grew, identically
    assert ours_opt.state[ours[0].bias]["p0"].shape == (300,)
    assert theirs_opt.state[theirs[0].bias]["p0"].dim() == 0
    assert optimizer_state_bytes(ours_opt) == expected_state_bytes("prodigy", list(ours.parameters()))


def test_prodigy_with_an_adamw_learning_rate_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="runner"):
        validate(compose_config(["optimizer=prodigy"]))
        assert not caplog.records
        validate(compose_config(["optimizer=prodigy", "optimizer.lr=1e-4"]))
    [record] = caplog.records
    assert "optimizer.lr=0.0001" in record.getMessage() and "optimizer.d_coef" in record.getMessage()


def test_a_missing_optimizer_package_is_named_with_its_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "came_pytorch" else real(name, *a))
    with pytest.raises(UserError, match="optimizer=came needs the Python package came-pytorch.*pip install came-pytorch"):
        validate(compose_config(["optimizer=came"]))


def test_schedulefree_modes_evaluated_weights_and_exact_return():
    """to_evaluation_point gives schedulefree's eval() weights x (what checkpoints hold); at_evaluation_point
    gives x inside and the training point y back bit for bit; to_training_point recomputes y as schedulefree does."""
    from schedulefree import AdamWScheduleFree

    from runner.optim.modes import at_evaluation_point, has_modes, to_evaluation_point, to_training_point

    def trained(which: str):
        model = tiny_model()
        if which == "ours":
            optimizer = build_optimizer(opt_cfg("adamw_schedulefree", "optimizer.lr=1e-2"), model.parameters())
        else:
            optimizer = AdamWScheduleFree(model.parameters(), lr=1e-2, weight_decay=1e-2, foreach=False)
            optimizer.train()
        for _ in range(3):
            compute_grads(model)
            optimizer.step()
        return model, optimizer

    model, optimizer = trained("ours")
    ref, ref_opt = trained("upstream")
    assert has_modes(optimizer) and not has_modes(build_optimizer(opt_cfg("adamw"), tiny_model().parameters()))
    y = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(y, ref.parameters()))  # the same training as schedulefree's own

    ref_opt.eval()
    x = [p.detach().clone() for p in ref.parameters()]
    with at_evaluation_point(optimizer):
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), x))
        assert not optimizer.param_groups[0]["train_mode"]
    assert optimizer.param_groups[0]["train_mode"]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), y))  # restored, not recomputed

    to_evaluation_point(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), x))
    with at_evaluation_point(optimizer):  # already there: nothing moves
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), x))
    to_training_point(optimizer)
    ref_opt.train()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))  # schedulefree's own y
    compute_grads(model)
    optimizer.step()  # in train mode again


def test_adamw_on_a_card_is_torchs_fused_kernel_and_steps_as_the_per_parameter_loop():
    """On a card (here the simulated one) AdamW is torch's fused multi-tensor kernel (no temporaries); on the
    host the per-parameter loop (foreach=False). Same state tensors, and the same update within float rounding."""
    from runner.side_streams import SIM_DEVICE
    from runner.memory.cuda_sim import SimulatedCuda

    host = tiny_model()
    card_start = [p.detach().clone() for p in host.parameters()]
    with SimulatedCuda(None):
        card = tiny_model().to(SIM_DEVICE)
        with torch.no_grad():
            for p, s in zip(card.parameters(), card_start):
                p.copy_(s)
        opts = {"host": build_optimizer(opt_cfg("adamw", "optimizer.lr=1e-3"), host.parameters()),
                "card": build_optimizer(opt_cfg("adamw", "optimizer.lr=1e-3"), card.parameters())}
        assert opts["card"].param_groups[0]["fused"] and opts["card"].param_groups[0]["foreach"] is not True
        assert not opts["host"].param_groups[0]["fused"] and opts["host"].param_groups[0]["foreach"] is False
        for _ in range(3):
            for name, model in (("host", host), ("card", card)):
                torch.manual_seed(0)
                for p in model.parameters():
                    p.grad = torch.randn(p.shape).to(p.device)
                opts[name].step()
        for ph, pc in zip(host.parameters(), card.parameters()):
            assert set(opts["host"].state[ph]) == set(opts["card"].state[pc])  # step, exp_avg, exp_avg_sq
            assert torch.allclose(ph.detach(), pc.detach().to("cpu", copy=True), rtol=1e-5, atol=1e-6)
