"""tiling=vae / tiling=attention: tiled VAE, attention backend, attention slicing.

Bounds stated here, all measured on this CPU with random-init tiny models:

* Tiled vs whole-image VAE encode of a purely local VAE (GroupNorm replaced by identity, no
  mid-block attention), 512 px image, 256 px tiles, 64 px overlap: relative L2 error of the
  posterior mean <= 1e-2 (measured 2.7e-3); the same tiles without overlap are >= 3x worse
  (1.6e-2), which is what the blending buys. Misaligned tiles would be off by O(1) or change shape.
* The real tiny VAE the trainers build (GroupNorm statistics and mid-block attention are
  per tile), 1024 px, 512/128 px tiles: relative L2 error <= 0.12 (measured 0.098). Random
  weights are the worst case for per-tile normalisation; this bound is not a quality claim
  for trained VAEs.
* Attention kernels: outputs within 1e-5 absolute and gradients within 1e-4 relative of the
  default kernel.
"""
from __future__ import annotations

import collections
import functools

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from runner.parts import idle_parts
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.context import RunContext
from runner.data.demo import demo_image
from runner.data.images import _to_tensor
from runner.errors import UserError
from runner.families.sdxl.architecture import sdxl_configs
from runner.memory.live_bytes import LiveBytesTracker
from runner.plugin import PluginSchedule
from runner.plugins.tiling import (
    AttentionConfig,
    TilingConfig,
    VaeTiling,
    apply_attention_backend,
    apply_attention_slicing,
    apply_vae_tiling,
    check_config,
)
from runner.resolved import ResolvedRun, resolve
from runner.trainer import ModelSet


@pytest.fixture(autouse=True, scope="module")
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(min(2, n))
    yield
    torch.set_num_threads(n)


def tiny_vae(local: bool = False) -> nn.Module:
    """The trainers' tiny SDXL VAE; ``local``: without GroupNorm and mid-block attention, so each
    output depends only on a neighbourhood of the input (tiling must then be nearly exact)."""
    from diffusers import AutoencoderKL

    cfg = dict(sdxl_configs("tiny")["vae"])
    if local:
        cfg["mid_block_add_attention"] = False
    torch.manual_seed(0)
    vae = AutoencoderKL.from_config(cfg).eval().requires_grad_(False)
    if local:
        for parent in list(vae.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.GroupNorm):
                    setattr(parent, name, nn.Identity())
    return vae


def image(size: int) -> torch.Tensor:
    return torch.stack([_to_tensor(demo_image(3, size))])


