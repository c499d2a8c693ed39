"""The optimizer wrappers behind ``offload=optimizer``: optimizer state in host memory.

Each wrapper owns the optimizer the runner built and forwards ``param_groups``, ``state`` and
``defaults`` to it, so the LR scheduler, accelerate and checkpoints use it like any
``torch.optim.Optimizer``, and its ``state_dict`` has the inner optimizer's format (a checkpoint
resumes with or without offload). Which wrapper runs, and when torchao's is used instead, is the
plugin's choice: see :mod:`runner.plugins.offload_optimizer`.

:class:`HostStepOptimizer` (``step_on_host=true``): ZeRO-offload style. Each trained parameter gets
a host master copy (page-locked); at ``step()`` the device gradients are copied to the host, the
optimizer steps the masters on the CPU (its state is created there and never touches the
device), and the masters are copied back into the device parameters. Device memory: weights
and gradients only. Cost: two PCIe transfers of the trained weights per step plus a CPU step.
With ``offload_gradients`` each gradient moves to the host as soon as backward has accumulated
it (post-accumulate-grad hook), so device gradients never pile up; gradient accumulation then
happens on the host and clipping inside the wrapper, because the runner's own clipping sees no
device gradients.

:class:`HostStateOptimizer` (``step_on_host=false``): the state lives on the host between steps
and the step runs on the device, ``chunk_bytes`` of parameters at a time: their state is copied
in, stepped and copied back, so the device holds one chunk's state. Gradients, clipping, fp16
scaling and accumulation are untouched. Cost: the state crosses PCIe twice per step.

torchao (CUDA): :func:`_torchao_optimizer` builds ``torchao.optim.CPUOffloadOptimizer`` over the
same parameter groups; it overlaps the gradient copies with backward on a side stream and steps
on the CPU, but cannot clip gradients nor, with ``offload_gradients``, accumulate them.
"""
from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any, Callable

import torch
from torch import nn

from runner.side_streams import cuda_like, is_simulated_cuda, record_stream, stream_api
from runner.compat import is_fake
from runner.optim.build import ForwardsToInner
from runner.plugins.host_buffers import HostRegion, host_copy, tensor_bytes


def _torchao_class() -> type | None:
    """torchao's CPUOffloadOptimizer (``torchao.optim``; older releases: ``torchao.prototype.low_bit_optim``)."""
    for module in ("torchao.optim", "torchao.prototype.low_bit_optim"):
        try:
            return getattr(__import__(module, fromlist=["CPUOffloadOptimizer"]), "CPUOffloadOptimizer")
        except Exception:  # not installed, or an incompatible build
            continue
    return None


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


class HostStepOptimizer(ForwardsToInner):
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
        self.pin = pin_memory and cuda_like(self.device)
        # The GPU's streams, or the simulated card's (train.device=cuda_sim); none on the CPU or in the planner.
        self._api = None if any(is_fake(p) for p, _ in self.pairs) else stream_api(self.device, is_simulated_cuda(self.device))
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
                region = HostRegion(tensor_bytes(master), pin=True)
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
            record_stream(g, self._d2h)
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

    def weights_changed(self) -> None:
        """The inner optimizer moved the host masters (schedule-free's train/eval): the device follows."""
        self._scatter()
        if self._api is not None:
            self._api.current_stream(self.device).synchronize()  # the masters may change again right after

    @torch.no_grad()
    def weights_loaded(self) -> None:
        """A resume copied the checkpoint's weights into the device parameters: the masters take them,
        or the next host step would update the weights the wrapper was built with."""
        for p, m in self.pairs:
            if p is not m:
                m.copy_(p)

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
        n = sum(tensor_bytes(m) for p, m in self.pairs if p is not m)
        return 2 * n

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for r in self.regions:
            r.close()

    def __repr__(self) -> str:
        return f"HostStepOptimizer({type(self.inner).__name__}, {len(self.pairs)} parameters)"


class HostStateOptimizer(ForwardsToInner):
    """``step_on_host=false``: state on the host between steps, stepped on the device in chunks.

    The inner optimizer is the original one over the device parameters; each chunk's state is
    copied in, the inner step runs with its parameter groups narrowed to the chunk, and the state
    goes back to persistent host buffers. Per-parameter optimizers (AdamW, SGD, bitsandbytes'
    8-bit ones) give the same result as one whole step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, host: torch.device | str = "cpu",
                 chunk_bytes: int = 512 * 2**20, pin_memory: bool = True, always_copy: bool = False) -> None:
        couples = getattr(optimizer, "couples_parameters", None)
        if couples:  # validation refuses this before anything is built (runner/optim/build.py)
            raise ValueError(f"step_on_host=false steps the optimizer a chunk at a time, and {couples}")
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
                    region = HostRegion(tensor_bytes(v), pin=True)
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
                if chunks[-1] and size + tensor_bytes(p) > self.chunk_bytes:
                    chunks.append([])
                    size = 0
                chunks[-1].append(p)
                size += tensor_bytes(p)
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
        return sum(tensor_bytes(t) for t in self._host_state.values())

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
