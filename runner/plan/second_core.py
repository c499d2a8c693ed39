"""Work a plan can do beside its main line, on the machine's second core.

Why: a plan is one Python thread, so on a two-core laptop one core idles while the other builds
the models, sets the plugins up and simulates the step. Some work has no effect on that line
but its result: the encoders' output shapes (runner/plan/batch.py), a run of the VAE and text
encoders on ``meta``, ~0.5-1 s at full size (Wan's video VAE, T5-XXL). A forked child does it
while the parent goes on, and sends back its small, plain result (JSON over a pipe; no pickle).

The trade-off: a fork costs a few milliseconds, so work below about a tenth of a second is done
in place. Where a fork is not safe or not possible (no ``os.fork``, one usable core, or other
threads in the process, whose locks a child could inherit held), the work is done in place, at
once, as before. Where the child fails, the parent does the work itself when the result is
asked for, so an error is raised in the parent exactly as the in-place call raises it.
"""
from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return os.cpu_count() or 1


def can_fork() -> bool:
    """A child can run beside this process: fork exists, a second core is free, no other threads."""
    return hasattr(os, "fork") and usable_cores() > 1 and threading.active_count() == 1


class Beside(Generic[T]):
    """``work()`` in a forked child (or in place), its result taken with :meth:`result`.

    ``to_json``/``from_json`` carry the result between the processes: it must survive a JSON
    round trip. ``redo`` computes it in the parent when the child failed (by default ``work``
    again: pass a callable when ``work`` reads state the parent changes in the meantime).
    Call :meth:`close` when done (the result may never be wanted: an error on the main line, or
    a plan that needs no encoder shapes): it stops a child still running, so none is left behind.
    """

    def __init__(self, work: Callable[[], T], to_json: Callable[[T], Any], from_json: Callable[[Any], T],
                 redo: Callable[[], T] | None = None, fork: bool = True) -> None:
        self._from_json, self._redo = from_json, redo or work
        self._done: tuple[T] | None = None
        self._pid = 0
        self._read = -1
        self.forked = False  # the work runs in a child (else it is done already)
        self._redo_now = False  # in place, the work failed: result() redoes it, as after a failed child
        if not (fork and can_fork()):
            try:
                self._done = (work(),)
            except Exception:  # noqa: BLE001 - as a failed child: result() redoes it (and raises what redo raises)
                self._done = None
                self._redo_now = True
            return
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: compute, send, and leave without the parent's exit handlers
            status = 1
            try:
                os.close(read)
                data = json.dumps(to_json(work())).encode()
                with os.fdopen(write, "wb") as pipe:
                    pipe.write(data)
                status = 0
            finally:
                os._exit(status)
        os.close(write)
        self._pid, self._read = pid, read
        self.forked = True

    def _collect(self) -> bytes | None:
        with os.fdopen(self._read, "rb") as pipe:
            data = pipe.read()
        _, status = os.waitpid(self._pid, 0)
        self._pid = 0
        return data if os.waitstatus_to_exitcode(status) == 0 else None

    def result(self) -> T:
        """The work's result (waits for the child; redone in place if the child failed)."""
        if self._done is None and self._redo_now:
            self._done = (self._redo(),)
        if self._done is None:
            data = self._collect()
            self._done = (self._from_json(json.loads(data)) if data is not None else self._redo(),)
        return self._done[0]

    def close(self) -> None:
        """End the child if its result was not taken (stopped, not waited for), and reap it."""
        if self._pid:
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:  # pragma: no cover - already reaped elsewhere
                pass
            self._collect()
