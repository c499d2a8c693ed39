"""Streamed weight offload (``offload=stream``): train a denoiser larger than the device budget.

The weights of a chosen set of repeated blocks live in (pinned) host memory and are copied to
the device just before each block runs, on a side stream, ``offload.prefetch`` blocks ahead;
they are dropped from the device when the block is done. The rest of the model stays resident.

The package, by responsibility (each module's docstring has the details):

* ``plan``: which blocks are streamed, within a budget in bytes rather than blocks
  (:func:`plan_stream`), and the execution order they are expected to run in.
* ``handle``: :func:`apply_stream_offload` and :class:`StreamHandle` (host copies, device
  buffers, copies, lifecycle; parameter identity through device twins); ``hooks``: when blocks
  are loaded and released (forward, saved tensors, backward order, gradients to the host);
  ``state``: the runtime records.
* ``host``: page-locked host memory (:class:`HostRegion`, :func:`host_copy`), also used by
  ``offload=optimizer``.
* here: the config (``offload.*``) and the plugin.

One offload option per run: ``offload=stream`` therefore also does ``offload=park``'s work on the
frozen modules (``offload.park``, default true, with park's own keys ``cache_latents``,
``cache_text``, ``cache_dir``, ``encode_batch_size``), and with ``offload.activations=true`` /
``offload.optimizer=true`` (+ ``offload.step_on_host``) the work of ``offload=activations`` and
``offload=optimizer``, through those plugins' twin functions. Combined with the optimizer offload,
gradients stay on the device until the step (``offload_gradients`` off), so the runner's clipping
sees every gradient: the streamed blocks' on the host, the resident ones' on the device.

Planner (``ctx.simulate``): the same code runs synchronously on fake tensors (device ``meta``,
host fake ``cpu``), so the planned device bytes contain exactly the resident weights and the
window, and the streamed bytes are reported as pinned host memory (``ctx.state
["pinned_host_bytes"]``); a weight read in backward after its release would be a fake-tensor
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from runner.errors import UserError, valid_list
from runner.plugin import Plugin, PluginConfig
from runner.plugins.stream.handle import StreamHandle, apply_stream_offload
from runner.plugins.stream.host import GiB, HostRegion, _nbytes, fmt_bytes, host_copy
from runner.plugins.stream.plan import BlockPlan, StreamPlan, guess_execution_order, minimum_device_bytes, plan_stream
from runner.plugins.stream.state import StreamStats
from runner.registry import register_plugin

if TYPE_CHECKING:
    from runner.context import RunContext

__all__ = [
    "BlockPlan", "GiB", "HostRegion", "StreamConfig", "StreamHandle", "StreamOffload", "StreamPlan", "StreamStats",
    "apply_stream_offload", "check_config", "fmt_bytes", "guess_execution_order", "host_copy",
    "minimum_device_bytes", "plan_stream",
]

log = logging.getLogger("runner")


# ---- config ----------------------------------------------------------------------------------
@dataclass
class StreamConfig(PluginConfig):
    """``offload=stream``: repeated blocks' weights streamed from pinned host memory to the device."""

    name: str = "stream"
    device_budget_gb: Optional[float] = None  # GiB of the streamed modules' weights on the device; null: device_fraction
    device_fraction: float = 0.5  # used when device_budget_gb is null: this share of the modules' weight bytes
    prefetch: int = 1  # blocks copied ahead of the one computing (window = prefetch + 1 blocks)
    modules: list[str] = field(default_factory=list)  # modules to stream; empty = the trained ones
    pin_memory: bool = True  # page-lock host copies (CUDA only) so copies run asynchronously
    activations: bool = False  # also offload saved activations to the host (offload=activations)
    optimizer: bool = False  # also keep the remaining optimizer state on the host (offload=optimizer)
    step_on_host: bool = True  # with optimizer=true: run that optimizer step on the host too
    park: bool = True  # also offload=park's work: frozen modules on the host, their outputs cached
    cache_latents: bool = True  # with park: as offload.cache_latents of offload=park
    cache_text: bool = True  # with park: as offload.cache_text of offload=park
    cache_dir: Optional[str] = None  # with park: as offload.cache_dir of offload=park
    encode_batch_size: Optional[int] = None  # with park: as offload.encode_batch_size of offload=park


