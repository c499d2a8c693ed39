"""Activation checkpointing: same values and gradients, fewer live bytes, clean removal.

PyTorch's own recomputation check compares only shapes/dtypes/devices, so every test here
compares VALUES of outputs and of all parameter gradients against an un-checkpointed run.
"""
from __future__ import annotations

import collections
import functools
import logging
from dataclasses import asdict

import pytest
import torch
from hydra.core.config_store import ConfigStore
from torch import nn

from runner.blocks import find_repeated_blocks
from runner.parts import idle_parts
from runner.cli.compose import compose_config
from runner.context import RunContext
from runner.errors import UserError
from runner.module_changes import marked
from runner.memory.live_bytes import LiveBytesTracker
from runner.plugin import PluginSchedule
from runner.plugins.checkpoint import (
    BlockCheckpointing,
    CheckpointConfig,
    apply_activation_checkpointing,
    check_config,
    remove_activation_checkpointing,
)
from runner.resolved import ResolvedRun, resolve
from runner.trainer import ModelSet

# One intra-op thread (tests/conftest.py): faster tiny ops, bitwise-reproducible runs.
pytestmark = pytest.mark.usefixtures("one_thread")


TINY_UNET = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    block_out_channels=(32, 64),
    layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=8,
    norm_num_groups=8,
)


@pytest.fixture(scope="module")
def unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(**TINY_UNET)
    model.train()
    return model


def unet_inputs():
    g = torch.Generator().manual_seed(1)
    return dict(
        sample=torch.randn(2, 4, 16, 16, generator=g),
        timestep=torch.tensor([10, 500]),
        encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
    )


def run_step(model: nn.Module, inputs: dict, output=lambda out: out.sample):
    """One forward+backward under the tracker: (output, {name: grad}, tracker snapshot of cpu)."""
    model.zero_grad(set_to_none=True)
    tr = LiveBytesTracker()
    tr.track(model, "weights")
    with tr:
        with tr.phase("forward"):
            out = output(model(**inputs))
            loss = out.float().pow(2).mean()
        with tr.phase("backward"):
            loss.backward()
        tr.track_gradients(model)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, tr.snapshot()["devices"]["cpu"]


def assert_same(a, b):
    out_a, grads_a, _ = a
    out_b, grads_b, _ = b
    torch.testing.assert_close(out_b, out_a, rtol=1e-6, atol=1e-7)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-6, atol=1e-7, msg=name)


def activation_bytes(snap: dict) -> int:
    """Peak live bytes of the step beyond weights and inputs (all that checkpointing changes)."""
    return snap["peak_bytes"] - snap["peak_by_category"]["weights"] - snap["peak_by_category"]["other"]


def test_unet_values_gradients_and_memory(unet, capsys):
    inputs = unet_inputs()
    blocks = find_repeated_blocks(unet)
    # Each resnet and each attention (Transformer2DModel) of the down/mid/up blocks (runner.blocks).
    stages = [*unet.down_blocks, unet.mid_block, *unet.up_blocks]
    expected = {id(m) for s in stages for attr in ("resnets", "attentions") for m in getattr(s, attr, None) or []}
    assert {id(b) for b in blocks} == expected and len(blocks) == len(expected)
    assert collections.Counter(type(b).__name__ for b in blocks) == {"ResnetBlock2D": 8, "Transformer2DModel": 4}
    assert type(blocks[0]).__name__ == "Transformer2DModel"

    # Count recomputation: the inner attention is called again in backward for wrapped blocks.
    calls = []
    hook = blocks[0].transformer_blocks[0].attn1.register_forward_pre_hook(lambda m, a: calls.append(1))

    base = run_step(unet, inputs)
    assert len(calls) == 1

    results = {}
    for every_n in (1, 2):
        calls.clear()
        wrapped = apply_activation_checkpointing(blocks, every_n)
        assert wrapped == blocks[::every_n]
        try:
            results[every_n] = run_step(unet, inputs)
        finally:
            assert remove_activation_checkpointing(wrapped) == len(wrapped)
        assert len(calls) == 2  # block 0 is wrapped in both modes: forward + recompute
        assert_same(base, results[every_n])

    after = run_step(unet, inputs)
    assert_same(base, after)
    assert all("forward" not in b.__dict__ for b in blocks)
    hook.remove()

    act = {"none": activation_bytes(base[2]), "full": activation_bytes(results[1][2]),
           "every_n=2": activation_bytes(results[2][2]), "removed": activation_bytes(after[2])}
    with capsys.disabled():
        print("\ntiny UNet peak bytes (weights+inputs excluded) during forward+backward:", act,
              "| total peak:", base[2]["peak_bytes"], results[1][2]["peak_bytes"], results[2][2]["peak_bytes"],
              "| forward-phase peak:", base[2]["peak_by_phase"]["forward"],
              results[1][2]["peak_by_phase"]["forward"], results[2][2]["peak_by_phase"]["forward"])
    assert act["full"] < act["every_n=2"] < act["none"]
    assert act["removed"] == act["none"]  # removal restores the original behaviour exactly
    assert results[1][2]["peak_by_phase"]["forward"] < base[2]["peak_by_phase"]["forward"]


