"""Ranks agree on an out-of-memory retry without waiting on each other forever.

The problem: runner/guards/oom.py retries a step with a smaller micro-batch when it runs out of memory.
With several processes, an OOM may hit one rank only (fragmentation, a neighbour on the GPU). If
that rank left the step while the others went on, the others would wait in their next
collective (DDP's gradient all-reduce, FSDP's all-gather of the next block) for a partner that
never comes, and the failed rank would wait in a collective that none of them issues.

The protocol (the scheme Composer's automatic micro-batching uses with FSDP): every rank meets
the others at the same points, in the same order, with one all-reduce of a small CPU tensor
over gloo (no GPU synchronisation): ``[out of memory here, done with this attempt, loss]``.

* A *sync point* sits before every collective of the attempt: FSDP's all-gathers and
  reduce-scatters go through :class:`AgreeingAllGather`/:class:`AgreeingReduceScatter`, which
  meet ``[0, 0, 0]`` first; when any rank reported an OOM, they raise :class:`PeerOutOfMemory`
  instead of issuing the collective. DDP's attempts have no collective at all (the gradient
  all-reduce runs after the agreement, runner/distributed/runtime.py), so they have no sync point.
* When a rank leaves the attempt (passes done, its own OOM, or a peer's), it meets
  ``[own OOM, 1, loss]`` until every rank is done. A rank still inside the attempt is at a sync
  point, learns of the OOM there, and leaves too. So the meetings pair up whatever the point
  where a rank failed, and every rank ends the attempt knowing the same thing: whether anyone
  ran out of memory (then all retry with the same smaller micro-batch, runner/guards/oom.py), and the
  global mean loss.

What it costs: one all-reduce of three numbers per FSDP collective (two or three per block per
micro-batch) and one per attempt; on gloo over localhost about 0.1 ms each.

Limits: an OOM inside a collective itself (NCCL's own buffers) is not caught; an error other
than an OOM ends that rank, and ``torchrun``/``accelerate launch`` (or SLURM) stop the others.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from runner.compat import FSDP_COMMS, FSDPDefaultAllGather, FSDPDefaultReduceScatter
from runner.distributed.launch import cpu_group
from runner.guards.oom import is_out_of_memory

log = logging.getLogger("runner")


class PeerOutOfMemory(torch.OutOfMemoryError):
    """Another rank ran out of memory in this attempt; this rank leaves it too (and retries)."""


class Agreement:
    """The meetings of one training run's ranks (module docstring)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.meetings = 0  # counted, for tests and the log

    def meet(self, oom: int, done: int, loss: float) -> tuple[int, int, float]:
        t = torch.tensor([float(oom), float(done), float(loss)], dtype=torch.float64)
        dist.all_reduce(t, group=cpu_group())
        self.meetings += 1
        return int(t[0].item()), int(t[1].item()), float(t[2].item())

    def sync_point(self) -> None:
        """Before a collective: raise PeerOutOfMemory when a rank has left the attempt with an OOM."""
        oom, _, _ = self.meet(0, 0, 0.0)
        if oom:
            raise PeerOutOfMemory("another rank ran out of memory in this step; every rank retries it together")

    def finish(self, own_oom: bool, loss: float) -> tuple[bool, float]:
        """Leave the attempt: (did any rank run out of memory, the mean of the ranks' losses)."""
        while True:
            oom, done, total = self.meet(int(own_oom), 1, 0.0 if own_oom else loss)
            if done >= self.world_size:
                return oom > 0, total / self.world_size

    def attempts(self, passes: Callable[[int], float], on_failure: Callable[[], None],
                 after_passes: Callable[[], None]) -> Callable[[int], float]:
        """``passes`` (every forward and backward of a step with a given micro-batch) as one agreed
        attempt: a local OOM or a peer's becomes an OOM on every rank (so runner/guards/oom.py retries
        everywhere); ``after_passes`` runs when no rank failed (DDP's gradient all-reduce);
        ``on_failure`` resets what a broken attempt left (FSDP's iteration state)."""

        def attempt(micro: int) -> float:
            own: BaseException | None = None
            peer = False
            loss = 0.0
            try:
                loss = passes(micro)
            except PeerOutOfMemory:
                peer = True
            except Exception as e:  # noqa: BLE001 - only allocator failures are agreed on; others re-raised
                if not is_out_of_memory(e):
                    raise
                own = e
            if own is not None or peer:
                on_failure()
            any_oom, mean = self.finish(own is not None, loss)
            if any_oom:
                if own is not None:
                    raise own
                raise PeerOutOfMemory("another rank ran out of memory in this step; every rank retries it with "
                                      "the same smaller micro-batch")
            after_passes()
            return mean

        return attempt


if FSDP_COMMS:
    class AgreeingAllGather(FSDPDefaultAllGather):  # type: ignore[misc,valid-type]
        """FSDP2's own all-gather, after a sync point (see the module docstring)."""

        def __init__(self, agreement: Agreement) -> None:
            super().__init__()
            self.agreement = agreement

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            self.agreement.sync_point()
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class AgreeingReduceScatter(FSDPDefaultReduceScatter):  # type: ignore[misc,valid-type]
        """FSDP2's own reduce-scatter, after a sync point (see the module docstring)."""

        def __init__(self, agreement: Agreement) -> None:
            super().__init__()
            self.agreement = agreement

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            self.agreement.sync_point()
            return super().__call__(output_tensor, input_tensor, group, op, async_op)


def agree_before_fsdp_collectives(modules: list[Any], agreement: Agreement) -> bool:
    """Put a sync point before every all-gather and reduce-scatter of these FSDP modules; False when
    this PyTorch has no public hook for it (then an OOM inside a sharded forward or backward on one
    rank only is not agreed on, and the launcher ends the run when the others time out)."""
    if not FSDP_COMMS:
        log.warning("dist=fsdp: this PyTorch cannot wrap FSDP's collectives; ranks agree on an out-of-memory retry "
                    "only between attempts")
        return False
    for m in modules:
        m.set_custom_all_gather(AgreeingAllGather(agreement))
        m.set_custom_reduce_scatter(AgreeingReduceScatter(agreement))
    return True
