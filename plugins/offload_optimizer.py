"""Optimizer state on the host (``offload=optimizer``), and optionally the step too.

Adam keeps two moments per parameter: 8 bytes per float32 parameter, twice the weights. This
plugin wraps whatever optimizer the runner built (``wrap_optimizer`` phase; ``ctx.optimizer`` is
replaced by the wrapper, which the LR scheduler, accelerate and checkpoints then use like any
``torch.optim.Optimizer``; its ``state_dict`` has the inner optimizer's format, so a checkpoint
resumes with or without offload).

``offload.step_on_host=true`` (default): ZeRO-offload style. Each trained parameter gets a host
master copy (page-locked); at ``step()`` the device gradients are copied to the host, the
optimizer steps the masters on the CPU (its state is created there and never touches the
device), and the masters are copied back into the device parameters. Device memory: weights
and gradients only. Cost: two PCIe transfers of the trained weights per step plus a CPU step.
``offload.offload_gradients=true`` additionally moves each gradient to the host as soon as
backward has accumulated it (post-accumulate-grad hook), so device gradients never pile up;
gradient accumulation then happens on the host and clipping inside the wrapper (with
``train.max_grad_norm``), because the runner's own clipping sees no device gradients.

``offload.step_on_host=false``: the state lives on the host between steps and the step runs on
the device, ``offload.chunk_mb`` of parameters at a time: their state is copied in, stepped and
copied back, so the device holds one chunk's state. Gradients, clipping, fp16 scaling and
accumulation are untouched. Cost: the state crosses PCIe twice per step.

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

import inspect
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from runner.compat import is_fake
from runner.errors import UserError, valid_list
from runner.plugin import Plugin, PluginConfig
from runner.plugins.stream.host import HostRegion, _nbytes, host_copy
from runner.registry import register_plugin

if TYPE_CHECKING:
    from runner.context import RunContext

log = logging.getLogger("runner")

IMPLEMENTATIONS = ("auto", "torchao", "builtin")


@dataclass
class OptimizerOffloadConfig(PluginConfig):
    """``offload=optimizer``: optimizer state in host memory; the step on the host (default) or the device."""

    name: str = "optimizer"
    step_on_host: bool = True  # false: state on the host, step on the device chunk by chunk
    offload_gradients: bool = False  # step_on_host: move gradients to the host during backward
    implementation: str = "auto"  # auto (torchao when importable and correct, else builtin) | torchao | builtin
    chunk_mb: float = 512.0  # step_on_host=false: parameters (MiB) whose state is on the device at once
    pin_memory: bool = True


def _torchao_class() -> type | None:
    """torchao's CPUOffloadOptimizer (``torchao.optim``; older releases: ``torchao.prototype.low_bit_optim``)."""
    for module in ("torchao.optim", "torchao.prototype.low_bit_optim"):
        try:
            return getattr(__import__(module, fromlist=["CPUOffloadOptimizer"]), "CPUOffloadOptimizer")
        except Exception:  # not installed, or an incompatible build
            continue
    return None


def torchao_available() -> bool:
    return _torchao_class() is not None


def torchao_blockers(config: Any, max_grad_norm: float, grad_accum: int, device_type: str) -> list[str]:
    """Why torchao's CPUOffloadOptimizer cannot run this configuration correctly (empty: it can)."""
    why = []
    if device_type != "cuda":
        why.append("it needs a CUDA device")
    if not config.step_on_host:
        why.append("it always steps on the host (offload.step_on_host=false)")
    if max_grad_norm > 0:
        why.append(f"it cannot clip gradients (train.max_grad_norm={max_grad_norm})")
    if config.offload_gradients and grad_accum > 1:
        why.append(f"with offload.offload_gradients it cannot accumulate gradients (train.grad_accum={grad_accum})")
    if not torchao_available():
        why.append("torchao is not installed")
    return why


def check_config(c: Any) -> None:
    if c.implementation not in IMPLEMENTATIONS:
        raise UserError(f"offload.implementation={c.implementation!r} is not valid. "
                        f"Valid values: {valid_list(str(c.implementation), IMPLEMENTATIONS)}.")
    if not c.chunk_mb > 0:
        raise UserError(f"offload.chunk_mb={c.chunk_mb!r} is not valid: give the MiB of parameters stepped at once, > 0.")