def test_not_checkpointed_in_eval_or_no_grad(unet):
    blocks = find_repeated_blocks(unet)
    calls = []
    hook = blocks[0].transformer_blocks[0].attn1.register_forward_pre_hook(lambda m, a: calls.append(1))
    wrapped = apply_activation_checkpointing(blocks)
    try:
        inputs = unet_inputs()
        with torch.no_grad():
            unet(**inputs)
        assert len(calls) == 1
        unet.eval()
        calls.clear()
        unet(**inputs).sample.mean().backward()
        assert len(calls) == 1  # eval mode: plain forward, no recompute
    finally:
        unet.train()
        remove_activation_checkpointing(wrapped)
        hook.remove()


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.5)
        self.inner = nn.ModuleList([nn.Linear(dim, dim)])  # nested list: never selected on its own

    def forward(self, x: torch.Tensor, scale: float = 1.0, debug: bool = False) -> torch.Tensor:
        # `debug` is also a checkpoint() option name: it must reach the block, not checkpoint.
        assert debug is True
        return x + self.inner[0](self.drop(torch.tanh(self.lin(x)))) * scale


class Net(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, scale=0.5, debug=True)
        return x


def test_module_list_discovery_dropout_rng_and_kwargs():
    torch.manual_seed(0)
    net = Net()
    blocks = find_repeated_blocks(net)
    assert blocks == list(net.blocks)  # outermost only: the nested ModuleList is skipped
    x = torch.randn(8, 16, requires_grad=True)

    def step():
        torch.manual_seed(123)  # same dropout masks for both runs
        net.zero_grad(set_to_none=True)
        x.grad = None
        out = net(x)
        out.pow(2).sum().backward()
        return out.detach(), {**{n: p.grad.clone() for n, p in net.named_parameters()}, "x": x.grad.clone()}, None

    base = step()
    wrapped = apply_activation_checkpointing(blocks, every_n=1)
    ck = step()
    remove_activation_checkpointing(wrapped)
    assert_same(base, ck)  # the recomputed dropout mask equals the original one


def test_double_apply_and_other_forward_wrappers_are_preserved():
    net = Net(depth=2)
    block = net.blocks[0]
    seen = []
    original = block.forward

    def outer_wrapper(*args, **kwargs):  # e.g. an offload hook installed before us
        seen.append(1)
        return original(*args, **kwargs)

    block.forward = outer_wrapper
    wrapped = apply_activation_checkpointing(list(net.blocks))
    assert apply_activation_checkpointing(list(net.blocks)) == []  # already wrapped
    net(torch.randn(2, 16, requires_grad=True)).sum().backward()
    assert len(seen) == 2  # forward + recompute go through the earlier wrapper
    remove_activation_checkpointing(wrapped)
    assert block.forward is outer_wrapper
    assert "forward" not in net.blocks[1].__dict__


def test_flux_transformer_values_and_memory():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(4, 4, 8),
    ).train()
    g = torch.Generator().manual_seed(1)
    seq, txt = 64, 8
    inputs = dict(
        hidden_states=torch.randn(2, seq, 8, generator=g),
        encoder_hidden_states=torch.randn(2, txt, 32, generator=g),
        pooled_projections=torch.randn(2, 32, generator=g),
        timestep=torch.tensor([0.3, 0.7]),
        guidance=torch.tensor([3.5, 3.5]),
        img_ids=torch.randn(seq, 3, generator=g),
        txt_ids=torch.zeros(txt, 3),
    )
    blocks = find_repeated_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["FluxTransformerBlock"] * 2 + ["FluxSingleTransformerBlock"] * 2
    base = run_step(model, inputs)
    wrapped = apply_activation_checkpointing(blocks)
    ck = run_step(model, inputs)
    remove_activation_checkpointing(wrapped)
    assert_same(base, ck)
    assert activation_bytes(ck[2]) < activation_bytes(base[2])


