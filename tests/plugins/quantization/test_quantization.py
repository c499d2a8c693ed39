"""quantization=nf4|int8|fp8: frozen base weights quantized, LoRA trained on top.

Quantization error is real, so equality is tested against the *same* model with each quantized
layer's weight replaced by its dequantized value (what the quantized layer multiplies with):
outputs and LoRA gradients must then match to rounding. Closeness to the unquantized model is
checked separately, with loose bounds that a broken quantizer (wrong layout, wrong scale) fails.
Bytes come from real bitsandbytes layers on CPU, counted by the live-bytes tracker, and are
asserted exactly against the documented layouts and against the planner's simulation.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

import peft.tuners.tuners_utils  # noqa: F401  (imported lazily by the plugins; a first import inside a
import pytest  # measured call leaves frames in a reference cycle until the next GC)
import torch
from accelerate.utils import set_seed
from torch import nn

from runner.parts import build_plugins, build_trainer, idle_parts, make_context, prepare_models
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.context import RunContext
from runner.errors import UserError
from runner.loop import train
from runner.memory.live_bytes import LiveBytesTracker
from runner.output.report import summary
from runner.plugin import PluginSchedule
from runner.plugins.quantization.bnb import (
    Int8Quantization,
    NF4Quantization,
    SimulatedQuantLinear,
    apply_bnb_quantization,
    dequantized_weight,
    int8_layout,
    layout_bytes,
    nf4_layout,
)
from runner.plugins.quantization.common import (
    DEFAULT_SKIP,
    keep_patterns,
    select_linear_layers,
    weight_tensors,
)
from runner.plugins.quantization.fp8 import (
    Float8StorageLinear,
    Fp8Storage,
    apply_fp8_storage,
)
from runner.resolved import resolve
from runner.session import make_accelerator
from runner.trainer import ModelSet

METHODS = ("nf4", "int8", "fp8")


# One intra-op thread (tests/conftest.py): faster tiny ops, bitwise-reproducible runs.
pytestmark = pytest.mark.usefixtures("one_thread")


# ---- expected bytes, written out independently of the plugin's layout tables --------------------
def nf4_bytes(out_f: int, in_f: int, double_quant: bool) -> int:
    n = out_f * in_f
    blocks = math.ceil(n / 64)
    packed_and_code = (n + 1) // 2 + 16 * 4
    if double_quant:  # uint8 absmax, float32 offset, a float32 per 256 absmax blocks, 256-entry float32 code
        return packed_and_code + blocks + 4 + 4 * math.ceil(blocks / 256) + 256 * 4
    return packed_and_code + 4 * blocks


def int8_bytes(out_f: int, in_f: int) -> int:
    return out_f * in_f + 4 * out_f


def fp8_bytes(out_f: int, in_f: int) -> int:
    return out_f * in_f + 4  # + one float32 scale


def expected_bytes(method: str, out_f: int, in_f: int) -> int:
    return {"nf4": lambda: nf4_bytes(out_f, in_f, True), "int8": lambda: int8_bytes(out_f, in_f),
            "fp8": lambda: fp8_bytes(out_f, in_f)}[method]()


def tracked_bytes(module: nn.Module) -> tuple[int, str]:
    """(bytes, device) of every weight tensor, bitsandbytes' quantization state included, via the tracker."""
    tracker = LiveBytesTracker()
    n = tracker.track(weight_tensors(module), "weights")
    devices = [d for d, v in tracker.current.items() if v]
    assert len(devices) == 1 and tracker.current_bytes(devices[0]) == n, tracker.current
    return n, devices[0]


def quantize(module: nn.Module, method: str, simulate: bool = False, **kw):
    if method == "fp8":  # plain torch ops: the same code runs on real, meta and fake tensors
        return apply_fp8_storage(module, compute_dtype=torch.float32, **kw)
    return apply_bnb_quantization(module, method, compute_dtype=torch.float32, simulate=simulate, **kw)


def dense_weight(layer: nn.Module) -> torch.Tensor:
    return layer.upcast() if isinstance(layer, Float8StorageLinear) else dequantized_weight(layer)


