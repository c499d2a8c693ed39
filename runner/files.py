"""Where the shipped config tree is, and how the runner's files are written.

``conf_dir``: the conf/ tree beside the package (a checkout) or inside it (a wheel).

Permissions of the files the runner writes: as if ``open()`` and ``mkdir()`` had created them.

Why this is needed: an atomic write goes through a temporary file, and ``tempfile.mkstemp``
creates it with mode 0600 on purpose (it is meant to be private); renamed into place, that file
keeps 0600. safetensors' ``save_file`` writes the same way. So ``trainable.safetensors``, the
exported LoRA files, ``job_summary.json`` and the encoder-cache entries came out readable by their
owner only, where every other output is 0644: a colleague could not load a shared LoRA, and a
cache shared by several users on one machine could not be read by the others.

The rule, the one every normal tool follows: files get ``0o666 & ~umask`` (0644 under the usual
umask 022), folders ``0o777 & ~umask`` (0755). A user who wants private outputs sets
``umask 077`` and gets 0600/0700, as with ``cp`` or ``tar``.
"""
from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask, without changing it.

    Linux reports it in ``/proc/self/status`` (since 4.7). Elsewhere the only way is to set it and
    set it back (``os.umask`` returns the old value); a lock keeps two threads of this process from
    interleaving there, which is all that can be done (Python has no ``getumask``).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0o666 less the umask."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """The mode ``mkdir`` gives a new folder: 0o777 less the umask."""
    return 0o777 & ~current_umask()


def fix_fd_mode(fd: int) -> None:
    """Give a file opened by ``mkstemp`` the mode ``open()`` would have given it."""
    os.fchmod(fd, file_mode())


def fix_tree_modes(root: str | os.PathLike[str]) -> None:
    """Give ``root`` and everything under it the modes ``open()``/``mkdir`` would have given them.

    For a folder the runner has just written in full (a checkpoint or an export being staged):
    some of its files come from writers that create 0600 temporaries (safetensors, mkstemp).
    Symbolic links are left alone (their target is not ours).
    """
    fmode, dmode = file_mode(), dir_mode()
    root = Path(root)
    if root.is_symlink():
        return
    if root.is_file():
        os.chmod(root, fmode)
        return
    os.chmod(root, dmode)
    for top, dirs, names in os.walk(root):
        for d in dirs:
            p = os.path.join(top, d)
            if not os.path.islink(p):
                os.chmod(p, dmode)
        for n in names:
            p = os.path.join(top, n)
            if not os.path.islink(p):
                os.chmod(p, fmode)


def swap_in_folder(tmp: Path, final: Path) -> None:
    """Make the completed folder ``tmp`` the folder ``final``, each step an atomic rename.

    An existing ``final`` is first renamed aside (``.old-<name>-<pid>`` beside it), then removed:
    at every moment ``final`` is either the old folder or the new one, never a mix. Shared by the
    checkpoints (runner/state/checkpoint.py) and their exports (runner/export/checkpoint.py).
    """
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        remove_path(old)
    else:
        os.replace(tmp, final)


def remove_path(path: Path) -> None:
    """Remove ``path`` whatever it is (a folder, a file or a link); nothing if it is gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def conf_dir() -> Path:
    """The shipped conf/ tree: beside the package in a checkout, inside it in a wheel."""
    pkg = Path(__file__).resolve().parent
    for cand in (pkg / "conf", pkg.parent / "conf"):
        if (cand / "config.yaml").is_file():
            return cand
    raise RuntimeError(f"conf/config.yaml not found next to {pkg}; the installation is incomplete")
