"""Optimizer offload (offload=optimizer): state on the host, same updates as the plain optimizer.

On the CPU ``always_copy=True`` gives every parameter a separate host master (and moves the
state through separate buffers), so the copies, gradient hooks, host accumulation and host
clipping all run; results are BIT-EXACT (torch.equal) against the plain optimizer. Device bytes
are measured on fake tensors (device ``meta``, host fake ``cpu``).
"""
from __future__ import annotations

import pytest
import torch
from diffusers.optimization import get_scheduler

from runner.parts import build_trainer
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.errors import UserError
from runner.memory.live_bytes import LiveBytesTracker
from runner.plugins.offload_optimizer import offload_optimizer, torchao_available
from runner.plugins.optimizer_wrappers import HostStateOptimizer, HostStepOptimizer

# One intra-op thread (tests/conftest.py): faster tiny ops, bitwise-reproducible runs.
pytestmark = pytest.mark.usefixtures("one_thread")


_TRAINER = {}


def sdxl(train: str = "full"):
    if train not in _TRAINER:
        _TRAINER[train] = build_trainer(compose_config(["trainer=sdxl", f"model.train={train}"]))
    return _TRAINER[train]


def train(wrap=None, micro_batches: int = 2, steps: int = 3, max_norm: float = 0.5, train_mode: str = "full"):
    """AdamW with a warm-up schedule, clipping and gradient accumulation, as the runner does it."""
    tr = sdxl(train_mode)
    torch.manual_seed(0)
    models = tr.build_models("cpu")
    unet = models["unet"]
    unet.train()
    params = [p for p in unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, foreach=False)
    if wrap is not None:
        opt = wrap(opt)
    sched = get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=10)
    batch = tr.example_batch(2 * micro_batches, "cpu")
    losses = []
    for _ in range(steps):
        for i in range(micro_batches):
            mb = {k: (v[2 * i:2 * i + 2] if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in batch.items()}
            loss = tr.loss(models, mb) / micro_batches
            loss.backward()
            losses.append(loss.detach())
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_norm)  # the runner's clip: device gradients only
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in unet.named_parameters()}, opt


def assert_same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0])), (a[0], b[0])
    bad = [n for n in a[1] if not torch.equal(a[1][n], b[1][n])]
    assert not bad, bad[:3]


@pytest.fixture(scope="module")
def plain():
    return train()


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_host_step_equals_the_plain_optimizer(plain, offload_gradients):
    """Masters on the host, state created there, step on the host, weights copied back; with
    offload_gradients the gradients go to the host during backward, are accumulated there over
    the 2 micro-batches and clipped by the wrapper (the runner's clip then sees none)."""
    wrapped = train(lambda o: offload_optimizer(o, step_on_host=True, offload_gradients=offload_gradients,
                                                max_grad_norm=0.5, grad_accum=2, always_copy=True))
    assert_same(plain, wrapped)
    opt = wrapped[2]
    assert isinstance(opt, HostStepOptimizer) and opt.offload_gradients == offload_gradients
    masters = {id(m) for _, m in opt.pairs}
    assert all(id(p) in masters for p in opt.state)  # the state belongs to the host masters
    assert all(p is not m for p, m in opt.pairs)


def test_state_on_host_step_on_device_in_chunks_equals_the_plain_optimizer(plain):
    wrapped = train(lambda o: offload_optimizer(o, step_on_host=False, chunk_bytes=2**20, always_copy=True))
    assert_same(plain, wrapped)
    opt = wrapped[2]
    assert isinstance(opt, HostStateOptimizer) and len(opt._chunks()) == 0  # grads were zeroed
    assert opt.host_bytes() == sum(2 * p.numel() * 4 for g in opt.param_groups for p in g["params"])


