"""tiling=vae on the video VAEs (Wan's AutoencoderKLWan, Qwen-Image's AutoencoderKLQwenImage).

What is claimed, measured on this CPU with random-init tiny VAEs:

* Space: the plugin sets the strided tile API these VAEs have (tile and stride in pixels). A
  tiled encode of a clip returns the whole encode's shape and needs a fraction of its peak; on a
  VAE made local (mid-block attention removed: the only global op) the 64 px overlap blends the
  seams: 192 px frames in 96 px tiles are >= 2x closer to the whole encode with the overlap than
  without it. Random weights are the worst case for seams; this is not a quality figure.
* Time: these VAEs already encode 1 + 4k frames in chunks of 4 (decode one latent frame at a
  time) with a causal cache, so the encode's peak beyond its input and output barely grows with
  the clip's length: there is nothing to tile in time, and the plugin does not.
* The planner counts it: with latents encoded on the device (``offload.park.cache_latents=false``)
  the planned step of a Wan run under ``tiling=vae`` is below the untiled one, and still within
  5 % of a real CPU step.
"""
from __future__ import annotations

import pytest
import torch
from planner_truth import assert_plan_matches_a_real_cpu_step
from torch import nn

from runner.parts import idle_parts
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.context import RunContext
from runner.data.demo_video import demo_frame
from runner.data.video import frames_to_tensor
from runner.families.qwen_image.architecture import qwen_image_configs
from runner.families.wan.architecture import wan_configs
from runner.memory.live_bytes import LiveBytesTracker
from runner.plan import plan_step
from runner.plugin import PluginSchedule
from runner.plugins.tiling import (
    TilingConfig,
    VaeTiling,
    apply_vae_tiling,
    is_tileable_vae,
    vae_downsampling,
)
from runner.resolved import resolve
from runner.trainer import ModelSet

pytestmark = pytest.mark.usefixtures("one_thread")


def wan_vae(local: bool = False, variant: str = "14b") -> nn.Module:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan.from_config(wan_configs("tiny", variant)["vae"]).eval().requires_grad_(False)
    if local:
        for mid in (vae.encoder.mid_block, vae.decoder.mid_block):
            for i, attn in enumerate(mid.attentions):
                if attn is not None:
                    mid.attentions[i] = nn.Identity()
    return vae


def clip(frames: int, size: int) -> torch.Tensor:
    return frames_to_tensor([demo_frame(3, f, frames, size, size) for f in range(frames)], False)[None]


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


def test_video_vaes_are_tileable_with_their_own_factor():
    from diffusers import AutoencoderKLQwenImage

    qwen = AutoencoderKLQwenImage.from_config(qwen_image_configs("tiny")["vae"])
    for vae, factor in ((wan_vae(), 8), (wan_vae(variant="2.2-5b"), 16), (qwen, 8)):
        assert is_tileable_vae(vae) and vae_downsampling(vae) == factor
        undo = apply_vae_tiling(vae, 128, 32)
        assert vae.use_tiling and (vae.tile_sample_min_height, vae.tile_sample_stride_width) == (128, 96)
        undo()
        assert not vae.use_tiling and vae.tile_sample_min_height == 256  # diffusers' default, restored
    with pytest.raises(Exception, match="multiples of its factor 16"):
        apply_vae_tiling(wan_vae(variant="2.2-5b"), 120, 24)


def test_spatial_tiles_blend_and_lower_the_encode_peak(capsys):
    vae, x = wan_vae(local=True), clip(5, 192)
    enc = lambda: vae.encode(x).latent_dist.mean.clone()  # noqa: E731
    whole, whole_peak = measured(enc, vae, x)
    errors, peaks = {}, {}
    for overlap in (48, 0):
        undo = apply_vae_tiling(vae, 96, overlap)
        tiled, peaks[overlap] = measured(enc, vae, x)
        undo()
        assert tiled.shape == whole.shape == (1, 16, 2, 24, 24)
        errors[overlap] = rel(tiled, whole)
    with capsys.disabled():
        print(f"\nlocal Wan VAE, 5 x 192 px, 96 px tiles: rel L2 error {errors[48]:.3f} with 48 px overlap, "
              f"{errors[0]:.3f} without; peak bytes whole {whole_peak}, tiled {peaks[48]}")
    assert errors[0] >= 2 * errors[48]  # the overlap's blend removes most of the seams
    assert peaks[48] * 2 < whole_peak


def test_time_is_already_chunked(capsys):
    vae = wan_vae()
    peaks = {}
    for frames in (5, 17):
        x = clip(frames, 64)
        _, peaks[frames] = measured(lambda: vae.encode(x).latent_dist.mean.clone(), vae, x)
    with capsys.disabled():
        print(f"\nWan VAE encode at 64 px, peak bytes beyond weights and input: 5 frames {peaks[5]}, 17 frames {peaks[17]}")
    assert peaks[17] < 1.3 * peaks[5]  # 3.4x the frames, about the same peak


def test_tiled_decode_lowers_the_peak():
    vae = wan_vae(local=True)
    with torch.no_grad():
        z = vae.encode(clip(5, 128)).latent_dist.mean
    dec = lambda: vae.decode(z).sample.clone()  # noqa: E731
    whole, whole_peak = measured(dec, vae, z)
    undo = apply_vae_tiling(vae, 64, 16)
    tiled, tiled_peak = measured(dec, vae, z)
    undo()
    assert tiled.shape == whole.shape == (1, 3, 5, 128, 128)
    assert tiled_peak < whole_peak


def test_the_plugin_tiles_the_run_vae_and_tears_down():
    run = resolve(compose_config(["trainer=wan", "train.device=cpu"]))
    vae = wan_vae()
    ctx = RunContext(run=run, schedule=PluginSchedule.build([VaeTiling(TilingConfig(vae_tile_size=32, vae_tile_overlap=8),
                                                                       run)]), **idle_parts(run))
    ctx.models = ModelSet(modules={"vae": vae})
    ctx.run_phase("transform_models")
    assert vae.use_tiling and (vae.tile_sample_min_width, vae.tile_sample_stride_height) == (32, 24)
    ctx.teardown()
    assert not vae.use_tiling


CLIPS = ["trainer=wan", "offload=park", "offload.park.cache_latents=false", "data.frames=5", "data.width=96",
         "data.height=96", "train.device=cpu"]
TILED = ["tiling=vae", "tiling.vae.vae_tile_size=48", "tiling.vae.vae_tile_overlap=16"]


def test_the_planner_counts_the_tiled_video_encode():
    plain = plan_step(compose_config(CLIPS))
    tiled = plan_step(compose_config([*CLIPS, *TILED]))
    assert "in encode" in plain.peak_phase
    assert tiled.peak_bytes < plain.peak_bytes
    cfg = compose_config([*CLIPS, *TILED])
    validate(cfg)
    assert_plan_matches_a_real_cpu_step(cfg)
