"""Optimizer state on the host (``offload=optimizer``), and optionally the step too.

Adam keeps two moments per parameter: 8 bytes per float32 parameter, twice the weights. This
plugin wraps whatever optimizer the runner built (``wrap_optimizer`` phase; ``ctx.optimizer`` is
replaced by the wrapper, which the LR scheduler, accelerate and checkpoints then use like any
``torch.optim.Optimizer``; its ``state_dict`` has the inner optimizer's format, so a checkpoint
resumes with or without offload). The wrappers themselves live in
:mod:`runner.plugins.optimizer_wrappers`; this module holds the config, its checks, the choice
of wrapper (the twin :func:`offload_optimizer`) and the plugin.

``offload.optimizer.step_on_host=true`` (default): ZeRO-offload style. Host master copies of the trained
parameters, host state, the step on the CPU, the masters copied back. Device memory: weights
and gradients only. Cost: two PCIe transfers of the trained weights per step plus a CPU step.
``offload.optimizer.offload_gradients=true`` additionally moves each gradient to the host as soon as
backward has accumulated it, so device gradients never pile up; gradient accumulation then
happens on the host and clipping inside the wrapper (with ``train.max_grad_norm``), because the
runner's own clipping sees no device gradients.

``offload.optimizer.step_on_host=false``: the state lives on the host between steps and the step runs on
the device, ``offload.optimizer.chunk_mb`` of parameters at a time, so the device holds one chunk's state.
Gradients, clipping, fp16 scaling and accumulation are untouched. Cost: the state crosses PCIe
twice per step.

torchao: on CUDA, ``implementation=auto`` prefers ``torchao.optim.CPUOffloadOptimizer`` (it
overlaps the gradient copies with backward on a side stream and steps on the CPU), *when it is
importable and correct for the run*: torchao cannot clip gradients (its host step runs on
gradients copied during backward, before the runner clips), and with ``offload_gradients`` it
cannot accumulate them. So it is used only with ``train.max_grad_norm=0`` and, for
``offload_gradients``, ``train.grad_accum=1``; otherwise our built-in wrapper runs, which
handles both. torchao is not installed in this project's CPU environment, so that path is
written behind the import and not exercised by the tests (the GPU bench reports which one ran).

fp16 mixed precision with ``step_on_host`` is refused: the GradScaler unscales the gradients it
finds in the optimizer's parameter groups (the host masters), which are filled only at
``step()``, after unscaling would have happened. bf16 needs no scaler.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from runner.context import Transfer
from runner.errors import UserError
from runner.plugin import Plugin
from runner.plugins.host_buffers import tensor_bytes
from runner.plugins.optimizer_wrappers import (
    HostStateOptimizer,
    HostStepOptimizer,
    _torchao_class,
    _torchao_optimizer,
)
from runner.plugins.schemas import OPTIMIZER_OFFLOAD_IMPLEMENTATIONS as IMPLEMENTATIONS  # noqa: F401
from runner.plugins.schemas import OptimizerOffloadConfig, check_optimizer_offload
from runner.registry import register_plugin

if TYPE_CHECKING:
    from runner.context import RunContext

log = logging.getLogger("runner")



def torchao_available() -> bool:
    return _torchao_class() is not None


def torchao_blockers(config: Any, max_grad_norm: float, grad_accum: int, device_type: str,
                     couples: str | None = None) -> list[str]:
    """Why torchao's CPUOffloadOptimizer cannot run this configuration correctly (empty: it can).
    ``couples``: why the optimizer's update is not per parameter (torchao builds one optimizer per parameter)."""
    why = []
    if couples:
        why.append(f"it builds one optimizer per parameter, and {couples}")
    if device_type != "cuda":
        why.append("it needs a CUDA device")
    if not config.step_on_host:
        why.append("it always steps on the host (offload.optimizer.step_on_host=false)")
    if max_grad_norm > 0:
        why.append(f"it cannot clip gradients (train.max_grad_norm={max_grad_norm})")
    if config.offload_gradients and grad_accum > 1:
        why.append(f"with offload.offload_gradients it cannot accumulate gradients (train.grad_accum={grad_accum})")
    if not torchao_available():
        why.append("torchao is not installed")
    return why


def check_config(c: Any, run: Any = None, key: str = "offload.optimizer") -> None:
    """This plugin's settings (runner/plugins/schemas.py), and against the resolved ``run`` when given."""
    check_optimizer_offload(c, key)
    if run is not None:
        check_against_run(c, run, key)


def check_against_run(c: Any, run: Any, key: str = "offload.optimizer") -> None:
    """The settings against the resolved ``run`` (its node's own checks are runner/plugins/schemas.py's)."""
    if c.step_on_host and run.precision == "fp16":
        raise UserError(
            f"offload=optimizer with {key}.step_on_host=true and train.mixed_precision=fp16: fp16 gradient scaling "
            "unscales gradients before they reach the host step. Use train.mixed_precision=bf16 (or no), or "
            f"{key}.step_on_host=false (state on the host, step on the device)."
        )
    if c.implementation == "torchao":
        why = torchao_blockers(c, run.max_grad_norm, run.grad_accum, run.target)
        if why:
            raise UserError(f"{key}.implementation=torchao cannot run here: {'; '.join(why)}. "
                            f"Use {key}.implementation=auto or builtin (ours handles clipping and accumulation).")


