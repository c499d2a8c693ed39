"""Real filesystem faults for tests: a read-only folder and a small (soon full) disk.

Why namespaces and not chmod: tests often run as root, for whom permission bits do not stop a
write. ``unshare -Urm`` gives the child process its own user and mount namespace (no privilege
needed where user namespaces are enabled) in which a folder can be bind-mounted read-only or a
small tmpfs mounted, so the kernel itself returns EROFS or ENOSPC. Nothing outside the child
sees the mounts. Where the kernel refuses user namespaces, ``faults_supported()`` is False and
the tests skip.
"""
from __future__ import annotations

import functools
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path


@functools.cache
def faults_supported() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null || "
             "mount -t tmpfs -o size=64k tmpfs /tmp"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def with_faults(cmd: Sequence[str], *, read_only: Sequence[Path] = (), small: dict[Path, int] | None = None) -> list[str]:
    """``cmd`` run in a private mount namespace where each ``read_only`` folder is read-only and each
    ``small`` folder is an empty tmpfs of the given size in bytes (its earlier content hidden)."""
    steps = []
    for folder, size in (small or {}).items():
        Path(folder).mkdir(parents=True, exist_ok=True)
        steps.append(f"mount -t tmpfs -o size={int(size)} tmpfs {shlex.quote(str(folder))}")
    for folder in read_only:
        q = shlex.quote(str(folder))
        steps.append(f"mount --bind {q} {q} && mount -o remount,ro,bind {q} {q}")
    return ["unshare", "-Urm", "sh", "-c", " && ".join([*steps, "exec " + shlex.join(list(cmd))])]