# ---- the plugin ------------------------------------------------------------------------------
@functools.cache
def cpu_run() -> ResolvedRun:
    return resolve(compose_config(["train.device=cpu"]))


def make_ctx(plugin, models: ModelSet) -> RunContext:
    ctx = RunContext(run=plugin.run, schedule=PluginSchedule.build([plugin]), **idle_parts(plugin.run))
    ctx.models = models
    return ctx


def wrapped_by(ctx: RunContext, plugin) -> list[nn.Module]:
    """The blocks ``plugin`` checkpointed, as recorded in ``ctx.hooks``."""
    return [e.module() for e in ctx.hooks.entries(kind="checkpoint", owner=plugin.key)]


def test_plugin_wraps_trained_modules_and_tears_down(caplog):
    net, frozen = Net(depth=4), Net(depth=2)
    plugin = BlockCheckpointing(CheckpointConfig(mode="every_n", every_n=2), cpu_run())
    ctx = make_ctx(plugin, ModelSet({"denoiser": net, "text": frozen}, trained={"denoiser"}))
    assert [p.key for p in ctx.schedule.by_phase["wrap_execution"]] == ["checkpoint/blocks"]
    with caplog.at_level(logging.INFO, logger="runner"):
        ctx.run_phase("wrap_execution")
    assert "denoiser: 2 of 4 discovered blocks wrapped (mode=every_n, every_n=2)" in caplog.text
    assert [name for name, b in net.blocks.named_children() if "forward" in b.__dict__] == ["0", "2"]
    assert not any("forward" in b.__dict__ for b in frozen.blocks)  # frozen modules untouched
    assert ctx.notes["checkpointed blocks"] == 2
    assert ctx.facts.checkpointed == {"denoiser": 2}
    assert wrapped_by(ctx, plugin) == [net.blocks[0], net.blocks[2]]
    assert [i for i, b in enumerate(net.blocks) if marked(b, "checkpoint")] == [0, 2]
    ctx.teardown()
    assert not any("forward" in b.__dict__ for b in net.blocks)
    assert wrapped_by(ctx, plugin) == [] and len(ctx.hooks) == 0
    assert not any(marked(b, "checkpoint") for b in net.blocks)


def test_plugin_prefers_trainer_blocks_and_named_modules():
    net, other = Net(depth=4), Net(depth=3)
    plugin = BlockCheckpointing(CheckpointConfig(mode="full", modules=["other"]), cpu_run())
    models = ModelSet({"denoiser": net, "other": other}, trained={"denoiser"}, blocks={"other": [other.blocks[1]]})
    ctx = make_ctx(plugin, models)
    ctx.run_phase("wrap_execution")
    assert wrapped_by(ctx, plugin) == [other.blocks[1]] and ctx.facts.checkpointed == {"other": 1}
    assert not any("forward" in b.__dict__ for b in net.blocks)
    ctx.teardown()
    assert "forward" not in other.blocks[1].__dict__


def test_plugin_unknown_module_is_a_user_error():
    plugin = BlockCheckpointing(CheckpointConfig(modules=["unet"]), cpu_run())
    ctx = make_ctx(plugin, ModelSet({"transformer": Net()}, trained={"transformer"}))
    with pytest.raises(UserError, match=r"checkpoint.blocks.modules.*'unet'.*Valid names: transformer"):
        ctx.run_phase("wrap_execution")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="every"), r"checkpoint.blocks.mode='every' is not valid. Valid values: every_n, full"),
        (dict(mode="every_n", every_n=0), r"checkpoint.blocks.every_n=0 is not valid"),
        (dict(mode="every_n", every_n=-3), r"checkpoint.blocks.every_n=-3"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(UserError, match=match):
        check_config(CheckpointConfig(**kwargs))


def test_registered_schema():
    import runner.plugins  # noqa: F401  (registers everything)

    node = ConfigStore.instance().repo["checkpoint"]["blocks.yaml"].node
    assert node.name == "blocks" and node.mode == "full" and node.every_n == 2 and list(node.modules) == []
    assert asdict(CheckpointConfig())["mode"] == "full"
    assert "none.yaml" in ConfigStore.instance().repo["checkpoint"]
