"""What each phase of the simulated step computes and moves: FLOPs, bytes, copies, op counts.

The planner's dispatch mode (the live-bytes tracker) sees every aten op of the simulated step,
recompute included; :class:`CostCounter` is called for each one with the op, its fake inputs and
outputs and the innermost planner phase (encode, forward, backward, optimizer, ...). Per phase it
adds up:

* FLOPs of matmuls, convolutions and attention, with ``torch.utils.flop_counter``'s own formulas
  (the table ``FlopCounterMode`` uses; tests/runner/plan/test_step_time.py checks that the counts
  equal ``FlopCounterMode``'s on the same step). Not ``FlopCounterMode`` itself: it would be a
  second Python dispatch mode on each of the step's ~80 k ops, and the planner already has one.
  PyTorch's table lacks the CPU flash-attention kernels (the CPU target's attention); they are
  added below with the same attention formulas;
* bytes read and written by every op that touches data (inputs and outputs, views and
  allocations excluded), which decide the time of memory-bound ops;
* bytes copied host->device and device->host (``_to_copy``/``copy_`` across the simulated host
  and device): streaming, parking, offload, and the batch;
* dispatched ops and data-moving ops (kernels), whose fixed costs dominate small models;
* a roofline time per op for the target (``max(flops / peak, bytes / bandwidth, floor)``, with
  the peak of the op's dtype), summed per phase and per device (the simulated device or host).

The figures feed runner/plan/speed.py. Counting is a few microseconds per op.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import (
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from runner.compat import autograd_node_name
from runner.memory.op_kinds import launches_nothing
from runner.optim.build import SimulatedOptimizer

aten = torch.ops.aten


def _cpu_flash_forward(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None,
                        **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# Formulas PyTorch's table lacks, in FlopCounterMode's custom_mapping form (raw arguments).
EXTRA_FORMULAS: dict[Any, Callable[..., int]] = {}
for _name, _fn in (("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_forward),
                   ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_backward)):
    if hasattr(aten, _name):
        _fn._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode passes tensors, not shapes
        EXTRA_FORMULAS[getattr(aten, _name)] = _fn
FLOP_FORMULAS: dict[Any, Callable[..., int]] = {**flop_registry, **EXTRA_FORMULAS}


def _shapes(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.shape
    if isinstance(x, (list, tuple)):
        return type(x)(_shapes(i) for i in x)
    return x


def _unwrapped(fn: Callable[..., int]) -> tuple[Callable[..., int], bool]:
    """(formula, takes shapes): PyTorch wraps most formulas in a converter of every argument to its
    shape through pytree (~1 ms a call on fake tensors); calling the formula with shapes made
    here gives the same count for a fraction of that."""
    inner = getattr(fn, "__wrapped__", None)
    return (inner, True) if inner is not None and not getattr(fn, "_get_raw", False) else (fn, False)


_FORMULAS = {k: _unwrapped(v) for k, v in FLOP_FORMULAS.items()}


def flop_count(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one op by torch.utils.flop_counter's formula for it (0 when it has none)."""
    entry = _FORMULAS.get(getattr(func, "overloadpacket", None))
    if entry is None:
        return 0
    fn, shapes = entry
    if shapes:
        return int(fn(*_shapes(args), out_shape=_shapes(out), **{k: _shapes(v) for k, v in kwargs.items()}))
    return int(fn(*args, **kwargs, out_val=out))

COPIES = frozenset((aten._to_copy.default, aten.copy_.default))
_SKIP, _COPY, _FLOP, _PLAIN = 0, 1, 2, 3
_PYTHON_NODES = (None, "AccumulateGrad")  # no node: Python outside the engine; AccumulateGrad: a leaf's hooks
LOW_PRECISION = (torch.bfloat16, torch.float16)
CONV_PACKETS = frozenset(p for p in (aten.convolution, aten._convolution, aten.convolution_backward,
                                     aten.cudnn_convolution, aten.convolution_overrideable, aten._slow_conv2d_forward))


@dataclass
class PhaseCost:
    """One phase of the simulated step: what it computes and moves, and its roofline time."""

    ops: int = 0  # dispatched aten ops (each costs host dispatch time)
    engine_ops: int = 0  # of which the autograd engine dispatched (grad mode off in backward: no Python around them)
    kernels: int = 0  # ops that read or write data (one kernel launch each on a GPU)
    engine_kernels: int = 0  # of which the autograd engine dispatched
    hook_kernels: int = 0  # of which a parameter's post-accumulate-grad hook launched (fused backward's update)
    flops: float = 0.0  # matmul, convolution and attention FLOPs
    recompute_flops: float = 0.0  # of which a checkpoint's recompute in backward (not model FLOPs, for MFU)
    bytes: float = 0.0  # bytes read + written by data-moving ops on the device
    device_s: float = 0.0  # sum of per-op roofline times of the device's ops
    h2d_bytes: int = 0  # host -> device copies
    d2h_bytes: int = 0  # device -> host copies
    copies: int = 0  # copy ops between host and device (each a cudaMemcpyAsync the host issues)
    host_ops: int = 0  # ops on host tensors during the step (host-side work of offload plugins)
    host_bytes: float = 0.0
    host_flops: float = 0.0  # FLOPs of ops on host tensors (the encoders of a pre-pass on the host)
    host_s: float = 0.0  # their roofline time on the host

    def add(self, other: PhaseCost) -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    def minus(self, other: PhaseCost) -> PhaseCost:
        """What was counted since ``other`` (an earlier snapshot of the same phase)."""
        return PhaseCost(**{k: v - getattr(other, k) for k, v in asdict(self).items()})