@pytest.mark.parametrize("step_on_host", [True, False])
def test_state_dict_has_the_plain_format_and_resumes_exactly(step_on_host, tmp_path):
    """Step 1 with the plain AdamW, its state_dict saved; step 2 with the wrapper loading it
    gives the same weights as step 2 with the plain AdamW (and the wrapper saves the same format)."""
    tr = sdxl()
    batch = tr.example_batch(2, "cpu")

    def model_and_params():
        torch.manual_seed(0)
        models = tr.build_models("cpu")
        return models, [p for p in models["unet"].parameters() if p.requires_grad]

    def step(models, params, opt):
        tr.loss(models, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    results = []
    for wrap in (False, True):
        models, params = model_and_params()
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        step(models, params, opt)
        torch.save(opt.state_dict(), tmp_path / "opt.pt")
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        if wrap:
            opt = offload_optimizer(opt, step_on_host=step_on_host, always_copy=True)
        opt.load_state_dict(torch.load(tmp_path / "opt.pt"))
        step(models, params, opt)
        results.append((opt.state_dict(), {n: p.detach().clone() for n, p in models["unet"].named_parameters()}))
    (plain_sd, plain_w), (wrapped_sd, wrapped_w) = results
    assert all(torch.equal(plain_w[n], wrapped_w[n]) for n in plain_w)
    assert wrapped_sd["param_groups"] == plain_sd["param_groups"]
    assert wrapped_sd["state"].keys() == plain_sd["state"].keys()
    for k, st in plain_sd["state"].items():
        assert all(torch.equal(wrapped_sd["state"][k][n], v) for n, v in st.items())


def test_fake_tensors_keep_no_state_on_the_device():
    """Device bytes after a step: the plain optimizer keeps AdamW's two moments on the device
    (8 B per float32 parameter); the wrapper keeps none there."""
    from runner.plan import fake_module, simulation_mode

    results = {}
    for mode_name in ("plain", "host_step", "host_state"):
        tr = sdxl()
        mode = simulation_mode()
        models = tr.build_models("meta")
        unet = models["unet"]
        with mode:
            fake_module(unet, torch.device("meta"), {})
            params = [p for p in unet.parameters() if p.requires_grad]
            for p in params:
                p.grad = torch.empty_like(p)
            opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
            if mode_name == "host_step":
                opt = offload_optimizer(opt, step_on_host=True)
            elif mode_name == "host_state":
                opt = offload_optimizer(opt, step_on_host=False, chunk_bytes=2**20)
        tracker = LiveBytesTracker(count_inputs=False)
        tracker.track(unet, "weights")
        tracker.track([p.grad for p in params], "gradients")
        with mode, tracker:
            with tracker.phase("optimizer"):
                opt.step()
        snap = tracker.snapshot()["devices"]
        results[mode_name] = {d: v["current_by_category"]["optimizer_state"] for d, v in snap.items()}
        param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert results["plain"]["meta"] == 2 * param_bytes
    assert results["host_step"].get("meta", 0) == 0 and results["host_step"]["cpu"] >= 2 * param_bytes
    assert results["host_state"].get("meta", 0) == 0 and results["host_state"]["cpu"] >= 2 * param_bytes


def test_runner_runs_with_every_offload_option_and_resumes(tmp_path):
    """The loop (clipping, 2 micro-batches, LR schedule, checkpoints): identical losses for
    offload=optimizer (both modes) and every offload plugin composed (park, stream, activations,
    optimizer); a run resumed from a checkpoint of the wrapper continues with the same losses."""
    from runner.__main__ import task
    from runner.output.report import read_metrics

    common = ["train.progress=false", "train.steps=4", "train.grad_accum=2", "checkpoint=blocks",
              "train.lr_scheduler=linear", "train.lr_warmup_steps=1", "train.save_every=2"]

    def losses(name, *extra):
        out = tmp_path / name
        task(compose_config([f"output_dir={out}", *common, *extra]))
        return [r["loss"] for r in read_metrics(out / "metrics.jsonl")], out

    base, _ = losses("none")
    host, out = losses("host", "offload=optimizer", "offload.optimizer.offload_gradients=true")
    state, _ = losses("state", "offload=optimizer", "offload.optimizer.step_on_host=false")
    combined, _ = losses("combined", "offload=[park,stream,activations,optimizer]",
                         "offload.stream.device_fraction=0.5", f"offload.park.cache_dir={tmp_path / 'cache'}")
    assert host == base and state == base and combined == base
    resumed, _ = losses("resumed", "offload=optimizer", "offload.optimizer.offload_gradients=true",
                        f"train.resume={out / 'checkpoints' / 'step-00000002'}")
    assert resumed == base[2:]


def test_invalid_or_unsupported_settings_are_user_errors():
    # fp16 applies where the step runs in fp16: a GPU target (mode=plan plans for one), or a CPU
    # with train.cpu_autocast=true. A plain CPU run trains in float32 (runner/resolved.py).
    for target in ("mode=plan", "train.cpu_autocast=true"):
        with pytest.raises(UserError, match="bf16"):
            validate(compose_config(["offload=optimizer", "train.mixed_precision=fp16", target]))
        validate(compose_config(["offload=optimizer", "train.mixed_precision=fp16",
                                 "offload.optimizer.step_on_host=false", target]))
    with pytest.raises(UserError, match=r"offload\.optimizer\.implementation"):
        validate(compose_config(["offload=optimizer", "offload.optimizer.implementation=deepspeed"]))
    with pytest.raises(UserError, match=r"offload\.optimizer\.chunk_mb"):
        validate(compose_config(["offload=optimizer", "offload.optimizer.chunk_mb=0"]))
    if not torchao_available():
        with pytest.raises(UserError, match="torchao is not installed"):
            validate(compose_config(["offload=optimizer", "offload.optimizer.implementation=torchao",
                                     "train.max_grad_norm=0"]))
    with pytest.raises(UserError, match="cannot clip"):
        validate(compose_config(["offload=optimizer", "offload.optimizer.implementation=torchao"]))


def test_offload_gradients_refuses_a_mix_of_host_and_device_parameters():
    a = torch.nn.Parameter(torch.randn(4))
    b = torch.nn.Parameter(torch.randn(4, device="meta"))
    with pytest.raises(ValueError, match="offload_gradients"):
        HostStepOptimizer(torch.optim.AdamW([a, b]), offload_gradients=True)


@pytest.mark.gpu
@pytest.mark.parametrize("step_on_host", [True, False])
def test_cuda_optimizer_offload(step_on_host):
    from diffusers import UNet2DConditionModel

    def steps(wrap):
        torch.manual_seed(0)
        unet = UNet2DConditionModel(sample_size=32, block_out_channels=(64, 128), layers_per_block=1,
                                    cross_attention_dim=64, attention_head_dim=8,
                                    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D")).cuda()
        params = list(unet.parameters())
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
        if wrap:
            opt = offload_optimizer(opt, step_on_host=step_on_host, offload_gradients=step_on_host,
                                    max_grad_norm=1.0, implementation="builtin", chunk_bytes=2**22)
        g = torch.Generator().manual_seed(1)
        x, ehs = torch.randn(2, 4, 32, 32, generator=g).cuda(), torch.randn(2, 16, 64, generator=g).cuda()
        t = torch.tensor([10, 500], device="cuda")
        for _ in range(3):
            unet(x, t, ehs).sample.float().pow(2).mean().backward()
            if not (wrap and step_on_host):
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        on_device = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor) and v.is_cuda)
        return {n: p.detach().cpu() for n, p in unet.named_parameters()}, on_device

    base, base_state = steps(False)
    off, off_state = steps(True)
    assert base_state > 0 and off_state == 0
    for n in base:
        torch.testing.assert_close(off[n], base[n], rtol=1e-4, atol=1e-6, msg=n)


