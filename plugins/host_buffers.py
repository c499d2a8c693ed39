"""Host memory the offload plugins share: page-aligned, page-locked regions, host copies, byte counts.

Both ``offload=stream`` (streamed weights, their gradients and staging buffers; plugins/stream/)
and ``offload=optimizer`` (host masters, gradients and optimizer state; plugins/optimizer_wrappers.py)
keep long-lived tensors in host memory that the device copies to and from. They share this module
rather than one reaching into the other's internals.

Pinned memory
-------------
Host copies are page-locked with ``cudaHostRegister`` on page-aligned anonymous mappings rather
than ``pin_memory()``: PyTorch's pinned allocator rounds every allocation up to a power of two
(up to 2x the host RAM for a 12 B model). The stream plugin's frozen weights of a block share one
region (one copy per block, so host->device copies run at full bandwidth); each trained parameter
gets its own region (its own storage, so safetensors can save it). Pinning only happens when CUDA
is available; on CPU and under the planner's fake tensors everything is synchronous and nothing is
pinned, with the same code path otherwise (``always_copy`` lets CPU tests exercise real copies).
"""
from __future__ import annotations

import logging
import mmap

import torch

from runner.compat import is_fake

log = logging.getLogger("runner")

GiB = 2**30
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
        n = tensor_bytes(like)
        return self.tensor[offset:offset + n].view(like.dtype).view(like.shape)

    def close(self) -> None:
        """Unregister the pages; tensors viewing the region keep working, pageable."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False


def host_copy(t: torch.Tensor, pin: bool) -> tuple[torch.Tensor, HostRegion | None]:
    """A host copy of ``t`` in its own (optionally page-locked) region: streamed trained weights,
    and the optimizer offload's long-lived host buffers (masters and gradients).

    Returns the copy and its region (to ``close()`` when done), or a plain pageable copy and None
    when nothing is pinned: no CUDA, ``pin=False``, or a fake tensor under the planner."""
    if not pin or not torch.cuda.is_available() or is_fake(t):
        return t.detach().to("cpu", copy=True), None
    region = HostRegion(tensor_bytes(t), pin=True)
    out = region.view(0, t)
    out.copy_(t.detach())
    return out, region


def fmt_bytes(n: int) -> str:
    """Bytes for messages: GiB from one GiB up, MiB below."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (not of its storage: a view counts only what it shows)."""
    return t.numel() * t.element_size()