# ---- one layer: bitsandbytes' layout, the documented bytes and the simulation agree ----------------
@pytest.mark.parametrize("shape", [(130, 96), (64, 64), (7, 33)])
@pytest.mark.parametrize("method,double_quant", [("nf4", True), ("nf4", False), ("int8", True), ("fp8", True)])
def test_layer_bytes_real_documented_and_simulated(method, double_quant, shape):
    out_f, in_f = shape
    torch.manual_seed(0)
    real = nn.Sequential(nn.Linear(in_f, out_f)).requires_grad_(False)
    meta = copy.deepcopy(real).to("meta")
    bias_bytes = 4 * out_f
    before, _ = tracked_bytes(real)
    assert before == 4 * out_f * in_f + bias_bytes

    kw = {"double_quant": double_quant} if method == "nf4" else {}
    res = quantize(real, method, skip=[], **kw)
    quantize(meta, method, simulate=True, skip=[], **kw)
    assert res.layers == ["0"]
    want = nf4_bytes(out_f, in_f, double_quant) if method == "nf4" else expected_bytes(method, out_f, in_f)
    real_bytes, real_dev = tracked_bytes(real)
    sim_bytes, sim_dev = tracked_bytes(meta)
    assert (real_dev, sim_dev) == ("cpu", "meta")
    assert real_bytes - bias_bytes == want == res.weight_bytes_after
    assert sim_bytes == real_bytes
    if method != "fp8":
        layout = nf4_layout(out_f, in_f, double_quant) if method == "nf4" else int8_layout(out_f, in_f)
        assert layout_bytes(layout) == want
        assert isinstance(meta[0], SimulatedQuantLinear)
        # Every tensor bitsandbytes keeps has the shape and dtype the simulation allocates.
        layer = real[0]
        if method == "nf4":
            qs = layer.weight.quant_state
            got = {"weight": layer.weight.data, "code": qs.code, "absmax": qs.absmax}
            if double_quant:
                got |= {"offset": qs.offset, "nested_absmax": qs.state2.absmax, "nested_code": qs.state2.code}
        else:
            got = {"weight": layer.weight.data, "SCB": layer.weight.SCB}
        assert {k: (tuple(t.shape), t.dtype) for k, t in got.items()} == layout