# ---- the other optimizers ------------------------------------------------------------------------------
NEW_OPTIMIZERS = ["prodigy", "adamw_schedulefree", "lion", "lion8bit", "came"]
PER_PARAMETER = ["lion", "lion8bit", "came"]  # prodigy and adamw_schedulefree couple the parameters' updates


def _tiny_steps(name: str, wrap=None, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from runner.optim.build import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Tanh(), torch.nn.Linear(300, 16))
    lr = {"prodigy": "1.0", "came": "1e-3"}.get(name, "1e-2")
    opt = build_optimizer(compose_config([f"optimizer={name}", f"optimizer.lr={lr}"]).optimizer, model.parameters())
    if wrap is not None:
        opt = wrap(opt)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 16, generator=g)
    for _ in range(steps):
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


@pytest.mark.parametrize("name", NEW_OPTIMIZERS)
def test_host_step_takes_every_optimizer_bit_for_bit(name):
    """step_on_host=true steps the whole optimizer on host masters: the coupled updates (Prodigy's d, the
    schedule-free step count) are the plain optimizer's."""
    plain, _ = _tiny_steps(name)
    wrapped, opt = _tiny_steps(name, lambda o: offload_optimizer(o, step_on_host=True, always_copy=True))
    assert isinstance(opt, HostStepOptimizer)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), wrapped.parameters()))