def measured(fn, *pre_existing) -> tuple[torch.Tensor, int]:
    """(result, peak live bytes beyond weights and inputs) of ``fn()`` under no_grad."""
    tracker = LiveBytesTracker()
    for t in pre_existing:
        tracker.track(t, "weights")
    with tracker, torch.no_grad(), tracker.phase("forward"):
        out = fn()
    snap = tracker.snapshot()["devices"]["cpu"]
    return out, snap["peak_bytes"] - snap["peak_by_category"]["weights"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ---- tiled VAE ------------------------------------------------------------------------------
def test_tiles_align_and_seams_blend_on_a_local_vae():
    vae, x = tiny_vae(local=True), image(512)
    with torch.no_grad():
        whole = vae.encode(x).latent_dist.mean
    errors = {}
    for overlap in (64, 0):
        undo = apply_vae_tiling(vae, 256, overlap)
        with torch.no_grad():
            tiled = vae.encode(x).latent_dist.mean
        undo()
        assert tiled.shape == whole.shape
        errors[overlap] = rel(tiled, whole)
    print("\nlocal VAE, 512 px, 256 px tiles: rel L2 error with 64 px overlap", errors[64], "without", errors[0])
    assert errors[64] <= 1e-2
    assert errors[0] >= 3 * errors[64]  # blending the overlap removes most of the seam error
    with torch.no_grad():
        assert torch.equal(vae.encode(x).latent_dist.mean, whole)  # undo restored whole-image encoding


def test_tiled_encode_at_1024_lowers_peak_bytes(capsys):
    vae, x = tiny_vae(), image(1024)
    enc = lambda: vae.encode(x).latent_dist.mean.clone()  # noqa: E731
    whole, whole_peak = measured(enc, vae, x)
    undo = apply_vae_tiling(vae, 512, 128)
    tiled, tiled_peak = measured(enc, vae, x)
    undo()
    small_undo = apply_vae_tiling(vae, 256, 64)
    _, small_peak = measured(enc, vae, x)
    small_undo()
    err = rel(tiled, whole)
    with capsys.disabled():
        print(f"\ntiny VAE encode at 1024 px, peak activation bytes: whole {whole_peak}, 512/128 tiles {tiled_peak}, "
              f"256/64 tiles {small_peak}; rel L2 error (512/128) {err:.4f}")
    assert tiled.shape == whole.shape == (1, 4, 128, 128)
    assert err <= 0.12
    assert tiled_peak * 3 < whole_peak and small_peak < tiled_peak


def test_tiled_decode_is_bounded_and_lowers_peak_bytes(capsys):
    vae = tiny_vae(local=True)
    with torch.no_grad():
        z = vae.encode(image(256)).latent_dist.mean
    dec = lambda: vae.decode(z).sample.clone()  # noqa: E731
    whole, whole_peak = measured(dec, vae, z)
    undo = apply_vae_tiling(vae, 128, 32)
    tiled, tiled_peak = measured(dec, vae, z)
    undo()
    with capsys.disabled():
        print(f"\nlocal VAE decode to 256 px: peak bytes whole {whole_peak}, 128/32 tiles {tiled_peak}; "
              f"rel L2 error {rel(tiled, whole):.5f}")
    assert tiled.shape == whole.shape and rel(tiled, whole) <= 1e-2
    assert tiled_peak < whole_peak


# ---- attention ------------------------------------------------------------------------------
TINY_UNET = dict(
    sample_size=32, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
)


@pytest.fixture(scope="module")
def unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(**TINY_UNET).train()


def unet_inputs(side: int = 32) -> dict:
    g = torch.Generator().manual_seed(1)  # 32x32 latents: 1024 tokens in the first attention
    return dict(sample=torch.randn(2, 4, side, side, generator=g), timestep=torch.tensor([10, 500]),
                encoder_hidden_states=torch.randn(2, 7, 32, generator=g))


class CountSdpa(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "attention" in name or "softmax" in name:
            self.ops[name.split(".")[1]] += 1
        return func(*args, **(kwargs or {}))


def step(model: nn.Module, inputs: dict, grad: bool = True):
    """(output, grads, peak bytes beyond weights and inputs, kernel counts)."""
    model.zero_grad(set_to_none=True)
    tracker, ops = LiveBytesTracker(), CountSdpa()
    tracker.track(model, "weights")
    tracker.track(inputs, "weights")
    with tracker, ops:
        with tracker.phase("forward"), torch.set_grad_enabled(grad):
            out = model(**inputs)[0]
            loss = out.float().pow(2).mean()
        if grad:
            with tracker.phase("backward"):
                loss.backward()
    snap = tracker.snapshot()["devices"]["cpu"]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, snap["peak_bytes"] - snap["peak_by_category"]["weights"], ops.ops


def assert_close(a, b):
    out_a, grads_a = a[0], a[1]
    out_b, grads_b = b[0], b[1]
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=1e-5)
    assert grads_a.keys() == grads_b.keys()
    for n in grads_a:
        torch.testing.assert_close(grads_b[n], grads_a[n], rtol=1e-4, atol=1e-4 * float(grads_a[n].abs().max()), msg=n)


def test_attention_backends_match_default(unet):
    inputs = unet_inputs()
    base = step(unet, inputs)
    assert base[3]["_scaled_dot_product_flash_attention_for_cpu"] > 0  # PyTorch's CPU default
    for backend, kernel in (("math", "_safe_softmax"), ("flash", "_scaled_dot_product_flash_attention_for_cpu")):
        undo = apply_attention_backend([unet], backend)
        got = step(unet, inputs)
        undo()
        assert got[3][kernel] > 0 and (backend != "math" or "_scaled_dot_product_flash_attention_for_cpu" not in got[3])
        assert_close(base, got)
    assert not any("forward" in m.__dict__ for m in unet.modules())  # every wrapper removed


def test_attention_backend_holds_in_checkpoint_recomputation(unet):
    """The recomputation in backward runs outside any step context: it must use the same kernel."""
    from runner.blocks import find_repeated_blocks
    from runner.plugins.checkpoint import (
        apply_activation_checkpointing,
        remove_activation_checkpointing,
    )

    inputs = unet_inputs(16)
    base = step(unet, inputs)
    undo = apply_attention_backend([unet], "math")
    blocks = apply_activation_checkpointing(find_repeated_blocks(unet))
    try:
        got = step(unet, inputs)
    finally:
        remove_activation_checkpointing(blocks)
        undo()
    assert "_scaled_dot_product_flash_attention_for_cpu" not in got[3] and got[3]["_safe_softmax"] > 0
    assert_close(base, got)


def test_flux_attention_modules_take_the_backend():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                   guidance_embeds=False, axes_dims_rope=(4, 4, 8)).train()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 64, 8, generator=g), encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                  img_ids=torch.randn(64, 3, generator=g), txt_ids=torch.zeros(8, 3))
    base = step(model, inputs)
    undo = apply_attention_backend([model], "math")
    got = step(model, inputs)
    undo()
    assert "_scaled_dot_product_flash_attention_for_cpu" not in got[3] and got[3]["_safe_softmax"] > 0
    assert_close(base, got)


