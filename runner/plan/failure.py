"""A planner failure as one paragraph: the failing call and the trainer's line, never a traceback.

Why: a plan that cannot be made is the answer the user asked for (``mode=plan``) or a reason not
to start (the preflight): a run that starts without its plan trains with no budget check, which
is what the planner is for. The trainer's line is the innermost frame in the file of the
trainer's class (or one of its bases), where the user can act; the failing call is the innermost
frame of all, where the error was raised.
"""
from __future__ import annotations

import inspect
import traceback
from typing import Any

from runner.errors import UserError

OPT_OUT = "train.preflight=false starts the run without a plan (no budget check)"


def planner_failure(error: BaseException, trainer: Any, during: str) -> UserError:
    """The UserError for ``error``, raised while planning (``during``: "mode=plan" or "the preflight");
    ``trainer``: the trainer or its class (None: no trainer line)."""
    frames = traceback.extract_tb(error.__traceback__)
    what = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    where = ""
    if frames:
        last = frames[-1]
        where = f" in {_short(last.filename)}:{last.lineno} ({last.name})"
    own = _trainer_frame(frames, trainer)
    line = ""
    if own is not None:
        code = f": {own.line.strip()}" if own.line else ""
        line = f" The trainer's call: {_short(own.filename)}:{own.lineno} in {own.name}{code}."
    return UserError(
        f"The planner could not simulate this run ({during}): {what}{where}.{line} The planner runs the trainer's "
        "step on tensors without values (shapes only); a step that reads a value it cannot know (.item(), bool() "
        "of a tensor, nonzero) on anything but token ids and masks stops it. Make that call not depend on values, "
        f"or skip the plan: {OPT_OUT}. RUNNER_DEBUG=1 shows the traceback.")


def _trainer_frame(frames: list[traceback.FrameSummary], trainer: Any) -> traceback.FrameSummary | None:
    files = set()
    owner = trainer if isinstance(trainer, type) else type(trainer)
    for cls in owner.__mro__ if trainer is not None else ():
        try:
            files.add(inspect.getsourcefile(cls))
        except (TypeError, OSError):
            continue
    for frame in reversed(frames):
        if frame.filename in files:
            return frame
    return None


def _short(path: str) -> str:
    for marker in ("site-packages/", "/runner/", "/tests/"):
        if marker in path:
            head, _, tail = path.rpartition(marker)
            return (marker.strip("/") + "/" + tail) if marker != "site-packages/" else tail
    return path
