"""One block finder (runner/blocks.py) for checkpointing, streaming and the planner."""
from __future__ import annotations

import torch
from diffusers import (
    DiTTransformer2DModel,
    FluxTransformer2DModel,
    PixArtTransformer2DModel,
    UNet2DConditionModel,
    WanTransformer3DModel,
)
from torch import nn

from runner.blocks import find_repeated_blocks
from runner.families.flux.architecture import flux_configs
from runner.families.sdxl.architecture import sdxl_configs
from runner.plugins.stream import apply_stream_offload, minimum_device_bytes


def test_unet_blocks_are_its_resnets_and_attentions():
    cfg = sdxl_configs("tiny")["unet"]
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(cfg)
    stages = [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
    want = {id(m) for s in stages for attr in ("resnets", "attentions") for m in (getattr(s, attr, None) or [])}
    assert {id(b) for b in find_repeated_blocks(unet)} == want


def test_dit_flux_and_wan_blocks_are_their_block_lists():
    with torch.device("meta"):
        dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=3,
                                    sample_size=8, patch_size=2, num_embeds_ada_norm=4)
        flux = FluxTransformer2DModel.from_config(flux_configs("tiny")["transformer"])
        wan = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                    out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2)
    assert find_repeated_blocks(dit) == list(dit.transformer_blocks)
    assert find_repeated_blocks(flux) == [*flux.transformer_blocks, *flux.single_transformer_blocks]
    assert find_repeated_blocks(wan) == list(wan.blocks)


def test_a_one_off_module_the_model_declares_is_not_a_block():
    """PixArt lists PatchEmbed beside BasicTransformerBlock in _no_split_modules; it occurs once."""
    assert "PatchEmbed" in PixArtTransformer2DModel._no_split_modules
    with torch.device("meta"):
        pixart = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                          num_layers=3, sample_size=8, patch_size=2, cross_attention_dim=16,
                                          caption_channels=16)
    assert find_repeated_blocks(pixart) == list(pixart.transformer_blocks)


def test_any_model_falls_back_to_its_module_lists():
    net = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    assert find_repeated_blocks(net) == list(net[1])


def test_a_dit_streams_with_the_same_outputs_and_gradients(one_thread):
    """offload=stream used to find no blocks in a diffusers DiT; now it streams them, exactly."""
    torch.manual_seed(0)
    dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=3,
                                sample_size=8, patch_size=2, num_embeds_ada_norm=4)
    for m in dit.modules():
        if hasattr(m, "dropout_prob"):
            m.dropout_prob = 0.0
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 700]), torch.tensor([0, 2])

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = dit(x, timestep=t, class_labels=y).sample
        out.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in dit.named_parameters()}
        dit.zero_grad(set_to_none=True)
        return out.detach(), grads

    ref_out, ref_grads = step()
    blocks = find_repeated_blocks(dit)
    budget = minimum_device_bytes(dit, blocks, prefetch=1)  # the least the device can hold: stream what can be
    handle = apply_stream_offload(dit, blocks, device_budget_bytes=budget, prefetch=1, device="cpu", pin_memory=False,
                                  always_copy=True, name="denoiser")
    try:
        assert len(blocks) == 3 and len(handle.plan.streamed) >= 2
        out, grads = step()
    finally:
        handle.remove()
    assert torch.equal(out, ref_out)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in grads)