def test_attention_slicing_lowers_peak_bytes(unet, capsys):
    """Slicing against the kernel it replaces (explicit softmax): same values, lower peaks."""
    inputs = unet_inputs()
    default = {grad: step(unet, inputs, grad)[2] for grad in (False, True)}  # for the record: fused kernel
    undo_math = apply_attention_backend([unet], "math")
    try:
        peaks = {}
        results = {}
        for grad in (False, True):
            results[("math", grad)] = step(unet, inputs, grad)
            undo = apply_attention_slicing(unet, "max")
            results[("sliced", grad)] = step(unet, inputs, grad)
            undo()
            peaks[grad] = (results[("math", grad)][2], results[("sliced", grad)][2])
    finally:
        undo_math()
    with capsys.disabled():
        print(f"\ntiny U-Net, 1024 tokens, peak bytes beyond weights (math vs attention_slice=max): "
              f"forward only {peaks[False]}, training step {peaks[True]}; "
              f"default (fused) kernel: forward only {default[False]}, training step {default[True]}")
    assert_close(results[("math", True)], results[("sliced", True)])
    assert peaks[False][1] * 4 < peaks[False][0]  # no_grad: one slice of scores at a time
    assert peaks[True][1] < peaks[True][0]  # training: every slice's softmax is still saved
    assert all(type(p).__name__ == "AttnProcessor2_0" for p in unet.attn_processors.values())  # restored


# ---- plugin and validation ------------------------------------------------------------------
@functools.cache
def cpu_run() -> ResolvedRun:
    return resolve(compose_config(["train.device=cpu"]))


def make_ctx(plugin, models: ModelSet) -> RunContext:
    ctx = RunContext(run=plugin.run, schedule=PluginSchedule.build([plugin]), **idle_parts(plugin.run))
    ctx.models = models
    return ctx


def test_plugin_applies_everything_and_tears_down(unet):
    vae = tiny_vae()
    plugin = VaeTiling(TilingConfig(vae_tile_size=256, vae_tile_overlap=64, attention="math", attention_slice="auto"),
                       cpu_run())
    ctx = make_ctx(plugin, ModelSet({"unet": unet, "vae": vae}, trained={"unet"}))
    assert [p.key for p in ctx.schedule.by_phase["transform_models"]] == ["tiling/vae"]
    ctx.run_phase("transform_models")
    assert vae.use_tiling and vae.tile_sample_min_size == 256 and vae.tile_latent_min_size == 32
    assert vae.tile_overlap_factor == 0.25
    assert all(type(p).__name__ == "SlicedAttnProcessor" for p in unet.attn_processors.values())
    assert any("forward" in m.__dict__ for m in unet.modules())
    ctx.teardown()
    assert not vae.use_tiling and vae.tile_sample_min_size == 64
    assert all(type(p).__name__ == "AttnProcessor2_0" for p in unet.attn_processors.values())
    assert not any("forward" in m.__dict__ for m in unet.modules())