def offload_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    step_on_host: bool = True,
    offload_gradients: bool = False,
    max_grad_norm: float = 0.0,
    grad_accum: int = 1,
    implementation: str = "auto",
    chunk_bytes: int = 512 * 2**20,
    host: torch.device | str = "cpu",
    pin_memory: bool = True,
    always_copy: bool = False,
) -> torch.optim.Optimizer:
    """The twin: wrap ``optimizer`` so that its state lives on ``host``.

    ``max_grad_norm`` is only used with ``offload_gradients`` (clipping then happens inside the
    wrapper, on the host gradients). Returns torchao's CPUOffloadOptimizer when
    ``implementation`` allows and the run is one it handles correctly, else ours.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device_type = next((p.device.type for p in params if p.device != torch.device(host)), "cpu")
    if implementation != "builtin":
        cfg = OptimizerOffloadConfig(step_on_host=step_on_host, offload_gradients=offload_gradients)
        why = torchao_blockers(cfg, max_grad_norm, grad_accum, device_type, getattr(optimizer, "couples_parameters", None))
        if not why:
            log.info("offload=optimizer: using torchao's CPUOffloadOptimizer")
            return _torchao_optimizer(optimizer, offload_gradients)
        if implementation == "torchao":
            raise UserError(f"offload.optimizer.implementation=torchao cannot run here: {'; '.join(why)}.")
        if device_type == "cuda":
            log.info("offload=optimizer: built-in host offload (torchao not used: %s)", "; ".join(why))
    if step_on_host:
        return HostStepOptimizer(optimizer, host=host, offload_gradients=offload_gradients,
                                 max_grad_norm=max_grad_norm, pin_memory=pin_memory, always_copy=always_copy)
    return HostStateOptimizer(optimizer, host=host, chunk_bytes=chunk_bytes, pin_memory=pin_memory, always_copy=always_copy)


@register_plugin
class OptimizerOffload(Plugin):
    kind = "offload"
    name = "optimizer"
    fit_knob = "optimizer_offload"
    Config = OptimizerOffloadConfig

    def validate(self) -> None:
        check_against_run(self.config, self.run, self.key.replace("/", "."))

    def wrap_optimizer(self, ctx: RunContext) -> None:
        c, run = self.config, self.run
        wrapped = offload_optimizer(
            ctx.optimizer, step_on_host=bool(c.step_on_host), offload_gradients=bool(c.offload_gradients),
            max_grad_norm=run.max_grad_norm, grad_accum=run.grad_accum,
            # several processes: ours, which reads the gradients at step time, after the ranks averaged them
            implementation="builtin" if run.dist.active else str(c.implementation),
            chunk_bytes=int(float(c.chunk_mb) * 2**20), host=ctx.host, pin_memory=bool(c.pin_memory),
        )
        ctx.optimizer = self.optimizer = wrapped
        torchao = type(wrapped).__name__.startswith("CPUOffload")
        ctx.notes["optimizer"] = "torchao CPUOffloadOptimizer" if torchao else repr(wrapped)

    def on_step_end(self, ctx: RunContext, step: int) -> None:
        """Record this step's copies and host work for the step-time model (see each wrapper's docstring)."""
        optimizer = getattr(self, "optimizer", None)
        if isinstance(optimizer, HostStepOptimizer):
            moved = [p for p, m in optimizer.pairs if p is not m]
            nbytes = sum(tensor_bytes(p) for p in moved)
            elements = sum(p.numel() for p in moved)
            # Gradients out (during backward, on a side stream, with offload_gradients), weights back after the host step.
            ctx.facts.transfers[self.key] = Transfer(h2d_bytes=nbytes, host_step_elements=elements,
                                                     d2h_bytes=0 if optimizer.offload_gradients else nbytes)
            if optimizer.offload_gradients:
                ctx.facts.transfers[self.key + ":gradients"] = Transfer(d2h_bytes=nbytes, overlapped=self.run.on_cuda)
        elif isinstance(optimizer, HostStateOptimizer):
            state = optimizer.host_bytes()  # the state crosses twice a step, chunk by chunk, on the compute stream
            ctx.facts.transfers[self.key] = Transfer(h2d_bytes=state, d2h_bytes=state)
        elif optimizer is not None:  # torchao: gradients out during backward, weights back after its host step
            params = [p for g in optimizer.param_groups for p in g["params"]]
            nbytes = sum(tensor_bytes(p) for p in params)
            ctx.facts.transfers[self.key] = Transfer(h2d_bytes=nbytes, d2h_bytes=nbytes, overlapped=True,
                                                     host_step_elements=sum(p.numel() for p in params))

    def on_oom(self, ctx: RunContext, step: int, error: BaseException) -> None:
        if hasattr(getattr(self, "optimizer", None), "discard_gradients"):
            self.optimizer.discard_gradients()

    def teardown(self, ctx: RunContext) -> None:
        """Report the host bytes (``step_on_host=false`` knows its state's size only after a
        step), then undo the wrapper's hooks."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None:
            return
        host_bytes = getattr(optimizer, "host_bytes", None)
        if host_bytes is not None:
            n = int(host_bytes())
            ctx.notes["optimizer offload: host bytes"] = n
            if self.config.pin_memory:
                ctx.note_pinned_bytes(n)
        if hasattr(optimizer, "remove"):
            optimizer.remove()
        self.optimizer = None