# ---- the plugin --------------------------------------------------------------------------------
def check_config(c: Any) -> None:
    if c.device_budget_gb is not None and not c.device_budget_gb > 0:
        raise UserError(f"offload.device_budget_gb={c.device_budget_gb!r} is not valid: give a number of GiB > 0, "
                        "or null to use offload.device_fraction.")
    if c.device_budget_gb is None and not 0 < c.device_fraction <= 1:
        raise UserError(f"offload.device_fraction={c.device_fraction!r} is not valid: give a share of the weight "
                        "bytes in (0, 1] (0.5 keeps half of them on the device), or set offload.device_budget_gb.")
    if not isinstance(c.prefetch, int) or isinstance(c.prefetch, bool) or c.prefetch < 0:
        raise UserError(f"offload.prefetch={c.prefetch!r} is not valid: give a whole number of blocks >= 0 "
                        "(1 copies the next block while one computes).")


@register_plugin
class StreamOffload(Plugin):
    kind = "offload"
    name = "stream"
    Config = StreamConfig
    description = ("repeated blocks' weights in pinned host memory, streamed to the device ahead of use "
                   "within a byte budget (offload.device_budget_gb); +activations/+optimizer offload")

    def _park(self) -> Plugin | None:
        """offload=park's plugin with our settings, when ``offload.park`` (one offload option per run)."""
        c = self.config
        if not c.park:
            return None
        from runner.plugins.park import Park, ParkConfig

        return Park(ParkConfig(cache_latents=bool(c.cache_latents), cache_text=bool(c.cache_text),
                               cache_dir=c.cache_dir, encode_batch_size=c.encode_batch_size,
                               pin_memory=bool(c.pin_memory)))

    def validate(self, cfg: Any) -> None:
        c = self.config
        check_config(c)
        park = self._park()
        if park is not None:
            park.validate(cfg)
        if cfg is None:
            return
        full = str(cfg.model.get("train", "full")) == "full"
        if full and str(cfg.train.get("mixed_precision", "no")) == "fp16":
            raise UserError(
                "offload=stream with model.train=full and train.mixed_precision=fp16: the streamed parameters' "
                "gradients live on the host, where fp16 gradient scaling (GradScaler) does not unscale them. "
                "Use train.mixed_precision=bf16 (or no), or model.train=lora."
            )
        if c.activations:
            from runner.plugins.offload_activations import ActivationOffloadConfig, check_config as check_act

            check_act(ActivationOffloadConfig())
        if c.optimizer:
            from runner.plugins.offload_optimizer import OptimizerOffloadConfig, check_run

            check_run(OptimizerOffloadConfig(step_on_host=c.step_on_host), cfg, "offload.step_on_host")

    def _targets(self, ctx: RunContext) -> list[str]:
        names = list(self.config.modules) or sorted(ctx.models.trained)
        unknown = [n for n in names if n not in ctx.models]
        if unknown:
            raise UserError(f"offload.modules names {', '.join(map(repr, unknown))}, which the trainer does not build. "
                            f"Valid names: {valid_list(unknown[0], ctx.models.modules)}.")
        return names

    def place_models(self, ctx: RunContext) -> None:
        # The trainers' discovery: a U-Net's resnets and attentions, not only its transformer blocks.
        from runner.trainers.common import find_repeated_blocks

        c = self.config
        check_config(c)
        handles: dict[str, StreamHandle] = {}
        names = self._targets(ctx)
        park = self._park()
        if park is not None:
            frozen = [n for n in names if n not in ctx.models.trained]
            if frozen:
                raise UserError(f"offload.modules names {', '.join(map(repr, frozen))}, a frozen module that "
                                "offload.park=true already keeps on the host (visiting the device per call); set "
                                "offload.park=false to stream it instead, or leave it out of offload.modules.")
            park.place_models(ctx)  # first: its encode pre-pass runs while the denoiser is still on the host
            ctx.state.setdefault(self.key, {})["park"] = park
        sizes = {n: sum(_nbytes(p) for p in ctx.models[n].parameters()) + sum(_nbytes(b) for b in ctx.models[n].buffers())
                 for n in names}
        total = sum(sizes.values()) or 1
        for n in names:
            module = ctx.models[n]
            blocks = ctx.models.blocks.get(n) or find_repeated_blocks(module)
            if not blocks:
                raise UserError(f"offload=stream found no repeated blocks in {n} ({type(module).__name__}) to stream; "
                                "give the trainer's ModelSet.blocks or choose offload.modules.")
            if c.device_budget_gb is not None:  # one budget, shared in proportion to weight bytes
                budget = int(c.device_budget_gb * GiB * sizes[n] / total)
            else:
                budget = int(c.device_fraction * sizes[n])
            handle = apply_stream_offload(module, blocks, budget, int(c.prefetch), ctx.device, ctx.host,
                                          pin_memory=bool(c.pin_memory), name=n, clear_cast_cache=_cast_cache_clearer(ctx))
            module._runner_placed = True
            handles[n] = handle
            log.info("stream: %s", handle.plan.describe())
        ctx.state.setdefault(self.key, {})["handles"] = handles
        host = sum(h.host_bytes() for h in handles.values())
        _note_pinned(ctx, host if c.pin_memory else 0)  # pinned on the target GPU (the planner's contract)
        ctx.notes["stream: weight bytes on the host"] = host
        ctx.notes["stream: planned device weight bytes"] = sum(h.plan.device_weight_bytes for h in handles.values())
        ctx.notes["stream: planned window bytes"] = sum(h.plan.window_bytes for h in handles.values())

    def wrap_execution(self, ctx: RunContext) -> None:
        if self.config.activations:
            from runner.plugins.offload_activations import ActivationOffloadConfig, install

            install(ctx, ActivationOffloadConfig(), self.key)

    def wrap_optimizer(self, ctx: RunContext) -> None:
        if self.config.optimizer:
            from runner.plugins.offload_optimizer import OptimizerOffloadConfig, wrap

            wrap(ctx, OptimizerOffloadConfig(step_on_host=bool(self.config.step_on_host)), self.key)

    def on_oom(self, ctx: RunContext, step: int, error: BaseException) -> None:
        state = ctx.state.get(self.key, {})
        for h in state.get("handles", {}).values():
            h.reset()
        if state.get("activations") is not None:
            state["activations"].reset()
        if hasattr(state.get("optimizer"), "discard_gradients"):
            state["optimizer"].discard_gradients()

    def teardown(self, ctx: RunContext) -> None:
        state = ctx.state.pop(self.key, {})
        for undo in reversed(state.get("undo", [])):
            undo()
        if state.get("activations") is not None:
            from runner.plugins.offload_activations import report as report_activations

            report_activations(ctx, state["activations"], True)
        if state.get("optimizer") is not None:
            from runner.plugins.offload_optimizer import report as report_optimizer

            report_optimizer(ctx, state["optimizer"], True)
        handles = state.get("handles", {})
        if handles:
            ctx.notes["stream: peak streamed bytes on the device"] = sum(h.stats.peak_device_bytes for h in handles.values())
            ctx.notes["stream: host-to-device bytes"] = sum(h.stats.h2d_bytes for h in handles.values())
        for h in handles.values():
            h.remove()
        if state.get("park") is not None:
            state["park"].teardown(ctx)


def _note_pinned(ctx: RunContext, nbytes: int) -> None:
    try:
        from runner.plan import note_pinned_bytes
    except ImportError:  # pragma: no cover - the planner is part of the runner
        ctx.state["pinned_host_bytes"] = int(ctx.state.get("pinned_host_bytes", 0) or 0) + int(nbytes)
        return
    note_pinned_bytes(ctx, nbytes)


def _cast_cache_clearer(ctx: RunContext) -> Callable[[], None]:
    """Clears torch's autocast weight-cast cache, and in simulation the planner's own copy of it
    (``DeviceSemantics.cache``: ``meta`` has no torch autocast, so the planner keeps the cache)."""
    def clear() -> None:
        torch.clear_autocast_cache()
        cache = getattr(getattr(ctx.accelerator, "semantics", None), "cache", None)
        if ctx.simulate and isinstance(cache, dict):
            cache.clear()

    return clear
