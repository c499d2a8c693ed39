"""The runtime records of a streamed module: load states, slots, blocks and statistics."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runner.plugins.host_buffers import HostRegion, tensor_bytes

RELEASED, INFLIGHT, LOADED = 0, 1, 2


class _Slot:
    """One streamed parameter: its host parameter (the real one) and its device twin."""

    __slots__ = ("block", "owner", "name", "host", "dev", "trainable", "offset", "nbytes", "installed",
                 "staging", "grad_region", "staging_region")

    def __init__(self, block: _Block, owner: nn.Module, name: str, host: nn.Parameter, dev: nn.Parameter,
                 offset: int) -> None:
        self.block = block
        self.owner = owner
        self.name = name
        self.host = host
        self.dev = dev
        self.trainable = host.requires_grad
        self.offset = offset
        self.nbytes = tensor_bytes(host)
        self.installed = False
        self.staging: torch.Tensor | None = None
        self.grad_region: HostRegion | None = None
        self.staging_region: HostRegion | None = None


class _Block:
    __slots__ = ("index", "module", "name", "slots", "streamed", "state", "flat", "event", "flat_bytes",
                 "arena", "arena_bytes", "region", "__weakref__")

    def __init__(self, index: int, module: nn.Module, name: str, streamed: bool) -> None:
        self.index = index
        self.module = module
        self.name = name
        self.slots: list[_Slot] = []
        self.streamed = streamed
        self.state = RELEASED
        self.flat: torch.Tensor | None = None
        self.event: Any = None
        self.flat_bytes = 0
        self.arena: torch.Tensor | None = None  # host bytes of the frozen slots, laid out like `flat`
        self.arena_bytes = 0
        self.region: HostRegion | None = None


@dataclass
class StreamStats:
    loads: int = 0  # block loads issued (forward + backward)
    waited: int = 0  # loads that were still in flight when needed (the copy was not hidden)
    on_demand: int = 0  # loads issued only when the block was needed (no prefetch)
    late: int = 0  # loads forced by a saved weight needed after its block was released
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    peak_device_bytes: int = 0  # most streamed-weight bytes on the device at once (<= the plan's window)