def test_attention_only_option_and_composition():
    cfg = compose_config(["tiling=attention", "tiling.attention.attention=math"])
    validate(cfg)
    assert cfg.tiling.attention.name == "attention" and cfg.tiling.attention.vae_tiling is False
    cfg = compose_config(["tiling=vae", "tiling.vae.vae_tile_size=256", "tiling.vae.vae_tile_overlap=32",
                          "tiling.vae.attention_slice=2"])
    validate(cfg)
    assert cfg.tiling.vae.vae_tiling is True and cfg.tiling.vae.attention_slice == "2"


def test_slicing_a_model_without_it_is_a_user_error():
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                   axes_dims_rope=(4, 4, 8))
    ctx = make_ctx(VaeTiling(AttentionConfig(attention_slice="auto"), cpu_run()),
                   ModelSet({"transformer": model}, trained={"transformer"}))
    with pytest.raises(UserError, match=r"tiling.attention.attention_slice=auto needs a model with diffusers' set_attention_slice"):
        ctx.run_phase("transform_models")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["tiling=vae", "tiling.vae.vae_tile_overlap=512"],
         r"tiling.vae.vae_tile_overlap=512 is not valid with tiling.vae.vae_tile_size=512"),
        (["tiling=vae", "tiling.vae.vae_tile_overlap=-8"], r"tiling.vae.vae_tile_overlap=-8 is not valid"),
        (["tiling=vae", "tiling.vae.vae_tile_size=500"], r"tiling.vae.vae_tile_size=500 is not valid: .*multiple of 8"),
        (["tiling=vae", "tiling.vae.vae_tile_overlap=100"], r"tiling.vae.vae_tile_overlap=100 .*multiple of 8 .*e.g. 96"),
        (["tiling=attention", "tiling.attention.attention=fast"],
         r"tiling.attention.attention='fast' is not valid. Valid values: .*flash"),
        (["tiling=attention", "tiling.attention.attention=efficient", "train.device=cpu"],
         r"tiling.attention.attention=efficient is a CUDA-only kernel"),
        (["tiling=attention", "tiling.attention.attention=cudnn", "train.device=cpu"],
         r"tiling.attention.attention=cudnn is a CUDA-only"),
        # A run for CUDA, planned from this CPU-only machine (a cuda training run needs a GPU to validate).
        (["tiling=attention", "tiling.attention.attention=flash", "train.device=cuda", "train.mixed_precision=no",
          "mode=plan"],
         r"tiling.attention.attention=flash takes only float16/bfloat16 inputs.*train.mixed_precision=bf16"),
        (["tiling=attention", "tiling.attention.attention_slice=0"], r"tiling.attention.attention_slice='0' is not valid"),
        (["tiling=attention", "tiling.attention.attention_slice=half"],
         r"tiling.attention.attention_slice='half' is not valid"),
    ],
)
def test_validation(overrides, match):
    with pytest.raises(UserError, match=match):
        validate(compose_config(overrides))


def test_flash_on_cpu_is_valid():
    """PyTorch's CPU build has a flash kernel (its CPU default), so this is not a conflict."""
    validate(compose_config(["tiling=attention", "tiling.attention.attention=flash", "train.device=cpu"]))
    check_config(TilingConfig(attention="flash"))


@pytest.mark.gpu
def test_tiled_vae_on_cuda_lowers_allocator_peak():
    vae = tiny_vae().cuda()
    x = image(1024).cuda()
    peaks = []
    for tiles in (None, (512, 128)):
        undo = apply_vae_tiling(vae, *tiles) if tiles else (lambda: None)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            vae.encode(x).latent_dist.mean.clone()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        undo()
    assert peaks[1] * 2 < peaks[0]