@pytest.mark.parametrize("name", PER_PARAMETER)
def test_state_on_host_in_chunks_takes_the_per_parameter_optimizers_bit_for_bit(name):
    plain, _ = _tiny_steps(name)
    wrapped, opt = _tiny_steps(name, lambda o: offload_optimizer(o, step_on_host=False, chunk_bytes=40_000,
                                                                 always_copy=True))
    assert isinstance(opt, HostStateOptimizer) and len({id(p) for p in opt.inner.state}) == 4
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), wrapped.parameters()))


@pytest.mark.parametrize("name", ["prodigy", "adamw_schedulefree"])
def test_chunked_steps_and_torchao_refuse_the_coupled_optimizers(name):
    from runner.optim.build import build_optimizer

    params = list(torch.nn.Linear(4, 4).parameters())
    opt = build_optimizer(compose_config([f"optimizer={name}"]).optimizer, params)
    with pytest.raises(ValueError, match="a chunk at a time"):
        offload_optimizer(opt, step_on_host=False)
    from runner.plugins.offload_optimizer import torchao_blockers
    from runner.plugins.schemas import OptimizerOffloadConfig

    why = torchao_blockers(OptimizerOffloadConfig(), 0.0, 1, "cuda", opt.couples_parameters)
    assert why and "one optimizer per parameter" in why[0]


def test_schedulefree_modes_reach_the_device_weights_through_the_host_step():
    """eval()/train() move the host masters; the wrapper copies them to the device parameters each time."""
    from runner.optim.modes import at_evaluation_point, to_evaluation_point, to_training_point

    plain, plain_opt = _tiny_steps("adamw_schedulefree")
    wrapped, opt = _tiny_steps("adamw_schedulefree", lambda o: offload_optimizer(o, step_on_host=True, always_copy=True))
    y = [p.detach().clone() for p in wrapped.parameters()]
    plain_opt.eval()
    with at_evaluation_point(opt):
        assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), wrapped.parameters()))  # x on the device
    assert all(torch.equal(a, b) for a, b in zip(y, wrapped.parameters()))  # y back, exactly
    to_evaluation_point(opt)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), wrapped.parameters()))
    to_training_point(opt)
    plain_opt.train()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), wrapped.parameters()))
    assert all(torch.equal(p, m) for p, m in opt.pairs)


def test_a_resume_reaches_the_host_masters(tmp_path):
    """A resume copies the checkpoint's weights into the device parameters after the wrapper made its masters;
    weights_loaded() gives them to the masters, or the next host step would continue from the initial weights."""
    from runner.state.checkpoint import TrainState, load_checkpoint, save_checkpoint
    from runner.trainer import ModelSet

    def model_set():
        torch.manual_seed(0)
        return ModelSet({"net": torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))}, {"net"})

    def step(models, opt):
        models["net"](torch.ones(4, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    trained = model_set()
    opt = torch.optim.AdamW(trained["net"].parameters(), lr=1e-2, foreach=False)
    for _ in range(2):
        step(trained, opt)
    ckpt = save_checkpoint(tmp_path, TrainState(step=2), trained, opt, None)
    step(trained, opt)  # the straight run's third step

    resumed = model_set()
    wrapped = offload_optimizer(torch.optim.AdamW(resumed["net"].parameters(), lr=1e-2, foreach=False),
                                step_on_host=True, always_copy=True)
    load_checkpoint(ckpt, resumed, wrapped, None)
    wrapped.weights_loaded()  # what the loop does after loading (runner/loop.py)
    step(resumed, wrapped)
    assert all(torch.equal(a, b) for a, b in zip(trained["net"].parameters(), resumed["net"].parameters()))
