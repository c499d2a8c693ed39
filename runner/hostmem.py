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

Also for CPU runs, :func:`cpu_threads`: how many threads torch's kernels use. torch starts one
OpenMP thread per core, and each spins while it waits for the others; on a machine whose cores are
busy with other processes the spinning threads wait for each other's time slices, and the tiny
default step took 2.2-5.4 s instead of 0.17-0.25 s with one thread (same losses) on a 2-core
machine at load 4.5-5.5. So a CPU run takes the cores other processes leave free (the one-minute
load average when it starts), at least one and never more than it already had (``OMP_NUM_THREADS``
or the caller's ``torch.set_num_threads``); ``train.cpu_threads`` sets the number.

The thread count is decided once, at the start, and so is the OpenMP wait policy
(:func:`passive_openmp`, before torch loads its OpenMP runtime; a policy the user set is kept): on
a machine whose cores are busy when the run starts, ``OMP_WAIT_POLICY=PASSIVE`` (waiting threads
sleep at once), on an idle one libgomp's default (spin a while, then sleep). Measured side by side
(docs/benchmarks.md, ``bench/cpu_threads.py``, tiny default on 2 cores): with a spinning process
per core, 2 spinning threads took 5x (and up to 100x on a busier machine) the time of 2 sleeping
ones; on the idle machine the sleeping ones took 2.3x the time of spinning ones (0.233 against
0.102 s/step: each small parallel region waits for its threads to wake). The trade-off: load that
arrives after an idle start meets spinning threads; ``OMP_WAIT_POLICY=PASSIVE`` set by the user
covers a machine that is shared all the time.

Also here, :func:`collector_paused`: Python's garbage collector held off while the libraries load.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the command line pauses the collector before torch loads
    from runner.resolved import ResolvedRun

log = logging.getLogger("runner")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
TRIM_BYTES, MMAP_BYTES = 1 << 30, 1 << 25


def passive_openmp() -> str | None:
    """``OMP_WAIT_POLICY=PASSIVE`` when other processes keep cores busy at the start and the user
    set no policy (module docstring); the policy now set, or None for libgomp's default. Only
    effective before torch loads OpenMP, so ``python -m runner`` calls it before importing torch."""
    if "OMP_WAIT_POLICY" not in os.environ:
        cores, free, _ = free_cores()
        if free < cores:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return os.environ.get("OMP_WAIT_POLICY")


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


def free_cores() -> tuple[int, int, float]:
    """(cores this process may use, cores other processes leave free (at least 1), load average)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform: assume idle
        load = 0.0
    return cores, max(1, min(cores, cores - int(load + 0.5))), load


def cpu_threads(run: ResolvedRun, configured: int | None) -> int | None:
    """Set torch's thread count for a run on the CPU (module docstring); the count, or None when
    the run's device is not the CPU. ``configured``: ``train.cpu_threads`` (None: auto)."""
    if run.device.type != "cpu" or run.simulate:
        return None
    import torch

    cores, free, load = free_cores()
    # auto never raises the count the process already has (OMP_NUM_THREADS, or a caller's own setting)
    threads = int(configured) if configured is not None else min(free, torch.get_num_threads())
    torch.set_num_threads(threads)
    why = ("train.cpu_threads" if configured is not None
           else f"{cores} cores, load {load:.1f} from other processes; train.cpu_threads=N sets it")
    log.info("CPU run: %d torch thread%s (%s), OpenMP wait policy %s", threads, "" if threads == 1 else "s", why,
             os.environ.get("OMP_WAIT_POLICY", "libgomp's default (spin, then sleep)"))
    return threads


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
