"""Streamed weight offload (``offload=stream``): train a denoiser larger than the device budget.

The weights of a chosen set of repeated blocks live in (pinned) host memory and are copied to
the device just before each block runs, on a side stream, ``offload.stream.prefetch`` blocks ahead;
they are dropped from the device when the block is done. The rest of the model stays resident.

The package, by responsibility (each module's docstring has the details):

* ``plan``: which blocks are streamed, within a budget in bytes rather than blocks
  (:func:`plan_stream`), and the execution order they are expected to run in.
* ``handle``: :func:`apply_stream_offload` and :class:`StreamHandle` (host copies, device
  buffers, copies, lifecycle; parameter identity through device twins); ``hooks``: when blocks
  are loaded and released (forward, saved tensors, backward order, gradients to the host);
  ``state``: the runtime records.
* host memory (page-locked regions, host copies, byte counts) is :mod:`runner.plugins.host_buffers`,
  which ``offload=optimizer`` uses too.
* here: the config (``offload.*``) and the plugin.

It composes with the other offload plugins, each with its own node: ``offload=[park,stream]``
(park places first: its encode pre-pass runs while the denoiser is still on the host),
``+offload=activations``, ``+offload=optimizer``. It claims the modules it streams, so a module
that park parks or drops cannot be streamed too (the run stops before anything is built). Combined
with the optimizer offload, gradients stay on the device until the step (``offload_gradients``
off), so the runner's clipping sees every gradient: the streamed blocks' on the host, the
resident ones' on the device.

Planner (``ctx.simulate``): the same code runs synchronously on fake tensors (device ``meta``,
host fake ``cpu``), so the planned device bytes contain exactly the resident weights and the
window, and the streamed bytes are reported as pinned host memory (``ctx.note_pinned_bytes``); a weight read in backward after its release would be a fake-tensor
device mismatch, so every planned step also checks the load/release order.

Trade-offs: every streamed byte crosses PCIe twice per step (forward and backward; frozen
blocks without backward work are not reloaded), so the saving is paid in bandwidth; it is free
only while resident compute hides the copies (bench/offload_bench.py measures it). Full
fine-tune also runs the streamed parameters' optimizer step on the host CPU. Under autocast with
float32 master weights, each streamed block's bf16 weight casts are kept out of the autocast
cache (it is cleared after the block), which costs nothing because each weight is used once.
Blocks holding quantized parameters (bitsandbytes) or parameters shared with other modules stay
resident.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from runner.blocks import find_repeated_blocks
from runner.context import Transfer
from runner.errors import UserError
from runner.plugin import ClaimsModules
from runner.plugins.host_buffers import GiB, tensor_bytes
from runner.plugins.schemas import StreamConfig, check_stream
from runner.plugins.stream.handle import MARK, StreamHandle, apply_stream_offload
from runner.plugins.stream.schedule import (
    BlockPlan,
    StreamPlan,
    guess_execution_order,
    minimum_device_bytes,
    plan_stream,
)
from runner.plugins.stream.state import StreamStats
from runner.registry import register_plugin

if TYPE_CHECKING:
    from runner.context import RunContext

__all__ = [
    "BlockPlan", "StreamConfig", "StreamHandle", "StreamOffload", "StreamPlan", "StreamStats",
    "apply_stream_offload", "check_config", "guess_execution_order", "minimum_device_bytes", "plan_stream",
]

log = logging.getLogger("runner")


# ---- the plugin --------------------------------------------------------------------------------
def check_config(c: Any, key: str = "offload.stream") -> None:
    """This plugin's settings (runner/plugins/schemas.py)."""
    check_stream(c, key)


