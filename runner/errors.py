"""User-facing errors.

A `UserError` is an expected mistake in the user's input (a key, a value, a file). The entry
point prints its message as one paragraph and exits with status 2, without a traceback.
Anything else is a bug in the runner and keeps its traceback.
"""
from __future__ import annotations

import difflib
import errno
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path


class UserError(Exception):
    """An error in the user's input; the message must name the key/file/value and what is valid."""

    exit_code = 2
    status = "failed"  # job_summary.json's status for a job that ended with this error


def closest(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Closest names first (difflib ratio), for 'did you mean' hints."""
    choices = list(choices)
    return difflib.get_close_matches(word, choices, n=n, cutoff=0.5)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean X?' or '' when nothing is close."""
    hits = closest(word, choices, n=1)
    return f" Did you mean '{hits[0]}'?" if hits else ""


def valid_list(word: str, choices: Iterable[str]) -> str:
    """All valid names, the closest to `word` first."""
    choices = sorted(set(choices))
    near = closest(word, choices, n=len(choices))
    ordered = near + [c for c in choices if c not in near]
    return ", ".join(ordered)


class Interrupted(UserError):
    """The user stopped the run with a signal it could not finish on; exit status 128 + the signal."""

    status = "interrupted"

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class ResumableStop(UserError):
    """A stop that loses no completed step: the loop saves the last one and its message says where,
    so that the user can continue with ``train.resume`` once the cause is fixed (OOM at micro-batch 1,
    a non-finite step). Each kind of stop says in its own words what was kept (``kept``, with
    ``{steps}`` and ``{checkpoint}``), what to fix first (``advice``) and what an empty save means."""

    kept = "The last completed step ({steps}) is saved in {checkpoint}"
    advice = "after fixing the cause"
    nothing_saved = "No step had completed, so there is no checkpoint to resume from."

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step
        self.checkpoint: Path | None = None

    def add_checkpoint(self, checkpoint: Path | None, completed_steps: int, unsaved_reason: str | None = None) -> None:
        """Append where the last completed step was saved (or why nothing was: ``unsaved_reason``)."""
        self.checkpoint = checkpoint
        if checkpoint is not None:
            tail = (" " + self.kept.format(steps=completed_steps, checkpoint=checkpoint)
                    + f"; {self.advice}, continue with train.resume={checkpoint}.")
        elif unsaved_reason:
            tail = f" {unsaved_reason}"
        else:
            tail = " " + self.nothing_saved
        self.args = (self.args[0] + tail,)


class StorageError(UserError):
    """A read or write failed for a reason outside the runner (disk full, read-only, gone); exit 5.

    Not a bug and not bad input, so it gets its own status: scripts can retry elsewhere.
    """

    exit_code = 5
    status = "io_error"


_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "the operation is not permitted",
    errno.ENOENT: "the file or folder does not exist (was it removed while the run was going?)",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "the path is a folder, not a file",
    errno.EIO: "the device reported an I/O error",
    errno.EFBIG: "the file grew past the size limit (ulimit -f)",
}


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def as_os_error(error: BaseException, filename: str | os.PathLike[str] | None = None) -> OSError | None:
    """``error`` as an OSError when it is one, or wraps one: safetensors' Rust writer raises a
    SafetensorError whose text ends in "(os error 28)" for a full disk."""
    if isinstance(error, OSError):
        return error
    found = re.search(r"os error (\d+)", str(error))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code), None if filename is None else str(filename))


def storage_error(error: OSError, what: str, path: str | os.PathLike[str] | None = None,
                  needed_bytes: int | None = None, advice: str = "") -> StorageError:
    """One paragraph for an OSError: what failed, where, why, the bytes needed where known, and what to do."""
    where = Path(error.filename if error.filename else path if path is not None else ".")
    reason = _REASONS.get(error.errno or -1, error.strerror or str(error))
    text = f"{what} failed: {reason} ({where})."
    if error.errno == errno.EFBIG:  # the process's file-size limit, not the disk: free space would not help
        import resource  # POSIX only, like EFBIG from a ulimit

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.1f} MiB"
        text += (f" This process may write files of at most {limit} (`ulimit -f`, in 1024-byte blocks)"
                 + (f" and this one needs about {needed_bytes / 2**20:.1f} MiB" if needed_bytes is not None else "")
                 + ". Raise the limit (`ulimit -f unlimited` in the shell that starts the run, or the job "
                 "scheduler's file-size limit) and run again.")
    elif error.errno in (errno.ENOSPC, errno.EDQUOT):
        free = _free_bytes(where)
        if needed_bytes is not None:
            text += f" It needs about {needed_bytes / 2**20:.1f} MiB"
            text += f"; {free / 2**20:.1f} MiB are free there." if free is not None else "."
        elif free is not None:
            text += f" {free / 2**20:.1f} MiB are free there."
        text += " Free some space or choose a folder on another disk."
    elif error.errno in (errno.EROFS, errno.EACCES, errno.EPERM) and not advice:
        text += " Choose a folder you can write to (output_dir=<folder> for the run's outputs)."
    return StorageError(f"{text} {advice}".strip())
