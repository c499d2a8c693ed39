"""The stream API a plugin's side-stream code runs on: the GPU's, or a simulated one in order.

Why: side streams, events and ``record_stream`` exist only on a real accelerator, so code that
asked ``device.type == "cuda"`` took its synchronous branch everywhere else, and the planner
(which runs on ``meta``) and every CPU test planned and ran a path the GPU never takes: activation
offload's prefetch window grew by a block input per block on the GPU while the plan counted none
of it. A plugin therefore asks :func:`stream_api` whether the *target* is CUDA-like and gets:

* ``torch.cuda`` (the device module) on a real accelerator;
* :data:`SIMULATED`, a stand-in with the same calls, when the target is CUDA but the tensors live
  on ``meta`` (the planner) or the CPU. Its streams execute in order on the one thread there is,
  so every copy is complete when it is issued, events are always reached and waits return at
  once. What stays on the device is decided by the plugin's own references (its stash and its
  prefetch window), exactly as on the GPU, which is what the live-bytes tracker counts;
* None when the target is the CPU: the synchronous path, which is what a CPU run executes.

``train.device=cuda_sim`` (runner/memory/cuda_sim.py) trains with real values on :data:`SIM_DEVICE`,
a CPU device the run treats as the card, and takes the simulated streams too.

Trade-off: the simulation shows what a side stream keeps alive, not how long a copy takes; the
step-time model (runner/plan/speed.py) prices the overlap from the plugins' recorded transfers.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

SYNC_OBSERVERS: list[Any] = []
"""Callables told of every host synchronisation with a simulated stream or event (``train.device=cuda_sim``
counts them as host syncs: on a GPU each one stops the CPU until the card catches up)."""


def _synchronized() -> None:
    for observe in SYNC_OBSERVERS:
        observe()


class SimulatedEvent:
    """A CUDA event on a stream that runs in order: reached as soon as it is recorded."""

    def synchronize(self) -> None:
        _synchronized()

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        return None


class SimulatedStream:
    """A CUDA stream whose work runs in order on the calling thread: nothing is ever pending."""

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = device
        self.priority = priority

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> SimulatedEvent:
        return event if event is not None else SimulatedEvent()

    def synchronize(self) -> None:
        _synchronized()

    def query(self) -> bool:
        return True


class SimulatedStreams:
    """``torch.cuda``'s stream calls for a CUDA target on ``meta`` or the CPU (module docstring)."""

    Stream = SimulatedStream
    Event = SimulatedEvent

    def __init__(self) -> None:
        self._default = SimulatedStream()
        self._current = self._default

    def current_stream(self, device: Any = None) -> SimulatedStream:
        return self._current

    def default_stream(self, device: Any = None) -> SimulatedStream:
        return self._default

    @contextmanager
    def stream(self, stream: SimulatedStream | None) -> Iterator[None]:
        previous, self._current = self._current, stream or self._current
        try:
            yield
        finally:
            self._current = previous

    def synchronize(self, device: Any = None) -> None:
        _synchronized()


SIMULATED = SimulatedStreams()


SIM_DEVICE = torch.device("cpu", 0)
"""``train.device=cuda_sim``'s card (runner/memory/cuda_sim.py): CPU memory that ``.to()`` treats as a
device other than the host (``cpu``), so a move to it or back is a real copy, as on a GPU."""


def is_simulated_cuda(device: torch.device | str) -> bool:
    """``device`` is the simulated card (``cpu:0``), not the host (``cpu``)."""
    d = torch.device(device)
    return d.type == "cpu" and d.index == 0


def cuda_like(device: torch.device | str) -> bool:
    """Tensors on ``device`` are on a CUDA card, real or simulated (``train.device=cuda_sim``): the
    branches that pin host memory, use side streams or read the allocator's statistics apply."""
    d = torch.device(device)
    return (d.type == "cuda" and torch.cuda.is_available()) or is_simulated_cuda(d)


def is_real_accelerator(device: torch.device | str) -> bool:
    """Tensors on ``device`` live in an accelerator's memory (not the CPU, not the planner's ``meta``)."""
    return torch.device(device).type not in ("cpu", "meta")


def stream_api(device: torch.device | str, cuda_like: bool) -> Any:
    """The stream API for side-stream code on ``device`` when the step is for ``cuda_like`` a target
    (``run.on_cuda``): the device module, :data:`SIMULATED`, or None for the synchronous path."""
    if is_real_accelerator(device):
        return torch.get_device_module(torch.device(device))
    return SIMULATED if cuda_like else None


def record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """``tensor.record_stream(stream)`` for a tensor in accelerator memory; nothing otherwise (a
    simulated stream runs in order, so the tensor's use on it is over when the call returns)."""
    if isinstance(stream, SimulatedStream) or not is_real_accelerator(tensor.device):
        return
    tensor.record_stream(stream)