@register_plugin
class StreamOffload(ClaimsModules):
    kind = "offload"
    name = "stream"
    claim_as = "stream"
    fit_knob = "stream_gb"
    conflicts = {
        ("stream", "park"): "a streamed module's weights are copied block by block, a parked one moves whole",
        ("stream", "drop"): "a dropped module is freed once its outputs are cached: there is nothing to stream",
        ("stream", "stream"): "one streaming plan per module",
    }
    Config = StreamConfig
    # offload=[park,stream]: park's encode pre-pass runs while the denoiser is still on the host.
    after = ("offload/park",)

    def validate(self) -> None:
        if self.run.train_mode == "full" and self.run.precision == "fp16":
            raise UserError(
                "offload=stream with model.train=full and train.mixed_precision=fp16: the streamed parameters' "
                "gradients live on the host, where fp16 gradient scaling (GradScaler) does not unscale them. "
                "Use train.mixed_precision=bf16 (or no), or model.train=lora."
            )

    def place_models(self, ctx: RunContext) -> None:
        c = self.config
        names = self.targets(ctx)
        sizes = {n: sum(tensor_bytes(p) for p in ctx.models[n].parameters())
                 + sum(tensor_bytes(b) for b in ctx.models[n].buffers()) for n in names}
        total = sum(sizes.values()) or 1
        handles: dict[str, StreamHandle] = {}
        for n in names:
            module = ctx.models[n]
            blocks = ctx.models.blocks.get(n) or find_repeated_blocks(module)
            if not blocks:
                raise UserError(f"offload=stream found no repeated blocks in {n} ({type(module).__name__}) to stream; "
                                f"give the trainer's ModelSet.blocks or choose {self.setting('modules')}.")
            if c.device_budget_gb is not None:  # one budget, shared in proportion to weight bytes
                budget = int(c.device_budget_gb * GiB * sizes[n] / total)
            else:
                budget = int(c.device_fraction * sizes[n])
            handle = apply_stream_offload(module, blocks, budget, int(c.prefetch), ctx.device, ctx.host,
                                          pin_memory=bool(c.pin_memory), name=n,
                                          clear_cast_cache=_cast_cache_clearer(ctx),
                                          cuda_like=self.run.on_cuda)  # the planner takes the GPU's branch too
            ctx.hooks.add(module, MARK, self.key, handle=handle, undo=handle.remove)
            ctx.facts.placed.add(n)
            ctx.facts.streamed.add(n)
            handles[n] = handle
            log.info("stream: %s", handle.plan.describe())
        self.handles = handles
        host = sum(h.host_bytes() for h in handles.values())
        if c.pin_memory:
            ctx.note_pinned_bytes(host)  # pinned on the target GPU (the planner's contract)
        ctx.notes["stream: weight bytes on the host"] = host
        ctx.notes["stream: planned device weight bytes"] = sum(h.plan.device_weight_bytes for h in handles.values())
        ctx.notes["stream: planned window bytes"] = sum(h.plan.window_bytes for h in handles.values())

    def _copied(self) -> tuple[int, int]:
        handles = getattr(self, "handles", {}).values()
        return sum(h.stats.h2d_bytes for h in handles), sum(h.stats.d2h_bytes for h in handles)

    def on_step_start(self, ctx: RunContext, step: int) -> None:
        self._copied_before = self._copied()

    def on_step_end(self, ctx: RunContext, step: int) -> None:
        """Record this step's copies for the step-time model: on a side stream, prefetched ahead of use."""
        handles = getattr(self, "handles", {})
        if not handles:
            return
        (h2d, d2h), (h2d0, d2h0) = self._copied(), getattr(self, "_copied_before", (0, 0))
        ctx.facts.transfers[self.key] = Transfer(
            h2d_bytes=h2d - h2d0, d2h_bytes=d2h - d2h0, overlapped=self.run.on_cuda,
            window_bytes=sum(h.plan.window_bytes for h in handles.values()))

    def on_oom(self, ctx: RunContext, step: int, error: BaseException) -> None:
        for h in getattr(self, "handles", {}).values():
            h.reset()

    def teardown(self, ctx: RunContext) -> None:
        """Report what was streamed; the hooks themselves are removed by ``ctx.hooks``."""
        handles = getattr(self, "handles", {})
        if handles:
            ctx.notes["stream: peak streamed bytes on the device"] = sum(h.stats.peak_device_bytes for h in handles.values())
            ctx.notes["stream: host-to-device bytes"] = sum(h.stats.h2d_bytes for h in handles.values())
        self.handles = {}


def _cast_cache_clearer(ctx: RunContext) -> Callable[[], None]:
    """Clears torch's autocast weight-cast cache, and in simulation the planner's own copy of it
    (``DeviceSemantics.cache``: ``meta`` has no torch autocast, so the planner keeps the cache)."""
    def clear() -> None:
        torch.clear_autocast_cache()
        cache = getattr(getattr(ctx.accelerator, "semantics", None), "cache", None)
        if isinstance(cache, dict):  # the planner's, or train.device=cuda_sim's (the same emulation)
            cache.clear()

    return clear
