"""Host memory for streamed weights: page-aligned, page-locked regions, and byte helpers.

Pinned memory
-------------
Host copies are page-locked with ``cudaHostRegister`` on page-aligned anonymous mappings rather
than ``pin_memory()``: PyTorch's pinned allocator rounds every allocation up to a power of two
(up to 2x the host RAM for a 12 B model). The frozen weights of a block share one region (one
copy per block, so host->device copies run at full bandwidth); each trained parameter gets its
own region (its own storage, so safetensors can save it). Pinning only happens when CUDA is
available; on CPU and under the planner's fake tensors everything is synchronous and nothing is
pinned, with the same code path otherwise (``always_copy`` lets CPU tests exercise real copies).
"""
from __future__ import annotations

import logging
import mmap

import torch

from runner.compat import is_fake

log = logging.getLogger("runner")

GiB = 2**30
ALIGN = 256  # byte alignment of each parameter inside a block's device buffer (CUDA's own granularity)
PAGE = mmap.PAGESIZE


class HostRegion:
    """A page-aligned host buffer, page-locked with ``cudaHostRegister`` when asked and possible.

    Why not ``torch.empty(..., pin_memory=True)``: the caching host allocator rounds each
    allocation up to a power of two, which for long-lived weights and gradients wastes up to half
    of the pinned RAM. An anonymous ``mmap`` is page-aligned by construction, so registering it
    never overlaps another allocation's pages; ``close()`` unregisters it (the memory stays valid
    and pageable as long as tensors use it).
    """

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = max(PAGE, -(-int(nbytes) // PAGE) * PAGE)
        self._mm = mmap.mmap(-1, self.nbytes)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.pinned = False
        if pin and torch.cuda.is_available():
            try:
                err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
                self.pinned = int(err) == 0
            except Exception as e:  # pragma: no cover - depends on the CUDA runtime
                log.warning("stream: cudaHostRegister unavailable (%s); host copies stay pageable", e)
            if not self.pinned:
                log.warning("stream: could not page-lock %.1f MiB of host memory (ulimit -l?); copies will be slower",
                            self.nbytes / 2**20)

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like ``like`` at byte ``offset`` of this region (not yet filled)."""
        n = like.numel() * like.element_size()
        return self.tensor[offset:offset + n].view(like.dtype).view(like.shape)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False


def host_copy(t: torch.Tensor, pin: bool) -> tuple[torch.Tensor, HostRegion | None]:
    """A host copy of ``t`` in its own (optionally page-locked) region; other modules reuse this
    for long-lived host buffers (optimizer masters and gradients)."""
    if not pin or not torch.cuda.is_available() or is_fake(t):
        return t.detach().to("cpu", copy=True), None
    region = HostRegion(t.numel() * t.element_size(), pin=True)
    out = region.view(0, t)
    out.copy_(t.detach())
    return out, region


def fmt_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
