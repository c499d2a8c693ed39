"""The processes of one run: who launched them, how they meet, which one writes.

Launchers (none of them ours): ``torchrun`` and ``accelerate launch`` start N copies of
``python -m runner`` with ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` in
their environment; a SLURM job started by hydra-submitit-launcher runs its tasks with submitit's
job environment, which :func:`process_world` exports in the same form (submitit's own
``TorchDistributedEnvironment``). Every process then runs Hydra and the whole entry point.

Meeting: :func:`join_process_group` initialises ``torch.distributed``'s default group from that
environment (``env://``), once per process: gloo on CPUs; ``cpu:gloo,cuda:nccl`` with GPUs, so that
tensors on the GPU go through NCCL and the runner's small agreements (runner/distributed/agree.py) go
through gloo without a GPU synchronisation. accelerate's state adopts the existing group.
The group's timeout is ``RUNNER_DIST_TIMEOUT_MIN`` minutes (default 180: rank 0 may fill the
encoder cache for a long time while the others wait; a real hang ends when the launcher kills
the others after one process failed, or at the timeout).

One output directory: Hydra names the run directory from the time (``${runner_now:...}``,
conf/config.yaml), which would differ by a second between processes. Under ``torchrun`` and
``accelerate launch`` :func:`agree_on_start` joins the group before Hydra starts and takes rank 0's
start time for every rank (``RUNNER_START_TIME``); a SLURM job's tasks read the directory from the
sweep's config, which is the same for all of them.

Only rank 0 writes the run's files and logs: :func:`quiet_other_ranks` removes the other ranks'
log file handler and keeps their console to warnings (prefixed with the rank); their Hydra
``.hydra/`` record is switched off (``hydra.output_subdir=null``) where the runner starts Hydra.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from runner.world import ProcessWorld, process_world  # noqa: F401 (callers take them from here)

log = logging.getLogger("runner")

START_TIME_ENV = "RUNNER_START_TIME"
TIMEOUT_ENV = "RUNNER_DIST_TIMEOUT_MIN"
DEFAULT_TIMEOUT_MIN = 180.0


# What gloo and NCCL raise in a collective whose partner process has gone (its own error ended it).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing",
             "NCCL communicator was aborted", "Broken pipe")


def lost_peer(error: BaseException) -> bool:
    """Did ``error`` end this process because another process of the run stopped first? Then the
    other's own error (a UserError's paragraph, printed with its rank) is the one to read, and this
    process's traceback from inside a collective is noise (runner/cli/launch.py prints one line)."""
    if process_world().world_size <= 1:
        return False
    import torch.distributed as dist

    network = getattr(dist, "DistNetworkError", None)
    return (network is not None and isinstance(error, network)) or any(p in str(error) for p in PEER_LOST)


def timeout() -> datetime.timedelta:
    return datetime.timedelta(minutes=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_MIN)))


def join_process_group() -> ProcessWorld:
    """Initialise torch.distributed's default group when launched as several processes; idempotent."""
    import torch
    import torch.distributed as dist

    world = process_world()
    if world.world_size <= 1 or dist.is_initialized():
        return world
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=timeout())
    return world


def agree_on_start() -> None:
    """Before Hydra: join the group and take rank 0's start time for the run directory's name (module
    docstring); other ranks keep no ``.hydra/`` record. A no-op for one process (which imports
    nothing: ``--cfg job`` and a one-process run's start need no torch here)."""
    if process_world().world_size <= 1:
        return
    import torch
    import torch.distributed as dist

    world = join_process_group()
    stamp = torch.tensor([time.time() if world.rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(stamp, src=0, group=cpu_group())
    os.environ[START_TIME_ENV] = repr(float(stamp.item()))
    if world.rank != 0 and not any(a.startswith("hydra.output_subdir=") for a in sys.argv[1:]):
        sys.argv.append("hydra.output_subdir=null")


_CPU_GROUP = None


def cpu_group():  # noqa: ANN201 - a torch ProcessGroup
    """A gloo group over every rank, for the runner's small CPU tensors (agreements, start time)."""
    global _CPU_GROUP
    import torch.distributed as dist

    if _CPU_GROUP is None or not dist.is_initialized():
        backend = dist.get_backend()
        _CPU_GROUP = dist.group.WORLD if backend in ("gloo", "cpu:gloo,cuda:nccl") else dist.new_group(backend="gloo")
    return _CPU_GROUP


def from_rank0(make: Callable[[], Any]) -> Any:
    """``make()`` run on rank 0 only, its result (JSON-able) on every rank; a UserError it raises is
    raised on every rank with the same message. For work that every rank would otherwise repeat and
    that must end the same everywhere (``train.auto_fit``'s search). One process: ``make()``.
    JSON over the gloo group, not pickled objects: nothing a rank receives is unpickled."""
    world = process_world()
    if world.world_size <= 1:
        return make()
    import torch
    import torch.distributed as dist

    from runner.errors import UserError

    failed: BaseException | None = None
    if world.rank == 0:
        try:
            payload = {"ok": make()}
        except UserError as e:
            payload = {"error": str(e)}
        except BaseException as e:  # rank 0 fails: the others must not wait in the broadcast forever
            failed, payload = e, {"crash": f"{type(e).__name__} on rank 0"}
        data = json.dumps(payload).encode()
    size = torch.tensor([len(data) if world.rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(size, src=0, group=cpu_group())
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if world.rank == 0
           else torch.empty(int(size.item()), dtype=torch.uint8))
    dist.broadcast(buf, src=0, group=cpu_group())
    if failed is not None:
        raise failed
    payload = json.loads(bytes(buf.tolist()).decode())
    if "error" in payload:
        raise UserError(payload["error"])
    if "crash" in payload:
        raise RuntimeError(f"{payload['crash']}: its log has the error")
    return payload["ok"]


def start_time() -> float | None:
    """Rank 0's start time, when several processes agreed on one (None otherwise)."""
    value = os.environ.get(START_TIME_ENV)
    return float(value) if value else None


def runner_now(pattern: str) -> str:
    """The ``${runner_now:%Y-%m-%d}`` resolver of conf/config.yaml: Hydra's ``${now:...}``, but the
    agreed start time when several processes form one run."""
    stamp = start_time()
    when = datetime.datetime.fromtimestamp(stamp) if stamp is not None else datetime.datetime.now()
    return when.strftime(pattern)


def join_run() -> bool:
    """In the Hydra task, before anything is written: join the process group (a SLURM job's tasks
    meet here first) and quiet the other ranks; True on the rank that writes the run's files."""
    world = join_process_group()
    quiet_other_ranks(world.rank)
    return world.rank == 0


class _RankPrefix(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "_rank_prefixed", False):
            record.msg = f"[rank {self.rank}] {record.msg}"
            record._rank_prefixed = True
        return True


def quiet_other_ranks(rank: int) -> None:
    """On ranks other than 0: no log file (rank 0 writes the run's log) and warnings only on the console."""
    if rank == 0:
        return
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()
        else:
            handler.setLevel(logging.WARNING)
            handler.addFilter(_RankPrefix(rank))
