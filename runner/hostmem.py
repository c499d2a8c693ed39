"""Host allocator settings for runs that compute on the CPU.

A CPU training step frees most of what it allocated (activations, gradients' temporaries) and
the next step allocates the same sizes again. glibc's malloc hands large blocks back to the OS
(``munmap``, heap trimming) as soon as they are free, so every step faulted ~3 k fresh pages in
again: 2-3 ms of a 130 ms tiny step here, 2-6 % of a CPU run (bench/overhead.py measured it and
traced it to page faults in the forward pass). Fixing the mmap threshold at 32 MiB (glibc's own
ceiling for its dynamic threshold) and the trim threshold at 1 GiB keeps freed memory in the heap
for the next step instead. Trade-off: the process RSS stays up to that much above what is live
between steps; the per-step memory columns (host_rss_gb) show it.

Only for runs whose device is the CPU, and only with glibc (a no-op elsewhere): a GPU run's
tensors live in the CUDA caching allocator, which already keeps its blocks.

Also here, :func:`collector_paused`: Python's garbage collector held off while the libraries load.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the command line pauses the collector before torch loads
    from runner.resolved import ResolvedRun

log = logging.getLogger("runner")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
TRIM_BYTES, MMAP_BYTES = 1 << 30, 1 << 25


def keep_freed_host_memory(run: ResolvedRun) -> bool:
    """Set glibc's trim/mmap thresholds for a CPU run (see the module docstring); True if set."""
    if run.device.type != "cpu" or run.simulate:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl without mallopt): nothing to do
        return False
    ok = bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES))
    if ok:
        log.info("CPU run: freed host memory stays in the heap for the next step (glibc trim threshold 1 GiB)")
    return ok


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic garbage collection inside (explicit ``gc.collect()`` still works).

    Why: loading torch, diffusers, transformers, peft and accelerate makes a few hundred thousand
    objects that live as long as the process, and no garbage to speak of; the collector's full
    passes, triggered each time that heap grows by a quarter, walked it six times while a plan
    command loaded them: ~0.5 s of a ~13 s command. The trade-off: cyclic garbage made inside
    waits for the next collection after it (there is next to none while importing).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