@dataclass(frozen=True)
class Roofline:
    """Rates of one compute device for the per-op roofline (runner/plan/speed.py builds them)."""

    matmul_flops: dict[torch.dtype, float]  # FLOP/s achieved by matmuls and attention, per dtype
    conv_flops: dict[torch.dtype, float]  # FLOP/s achieved by convolutions, per dtype
    bytes_per_s: float  # achieved memory bandwidth
    kernel_floor_s: float  # the least time one data-moving op takes
    default_flops: float = 1e12  # dtypes not listed (int, fp8 ...)

    def op_seconds(self, flops: float, nbytes: float, dtype: torch.dtype | None, conv: bool) -> float:
        t = nbytes / self.bytes_per_s
        if flops:
            rates = self.conv_flops if conv else self.matmul_flops
            t = max(t, flops / rates.get(dtype, self.default_flops))
        return max(t, self.kernel_floor_s)


@dataclass
class CostCounter:
    """Per-phase :class:`PhaseCost` of the ops the tracker sees (``observe`` is its per-op hook)."""

    device: Roofline
    host: Roofline
    device_type: str = "meta"
    phases: dict[str, PhaseCost] = field(default_factory=dict)
    counted: frozenset[str] = frozenset(("encode", "forward", "backward", "optimizer"))  # the step's phases
    _kinds: dict[Any, int] = field(default_factory=dict)

    def _kind(self, func: Any) -> int:
        kind = self._kinds.get(func)
        if kind is None:
            if func in COPIES:
                kind = _COPY
            elif launches_nothing(func):
                kind = _SKIP
            elif getattr(func, "overloadpacket", None) in FLOP_FORMULAS:
                kind = _FLOP
            else:
                kind = _PLAIN
            self._kinds[func] = kind
        return kind

    def observe(self, func: Any, args: tuple, kwargs: dict, out: Any, phase: str) -> None:
        c = self.phases.get(phase)
        if c is None:
            if phase not in self.counted:
                return  # setup, the sampling pass: not part of a training step
            c = self.phases[phase] = PhaseCost()
        if SimulatedOptimizer.allocating:  # the first step's state: not part of a steady-state step
            return
        c.ops += 1
        node = autograd_node_name() if phase == "backward" else None
        engine = node not in _PYTHON_NODES and not torch.is_grad_enabled()
        hook = node == "AccumulateGrad"
        if engine:  # (a checkpoint's recompute runs with grad on; fused backward's hooks run in AccumulateGrad)
            c.engine_ops += 1
        kind = self._kind(func)
        if kind == _SKIP:
            return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        first = None
        written = 0
        for t in outs:
            if isinstance(t, torch.Tensor):
                if first is None:
                    first = t
                written += _nbytes(t)
        read = 0
        src = None
        for a in args:
            if isinstance(a, torch.Tensor):
                read += _nbytes(a)
                if src is None:
                    src = a
            elif isinstance(a, (list, tuple)):
                for t in a:
                    if isinstance(t, torch.Tensor):
                        read += _nbytes(t)
                        if src is None:
                            src = t
        if kwargs:
            for a in kwargs.values():
                if isinstance(a, torch.Tensor):
                    read += _nbytes(a)
        anchor = first if first is not None else src
        if anchor is None:
            return
        on_device = _device_type(anchor) == self.device_type
        if kind == _COPY:
            source = args[1] if func is aten.copy_.default else args[0]
            from_device = _device_type(source) == self.device_type
            if on_device != from_device:
                c.copies += 1
                if on_device:
                    c.h2d_bytes += written
                else:
                    c.d2h_bytes += written
                return
        flops = 0
        if kind == _FLOP:
            try:
                flops = flop_count(func, args, kwargs, out)
            except Exception:  # a formula that cannot read these arguments: count the bytes only
                flops = 0
        dtype = (src if src is not None else anchor).dtype
        nbytes = read + written
        conv = func.overloadpacket in CONV_PACKETS if flops else False
        if on_device:
            c.kernels += 1
            c.engine_kernels += engine
            c.hook_kernels += hook
            c.flops += flops
            if flops and phase == "backward" and torch.is_grad_enabled():
                c.recompute_flops += flops
            c.bytes += nbytes
            c.device_s += self.device.op_seconds(flops, nbytes, dtype, conv)
        else:
            c.host_ops += 1
            c.host_bytes += nbytes
            c.host_flops += flops
            c.host_s += self.host.op_seconds(flops, nbytes, dtype, conv)

    def snapshot(self, phase: str) -> PhaseCost:
        """A copy of ``phase``'s counts so far (zeros before its first op)."""
        return PhaseCost(**asdict(self.phases.get(phase, PhaseCost())))

    def total(self, names: tuple[str, ...] | None = None) -> PhaseCost:
        out = PhaseCost()
        for name, c in self.phases.items():
            if names is None or name in names:
                out.add(c)
        return out


def _nbytes(t: torch.Tensor) -> int:
    """Bytes an op reads or writes of ``t``: its elements, but no more than its storage (broadcasts)."""
    n = t.numel() * t.element_size()
    if t.dim() and 0 in t.stride():
        n = min(n, t.untyped_storage().nbytes())
    return n


def _device_type(t: torch.Tensor) -> str:
    dev = getattr(t, "fake_device", None)
    return dev.type if dev is not None else t.device.type