@pytest.mark.parametrize("method", METHODS)
def test_quantizing_frees_each_original_layer_as_it_goes(method):
    """The peak while quantizing is the model plus about one layer, not both models side by side."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(64)]).requires_grad_(False)
    layer_bytes = 256 * 256 * 4
    # bitsandbytes builds its 8-bit code map once per process, on first use: not the model's bytes.
    # Warm it, and count only what is born under the tracker (not pre-existing op inputs).
    quantize(nn.Sequential(nn.Linear(64, 64)).requires_grad_(False), method, skip=[])
    tracker = LiveBytesTracker(count_inputs=False)
    before = tracker.track(weight_tensors(model))
    with tracker:
        quantize(model, method, skip=[])
    after = tracker.current_bytes("cpu")
    assert before == 64 * layer_bytes and after == 64 * expected_bytes(method, 256, 256)
    # Keeping the originals until the end would peak at before + after (>= 64 x 35 KB above `before`).
    assert tracker.peak_bytes("cpu") - before <= 2 * layer_bytes


# ---- a real denoiser with LoRA on a quantized base ------------------------------------------------
@pytest.fixture(scope="module")
def lora_sdxl():
    """The tiny SDXL trainer with LoRA, real (CPU) and meta models, built once."""
    cfg = compose_config(["model.train=lora"])
    trainer = build_trainer(cfg)
    set_seed(0)
    real = trainer.build_models("cpu")
    meta = trainer.build_models("meta")
    return trainer, real, meta


def unet_with_trained_lora(models: ModelSet) -> nn.Module:
    """A copy of the LoRA U-Net whose B matrices are non-zero (at init B = 0, so A gets no gradient)."""
    unet = copy.deepcopy(models["unet"])
    g = torch.Generator().manual_seed(3)
    for name, p in unet.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.1
    return unet


def loss_and_grads(trainer, unet: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    unet.zero_grad(set_to_none=True)
    loss = trainer.loss(ModelSet({"unet": unet}, {"unet"}), batch)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in unet.named_parameters() if p.grad is not None}


# Closeness to the *unquantized* model on this tiny, randomly initialised U-Net (uniform init is
# harder for NF4 than trained, normal-like weights): measured loss error 0.09% / 0.01% / 0.04% and
# LoRA-gradient cosine 0.85 / 0.9998 / 0.992 for nf4 / int8 / fp8. A wrong layout or scale gives a
# cosine near 0 and a loss off by far more than 1%.
FIDELITY = {"nf4": 0.7, "int8": 0.99, "fp8": 0.95}


@pytest.mark.parametrize("method", METHODS)
def test_lora_on_quantized_unet_matches_dequantized_baseline(lora_sdxl, method, capsys):
    trainer, models, _ = lora_sdxl
    batch = trainer.example_batch(2, "cpu")
    original = unet_with_trained_lora(models)
    unet = copy.deepcopy(original)
    shapes = {t.name: (t.layer.out_features, t.layer.in_features) for t in select_linear_layers(unet).targets}
    before, _ = tracked_bytes(unet)

    res = quantize(unet, method)
    assert set(res.layers) == set(shapes) and len(shapes) > 100

    # Baseline: the same model, every quantized layer's weight replaced by what it computes with.
    reference = copy.deepcopy(original)
    for name in res.layers:
        reference.get_submodule(name).weight.data = dense_weight(unet.get_submodule(name)).float().clone()

    loss_q, grads_q = loss_and_grads(trainer, unet, batch)
    loss_r, grads_r = loss_and_grads(trainer, reference, batch)
    # Same weights, same fp32 compute: only the kernels' order of operations may differ (int8's
    # CPU path scales the int8 values before the matmul rather than after): 1e-4 of the largest
    # gradient entry is far above those rounding differences and far below any real error.
    torch.testing.assert_close(loss_q, loss_r, rtol=1e-5, atol=0)
    trained = {n for n, p in unet.named_parameters() if p.requires_grad}
    assert grads_q.keys() == grads_r.keys() == trained
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)  # only LoRA is trained
    for n in grads_q:
        torch.testing.assert_close(grads_q[n], grads_r[n], rtol=1e-4, atol=1e-4 * grads_r[n].abs().max().item(), msg=n)
    for name in res.layers:  # quantized weights are frozen and got no gradient
        layer = unet.get_submodule(name)
        assert not layer.weight.requires_grad and layer.weight.grad is None

    # Closeness to the unquantized model (quantization error is real; see FIDELITY).
    loss_o, grads_o = loss_and_grads(trainer, original, batch)
    flat = lambda g: torch.cat([g[k].flatten() for k in sorted(g)])  # noqa: E731
    cosine = torch.nn.functional.cosine_similarity(flat(grads_q), flat(grads_o), dim=0).item()
    assert abs(loss_q - loss_o).item() / loss_o.item() < 0.01
    assert cosine > FIDELITY[method], cosine

    # Bytes: the tracker's count of the whole U-Net's weights drops by exactly the documented amount.
    after, _ = tracked_bytes(unet)
    saved = sum(4 * o * i - expected_bytes(method, o, i) for o, i in shapes.values())
    assert before - after == saved == res.weight_bytes_before - res.weight_bytes_after
    with capsys.disabled():
        print(f"\n{method}: tiny LoRA U-Net weights {before} -> {after} bytes ({len(res.layers)} layers quantized, "
              f"{res.weight_bytes_before} -> {res.weight_bytes_after}); loss {loss_o.item():.5f} -> {loss_q.item():.5f}, "
              f"LoRA-grad cosine {cosine:.4f}")


@pytest.mark.parametrize("method", METHODS)
def test_planner_simulation_same_bytes_and_runs_on_meta_and_fake(lora_sdxl, method):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    trainer, models, meta_models = lora_sdxl
    real = unet_with_trained_lora(models)
    quantize(real, method)
    # int8 computes in the input dtype
    dtype = [] if method == "int8" else [f"quantization.{method}.compute_dtype=float32"]
    cfg = compose_config(["model.train=lora", f"quantization={method}", *dtype])
    run = resolve(cfg, target="cuda", device=torch.device("meta")).simulated()  # as the planner runs it
    plugin = {"nf4": NF4Quantization, "int8": Int8Quantization, "fp8": Fp8Storage}[method](cfg.quantization[method], run)
    sim_models = ModelSet({"unet": copy.deepcopy(meta_models["unet"])}, {"unet"})
    ctx = RunContext(run=run, schedule=PluginSchedule.build([plugin]), cfg=cfg, **idle_parts(run))
    assert ctx.simulate and ctx.device.type == "meta"
    ctx.models = sim_models
    ctx.run_phase("transform_models")
    sim = sim_models["unet"]

    assert tracked_bytes(sim) == (tracked_bytes(real)[0], "meta")  # byte for byte, whole U-Net
    kinds = {type(m).__name__ for m in sim.modules()} & {"SimulatedQuantLinear", "Float8StorageLinear"}
    assert kinds == ({"Float8StorageLinear"} if method == "fp8" else {"SimulatedQuantLinear"})

    # Forward and backward on meta: right shapes and dtypes, gradients reach exactly the LoRA weights.
    loss = trainer.loss(sim_models, trainer.example_batch(2, "meta"))
    loss.backward()
    grads = {n: p.grad for n, p in sim.named_parameters() if p.grad is not None}
    assert grads.keys() == {n for n, p in sim.named_parameters() if p.requires_grad}
    assert all(g.is_meta and g.shape == sim.get_parameter(n).shape for n, g in grads.items())

    # Under FakeTensorMode (how the planner runs a step) the simulated layers make fake tensors.
    fake_unet = copy.deepcopy(meta_models["unet"])
    with FakeTensorMode(allow_non_fake_inputs=True):
        ctx.models = ModelSet({"unet": fake_unet}, {"unet"})
        ctx.run_phase("transform_models")
        x = torch.empty(2, 4, 8, 8, device="meta")
        out = fake_unet(x, torch.tensor([1, 2], device="meta"), encoder_hidden_states=torch.empty(2, 77, 64, device="meta"),
                        added_cond_kwargs={"text_embeds": torch.empty(2, 32, device="meta"),
                                           "time_ids": torch.empty(2, 6, device="meta")}).sample
        out.float().pow(2).mean().backward()
    assert isinstance(out, FakeTensor) and out.shape == x.shape
    lora_grads = [p.grad for n, p in fake_unet.named_parameters() if p.requires_grad]
    assert lora_grads and all(isinstance(g, FakeTensor) for g in lora_grads)


def test_simulated_layer_refuses_real_tensors():
    layer = SimulatedQuantLinear(nn.Linear(8, 4, device="meta"), "nf4", torch.float32)
    with pytest.raises(RuntimeError, match="meta or fake"):
        SimulatedQuantLinear(nn.Linear(8, 4), "nf4", torch.float32)
    with pytest.raises(RuntimeError, match="meta or fake"):
        layer(torch.zeros(2, 8))


# ---- which layers -----------------------------------------------------------------------------------
def test_skip_patterns_and_keep_in_fp32(lora_sdxl):
    trainer, models, _ = lora_sdxl
    unet = copy.deepcopy(models["unet"])
    sel = select_linear_layers(unet)
    # Defaults keep the conditioning MLPs; adapters are never candidates; base layers are.
    assert {"time_embedding.linear_1", "time_embedding.linear_2", "add_embedding.linear_1",
            "add_embedding.linear_2"} == set(sel.skipped)
    names = [t.name for t in sel.targets]
    assert not any(".lora_" in n for n in names)
    assert any(n.endswith("attn1.to_q.base_layer") for n in names)
    assert any(n.endswith("ff.net.2") for n in names)

    res = apply_bnb_quantization(unet, "int8", skip=[*DEFAULT_SKIP, r"attn2\."])
    attn2 = [n for n, m in unet.named_modules() if type(m) is nn.Linear and ".attn2." in n and ".lora_" not in n]
    assert attn2 and not any(".attn2." in n for n in res.layers)  # every attn2 layer kept as it was
    assert all(isinstance(unet.get_submodule(n), nn.Linear) for n in attn2)
    assert any(".attn1." in n for n in res.layers)

    te2 = copy.deepcopy(models["text_encoder_2"])
    res = apply_fp8_storage(te2)
    assert "text_projection" in res.skipped and isinstance(te2.text_projection, nn.Linear)

    # T5 keeps its `wo` layers in float32 under float16 compute (transformers' _keep_in_fp32_modules).
    from transformers import T5EncoderModel

    from runner.families.common.loading import build_module
    from runner.families.flux.architecture import flux_configs

    t5 = build_module(T5EncoderModel, flux_configs("tiny")["text_encoder_2"], "meta", torch.float32).requires_grad_(False)
    assert keep_patterns(t5, torch.bfloat16) == [] and "wo" in keep_patterns(t5, torch.float16)
    half = select_linear_layers(t5, keep=keep_patterns(t5, torch.float16))
    bf16 = select_linear_layers(t5, keep=keep_patterns(t5, torch.bfloat16))
    assert {n.rsplit(".", 1)[-1] for n in half.skipped} == {"wo"}
    assert any(t.name.endswith(".wo") for t in bf16.targets)


def test_module_choice_and_trained_weights():
    frozen = nn.Sequential(nn.Linear(64, 64)).requires_grad_(False)
    trained = nn.Sequential(nn.Linear(64, 64))
    vae_like = nn.Sequential(nn.Linear(64, 64)).requires_grad_(False)
    cfg = compose_config(["quantization=nf4", "train.device=cpu"])
    run = resolve(cfg)
    plugin = NF4Quantization(cfg.quantization.nf4, run)
    models = ModelSet({"unet": trained, "text_encoder": frozen, "vae": vae_like}, {"unet"})
    assert plugin.target_modules(models) == ["text_encoder"]  # full fine-tune and VAE left out
    # ... and so is a module another plugin drops (offload=park's cached encoders).
    assert plugin.target_modules(models, dropped=frozenset({"text_encoder"})) == []

    ctx = RunContext(run=run, schedule=PluginSchedule.build([plugin]), cfg=cfg, **idle_parts(run))
    ctx.models = models
    ctx.run_phase("claim_modules")
    assert [(c.module, c.action, c.owner) for c in ctx.facts.claims] == [("text_encoder", "quantize", "quantization/nf4")]
    ctx.run_phase("transform_models")
    assert type(models["text_encoder"][0]).__name__ == "Linear4bit"
    assert type(models["unet"][0]) is nn.Linear and type(models["vae"][0]) is nn.Linear
    assert ctx.notes["quantized layers"] == 1 and ctx.facts.quantized == {"text_encoder": 1}

    explicit = NF4Quantization(compose_config(["quantization=nf4", "quantization.nf4.modules=[unet]"]).quantization.nf4,
                               run)
    ctx.models = ModelSet({"unet": nn.Sequential(nn.Linear(64, 64))}, {"unet"})
    with pytest.raises(UserError, match="model.train=lora"):
        explicit.transform_models(ctx)
    with pytest.raises(UserError, match=r"quantization.nf4.modules names 'unte'.*Valid names: unet"):
        NF4Quantization(compose_config(["quantization=nf4", "quantization.nf4.modules=[unte]"]).quantization.nf4,
                        run).transform_models(ctx)
    with pytest.raises(ValueError, match="trained"):
        apply_bnb_quantization(nn.Sequential(nn.Linear(64, 64)), "nf4")
    bias_trained = nn.Sequential(nn.Linear(64, 64))
    bias_trained[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="trained"):
        apply_fp8_storage(bias_trained)


# ---- why fp8 does not use diffusers' layerwise casting -------------------------------------------
def test_fp8_keeps_no_upcast_copy_for_backward_unlike_layerwise_casting():
    from diffusers.hooks import apply_layerwise_casting

    def stack() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).requires_grad_(False)

    def forward_growth(model: nn.Module) -> tuple[int, torch.Tensor]:
        """Live bytes added by a forward whose input needs a gradient (as behind a LoRA layer)."""
        x = torch.randn(8, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        tracker = LiveBytesTracker()
        tracker.track(weight_tensors(model))
        tracker.track(x, "other")
        with tracker:
            start = tracker.current_bytes("cpu")
            with tracker.phase("forward"):
                y = model(x)
            grown = tracker.current_bytes("cpu") - start
            y.float().sum().backward()
        return grown, x.grad

    hooked, ours = stack(), stack()
    apply_layerwise_casting(hooked, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    apply_fp8_storage(ours, compute_dtype=torch.bfloat16, skip=[])
    grown_hooked, _ = forward_growth(hooked)
    grown_ours, grad = forward_growth(ours)
    assert grad is not None and torch.isfinite(grad.float()).all()
    # diffusers' hooks keep every layer's bf16 weight alive until backward; ours keeps none.
    assert grown_hooked - grown_ours == 4 * 256 * 256 * 2
    assert grown_ours == 8 * 256 * 2  # just the output


# ---- through the config, in a run ---------------------------------------------------------------------
def test_nf4_run_end_to_end(tmp_path: Path):
    cfg = compose_config([f"output_dir={tmp_path}", "train.progress=false", "data.demo_size=2", "train.steps=2",
                          "train.batch_size=1", "model.train=lora", "quantization=nf4", "optimizer=adamw8bit"])
    validate(cfg)
    run = resolve(cfg)
    ctx = make_context(cfg, run, build_plugins(cfg, run), tmp_path)
    ctx.trainer = build_trainer(cfg, run)
    set_seed(0)
    ctx.models = prepare_models(ctx.trainer.build_models("cpu"), cfg.model, run)
    ctx.accelerator = make_accelerator(run)
    try:
        ctx.apply_setup_phases()
        kinds = {name: {type(m).__name__ for m in mod.modules()} for name, mod in ctx.models.items()}
        for name in ("unet", "text_encoder", "text_encoder_2"):
            assert "Linear4bit" in kinds[name], name
        assert "Linear4bit" not in kinds["vae"]
        lora_before = {n: p.detach().clone() for n, p in ctx.models.named_trainable_parameters()}
        quant_before = {n: m.weight.data.clone() for n, m in ctx.models["unet"].named_modules()
                        if type(m).__name__ == "Linear4bit"}

        result = train(ctx)
    finally:
        ctx.teardown()

    assert result.steps_done == 2 and all(math.isfinite(x) for x in result.losses)
    assert any(not torch.equal(lora_before[n], p) for n, p in ctx.models.named_trainable_parameters())
    for n, m in ctx.models["unet"].named_modules():
        if n in quant_before:
            assert torch.equal(m.weight.data, quant_before[n])  # the quantized base never changes
    state_bytes = result.notes["optimizer state bytes"]
    assert state_bytes > 0 and result.notes["quantized layers"] == ctx.notes["quantized layers"] > 100
    assert f"optimizer state: {state_bytes} bytes" in summary(result, tmp_path)


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_bnb_on_cuda_matches_dequantized_and_simulation(method):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 256)).requires_grad_(False)
    meta = copy.deepcopy(model).to("meta")
    reference = copy.deepcopy(model)
    model = model.cuda()
    res = apply_bnb_quantization(model, method, skip=[], compute_dtype=torch.bfloat16, device="cuda")
    apply_bnb_quantization(meta, method, skip=[], compute_dtype=torch.bfloat16, simulate=True)
    assert tracked_bytes(model)[0] == tracked_bytes(meta)[0]
    for name in res.layers:
        reference.get_submodule(name).weight.data = dequantized_weight(model.get_submodule(name)).float().cpu()
    x = torch.randn(16, 512)
    with torch.no_grad():
        got = model(x.cuda().bfloat16()).float().cpu()
        want = reference.bfloat16()(x.bfloat16()).float()
    # bf16 compute (int8 on CUDA also quantizes the activations): a few bf16 ulps of the output scale.
    tol = 0.05 if method == "int8" else 0.02
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.gpu
def test_quantize_on_cuda_returns_layers_to_the_host():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256)).requires_grad_(False)
    apply_bnb_quantization(model, "nf4", skip=[], device="cuda")
    assert {str(t.device) for t in weight_tensors(model)} == {"cpu"}
    assert tracked_bytes(model)[0] == nf4_bytes(256, 256, True) + 4 * 256


def test_int8s_cast_warning_is_said_once_not_every_call(tmp_path, caplog):
    """bitsandbytes' int8 matmul warns on every call that it casts float32 inputs to float16 (48 lines in
    2 tiny LoRA steps): the plugin lets the first through and drops the repeats."""
    import logging

    from runner.__main__ import task
    from runner.plugins.quantization.bnb import _Once

    for f in logging.getLogger("bitsandbytes.autograd._functions").filters:  # once per process: an earlier
        if isinstance(f, _Once):  # int8 test in this process may have said it already
            f.seen.clear()
    caplog.set_level("WARNING", logger="bitsandbytes.autograd._functions")
    task(compose_config([f"output_dir={tmp_path}", "quantization=int8", "model.train=lora", "train.steps=2",
                         "train.progress=false", "train.preflight=false", "train.device=cpu"]))
    casts = [r for r in caplog.records if "MatMul8bitLt: inputs will be cast" in r.getMessage()]
    assert len(casts) == 1