def check_run(c: Any, cfg: Any, key: str = "offload.step_on_host") -> None:
    """Checks against the whole run config (also used by offload=stream's combined option)."""
    check_config(c)
    if cfg is None:
        return
    if c.step_on_host and str(cfg.train.get("mixed_precision", "no")) == "fp16":
        raise UserError(
            f"offload=optimizer with {key}=true and train.mixed_precision=fp16: fp16 gradient scaling unscales "
            "gradients before they reach the host step. Use train.mixed_precision=bf16 (or no), or "
            f"{key}=false (state on the host, step on the device)."
        )
    if c.implementation == "torchao":
        device = str(cfg.train.get("device", "auto"))
        device_type = "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"
        why = torchao_blockers(c, float(cfg.train.max_grad_norm), int(cfg.train.grad_accum), device_type)
        if why:
            raise UserError(f"offload.implementation=torchao cannot run here: {'; '.join(why)}. "
                            "Use offload.implementation=auto or builtin (ours handles clipping and accumulation).")


def _constructor_kwargs(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's defaults its constructor accepts (torch's AdamW keeps a
    ``decoupled_weight_decay`` default it does not take as an argument)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def _same_optimizer_over(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` (same class, settings, hooks) over other parameter groups, with no state.

    A shallow copy rather than ``type(optimizer)(groups, **defaults)``: constructors differ
    (torch's AdamW keeps a default it does not accept as an argument; bitsandbytes' 8-bit
    optimizers keep settings outside ``defaults``; the planner's simulated optimizer takes its
    config object), while every optimizer reads its groups and state from these two attributes.
    """
    inner = object.__new__(type(optimizer))  # not copy.copy: Optimizer.__getstate__ keeps only 3 attributes
    inner.__dict__.update(optimizer.__dict__)
    inner.param_groups = groups
    inner.state = defaultdict(dict)
    return inner


def _sync(events: list[Any]) -> None:
    for e in events:
        e.synchronize()
    events.clear()


class _ForwardsToInner(torch.optim.Optimizer):
    """An optimizer wrapper whose groups, state and defaults are the inner optimizer's own.

    Schedulers, accelerate and checkpointing read and write these attributes; forwarding them keeps
    one source of truth instead of copies that drift after a load_state_dict.
    """

    inner: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value


class HostStepOptimizer(_ForwardsToInner):
    """``step_on_host=true``, built-in: host masters, host state, host step, copy back.

    Not constructed through ``Optimizer.__init__``: like torchao's wrapper it owns an inner
    optimizer (over the host masters) and forwards ``param_groups``/``state`` to it, so the LR
    scheduler's changes reach the inner step. Parameters that already live on the host (weights
    streamed by ``offload=stream``) are their own masters: no copy, their gradients are there.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, host: torch.device | str = "cpu",
                 offload_gradients: bool = False, max_grad_norm: float = 0.0, pin_memory: bool = True,
                 always_copy: bool = False) -> None:
        self.host = torch.device(host)
        self.max_grad_norm = float(max_grad_norm)
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (device parameter, host master)
        self.regions: list[HostRegion] = []
        self._grad_buffers: dict[int, torch.Tensor] = {}
        self._staging: dict[int, torch.Tensor] = {}
        self._pending: list[Any] = []  # copy events to wait for before the host reads gradients
        self._adds: list[tuple[nn.Parameter, torch.Tensor]] = []  # (master, staged gradient) to add after them
        self._hooks: list[Any] = []
        copied = [p.device != self.host or always_copy for g in optimizer.param_groups for p in g["params"]]
        if offload_gradients and any(copied) and not all(copied):
            # The runner's clipping would see the host parameters' gradients and not the others.
            raise ValueError("offload_gradients needs every trained parameter on the device; some are on the host "
                             "already (offload=stream keeps them there: its combined option does not offload gradients)")
        groups = []
        for g in optimizer.param_groups:
            hg = {k: v for k, v in g.items() if k != "params"}
            hg["params"] = []
            for p in g["params"]:
                if p.device == self.host and not always_copy:
                    master = p
                else:
                    data, region = host_copy(p, pin_memory)
                    if region is not None:
                        self.regions.append(region)
                    master = nn.Parameter(data, requires_grad=p.requires_grad)
                hg["params"].append(master)
                self.pairs.append((p, master))
            groups.append(hg)
        self.inner = _same_optimizer_over(optimizer, groups)
        if optimizer.state:  # it already stepped (hosted mode): carry its state over, onto the host
            self.inner.load_state_dict(optimizer.state_dict())
        # On a CPU run every parameter is its own master: there is nothing to offload (or to clip twice).
        self.offload_gradients = offload_gradients and all(copied)
        self.device = next((p.device for p, m in self.pairs if p is not m), self.host)
        self.pin = pin_memory and self.device.type == "cuda"
        self._api = torch.get_device_module(self.device) if self.device.type not in ("cpu", "meta") and not any(
            is_fake(p) for p, _ in self.pairs) else None
        self._d2h = self._api.Stream(device=self.device) if self._api is not None else None
        if self.offload_gradients:
            for p, m in self.pairs:
                if p is not m and p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(m)))
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("offload=optimizer: add parameter groups before the optimizer is wrapped")

    # -- gradients to the host --------------------------------------------------------------
    def _buffer(self, store: dict[int, torch.Tensor], master: nn.Parameter) -> torch.Tensor:
        buf = store.get(id(master))
        if buf is None:
            if self.pin:
                region = HostRegion(_nbytes(master), pin=True)
                self.regions.append(region)
                buf = region.view(0, master)
            else:
                buf = torch.empty_like(master, device=self.host)
            store[id(master)] = buf
        return buf

    def _copy_to_host(self, g: torch.Tensor, buf: torch.Tensor) -> None:
        if self._api is None:
            buf.copy_(g)
            return
        current = self._api.current_stream(self.device)
        with self._api.stream(self._d2h):
            self._d2h.wait_stream(current)
            buf.copy_(g, non_blocking=True)
            g.record_stream(self._d2h)
            self._pending.append(self._d2h.record_event())

    def _receive(self, master: nn.Parameter, g: torch.Tensor) -> None:
        """Add gradient ``g`` (device) into ``master.grad`` (host), like AccumulateGrad would."""
        if master.grad is None:
            buf = self._buffer(self._grad_buffers, master)
            self._copy_to_host(g, buf)
            master.grad = buf
        else:
            staged = self._buffer(self._staging, master)
            self._copy_to_host(g, staged)
            self._adds.append((master, staged))

    def _make_hook(self, master: nn.Parameter) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                self._receive(master, p.grad)
                p.grad = None

        return hook

    def _gather(self) -> None:
        if not self.offload_gradients:
            for p, m in self.pairs:
                if p is not m:
                    if p.grad is None:
                        m.grad = None
                    else:
                        m.grad = None
                        self._receive(m, p.grad)
        _sync(self._pending)
        for m, staged in self._adds:
            m.grad.add_(staged)
        self._adds.clear()

    @torch.no_grad()
    def _scatter(self) -> None:
        non_blocking = self._api is not None
        for p, m in self.pairs:
            if p is not m:
                p.copy_(m, non_blocking=non_blocking)

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._gather()
        if self.offload_gradients and self.max_grad_norm > 0:  # the runner's clipping saw no device gradients
            masters = [m for _, m in self.pairs if m.grad is not None]
            torch.nn.utils.clip_grad_norm_(masters, self.max_grad_norm)
        self.inner.step()
        self._scatter()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        _sync(self._pending)
        self._adds.clear()
        for p, m in self.pairs:
            for t in ((p, m) if p is not m else (m,)):
                if t.grad is not None:
                    if set_to_none:
                        t.grad = None
                    else:
                        t.grad.zero_()

    def discard_gradients(self) -> None:
        """After an OOM: drop partial host gradients (the runner drops the device ones)."""
        self.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        _sync(self._pending)
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)  # torch places state on each master's device: the host

    def host_bytes(self) -> int:
        """Host bytes of masters and gradient buffers this wrapper keeps (page-locked on CUDA)."""
        n = sum(_nbytes(m) for p, m in self.pairs if p is not m)
        return 2 * n

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for r in self.regions:
            r.close()

    def __repr__(self) -> str:
        return f"HostStepOptimizer({type(self.inner).__name__}, {len(self.pairs)} parameters)"


class HostStateOptimizer(_ForwardsToInner):
    """``step_on_host=false``: state on the host between steps, stepped on the device in chunks.

    The inner optimizer is the original one over the device parameters; each chunk's state is
    copied in, the inner step runs with its parameter groups narrowed to the chunk, and the state
    goes back to persistent host buffers. Per-parameter optimizers (AdamW, SGD, bitsandbytes'
    8-bit ones) give the same result as one whole step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, host: torch.device | str = "cpu",
                 chunk_bytes: int = 512 * 2**20, pin_memory: bool = True, always_copy: bool = False) -> None:
        self.inner = optimizer
        self.host = torch.device(host)
        self.chunk_bytes = int(chunk_bytes)
        self.pin = pin_memory and torch.cuda.is_available()
        self.always_copy = always_copy
        self.regions: list[HostRegion] = []
        self._host_state: dict[tuple[int, str], torch.Tensor] = {}
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.inner.add_param_group(param_group)

    @staticmethod
    def _moves(key: str, v: Any) -> bool:
        return isinstance(v, torch.Tensor) and v.dim() > 0  # 0-dim "step" counters stay where torch keeps them

    def _to_device(self, p: nn.Parameter) -> None:
        st = self.inner.state.get(p)
        if not st:
            return
        for k, v in st.items():
            if self._moves(k, v) and (v.device != p.device or self.always_copy):
                st[k] = v.to(p.device, non_blocking=self.pin, copy=True)

    def _to_host(self, p: nn.Parameter) -> None:
        st = self.inner.state.get(p)
        if not st:
            return
        for k, v in st.items():
            if not self._moves(k, v) or (v.device == self.host and not self.always_copy):
                continue
            buf = self._host_state.get((id(p), k))
            if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                if self.pin and not is_fake(v):
                    region = HostRegion(_nbytes(v), pin=True)
                    self.regions.append(region)
                    buf = region.view(0, v)
                else:
                    buf = torch.empty_like(v, device=self.host)
                self._host_state[(id(p), k)] = buf
            buf.copy_(v, non_blocking=self.pin)
            st[k] = buf

    def _chunks(self) -> list[list[nn.Parameter]]:
        chunks: list[list[nn.Parameter]] = [[]]
        size = 0
        for g in self.inner.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if chunks[-1] and size + _nbytes(p) > self.chunk_bytes:
                    chunks.append([])
                    size = 0
                chunks[-1].append(p)
                size += _nbytes(p)
        return [c for c in chunks if c]

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.inner.param_groups
        saved = [g["params"] for g in groups]
        try:
            for chunk in self._chunks():
                ids = {id(p) for p in chunk}
                for p in chunk:
                    self._to_device(p)
                for g, params in zip(groups, saved):
                    g["params"] = [p for p in params if id(p) in ids]
                self.inner.step()
                for p in chunk:
                    self._to_host(p)
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params
        if self.pin:
            torch.cuda.current_stream().synchronize()  # host buffers complete before anyone reads them
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def discard_gradients(self) -> None:
        """Nothing of a partial step lives outside the device gradients."""

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)  # torch puts state on the device: move it out again
        for g in self.inner.param_groups:
            for p in g["params"]:
                self._to_host(p)

    def host_bytes(self) -> int:
        """Host bytes of the state buffers (page-locked on CUDA); known after the first step."""
        return sum(_nbytes(t) for t in self._host_state.values())

    def remove(self) -> None:
        for r in self.regions:
            r.close()

    def __repr__(self) -> str:
        return f"HostStateOptimizer({type(self.inner).__name__}, chunks of {self.chunk_bytes / 2**20:.0f} MiB)"


def _torchao_optimizer(optimizer: torch.optim.Optimizer, offload_gradients: bool) -> torch.optim.Optimizer:
    """torchao's CPUOffloadOptimizer over the same parameter groups (CUDA; see module docstring)."""
    cls = _torchao_class()
    # Kernel choices are torchao's to make: it steps AdamW with the fused CPU kernel unless told otherwise
    # (the runner's foreach=False is a device-memory choice that does not apply on the host).
    kernel = ("fused", "foreach", "capturable", "differentiable")
    groups = [{**{k: v for k, v in g.items() if k != "params" and k not in kernel}, "params": list(g["params"])}
              for g in optimizer.param_groups]
    kwargs = {k: v for k, v in _constructor_kwargs(type(optimizer), optimizer.defaults).items() if k not in kernel}
    return cls(groups, optimizer_class=type(optimizer), offload_gradients=offload_gradients, **kwargs)


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
        why = torchao_blockers(cfg, max_grad_norm, grad_accum, device_type)
        if not why:
            log.info("offload=optimizer: using torchao's CPUOffloadOptimizer")
            return _torchao_optimizer(optimizer, offload_gradients)
        if implementation == "torchao":
            raise UserError(f"offload.implementation=torchao cannot run here: {'; '.join(why)}.")
        if device_type == "cuda":
            log.info("offload=optimizer: built-in host offload (torchao not used: %s)", "; ".join(why))
    if step_on_host:
        return HostStepOptimizer(optimizer, host=host, offload_gradients=offload_gradients,
                                 max_grad_norm=max_grad_norm, pin_memory=pin_memory, always_copy=always_copy)
    return HostStateOptimizer(optimizer, host=host, chunk_bytes=chunk_bytes, pin_memory=pin_memory, always_copy=always_copy)


def wrap(ctx: RunContext, config: Any, key: str) -> torch.optim.Optimizer:
    """Replace ``ctx.optimizer`` by its host-offloaded wrapper (this plugin and offload=stream)."""
    check_config(config)
    cfg = ctx.cfg
    max_norm = float(cfg.train.max_grad_norm) if cfg is not None else 0.0
    accum = int(cfg.train.grad_accum) if cfg is not None else 1
    wrapped = offload_optimizer(
        ctx.optimizer, step_on_host=bool(config.step_on_host), offload_gradients=bool(config.offload_gradients),
        max_grad_norm=max_norm, grad_accum=accum, implementation=str(config.implementation),
        chunk_bytes=int(float(config.chunk_mb) * 2**20), host=ctx.host, pin_memory=bool(config.pin_memory),
    )
    ctx.optimizer = wrapped
    state = ctx.state.setdefault(key, {})
    state["optimizer"] = wrapped
    if hasattr(wrapped, "remove"):
        state.setdefault("undo", []).append(wrapped.remove)
    ctx.notes["optimizer"] = repr(wrapped) if not type(wrapped).__name__.startswith("CPUOffload") else "torchao CPUOffloadOptimizer"
    return wrapped


@register_plugin
class OptimizerOffload(Plugin):
    kind = "offload"
    name = "optimizer"
    Config = OptimizerOffloadConfig
    description = ("optimizer state in host memory; the step on the host (step_on_host=true, ZeRO-offload style) "
                   "or on the device chunk by chunk")

    def validate(self, cfg: Any) -> None:
        check_run(self.config, cfg)

    def wrap_optimizer(self, ctx: RunContext) -> None:
        wrap(ctx, self.config, self.key)

    def on_oom(self, ctx: RunContext, step: int, error: BaseException) -> None:
        opt = ctx.state.get(self.key, {}).get("optimizer")
        if hasattr(opt, "discard_gradients"):
            opt.discard_gradients()

    def teardown(self, ctx: RunContext) -> None:
        state = ctx.state.pop(self.key, {})
        for undo in reversed(state.get("undo", [])):
            undo()
        report(ctx, state.get("optimizer"), bool(self.config.pin_memory))


def report(ctx: RunContext, optimizer: Any, pinned: bool) -> None:
    """Notes for the run report, and the pinned host bytes the planner reports (its contract).

    Reported at teardown because ``step_on_host=false`` knows its state's size only after a step.
    """
    host_bytes = getattr(optimizer, "host_bytes", None)
    if host_bytes is None:
        return
    n = int(host_bytes())
    ctx.notes["optimizer offload: host bytes"] = n
    if pinned:
        from runner.plan import note_pinned_bytes

        note_pinned_bytes(ctx, n)

