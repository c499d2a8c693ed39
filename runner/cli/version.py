"""The runner's own version, for ``python -m runner --version`` and ``runner.__version__``.

Read from the installed package's metadata (``importlib.metadata``), which is what pip, wheels
and editable installs write from pyproject.toml. A source tree run without installing
(``PYTHONPATH=.``) has no metadata, so the fallback reads ``[project] version`` from the
pyproject.toml beside the package. Nothing heavy is imported: ``--version`` answers at once.
"""
from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DISTRIBUTION = "diffusion-memory-runner"


def source_tree_version(pyproject: Path | None = None) -> str | None:
    """``[project] version`` of the pyproject.toml next to the package, or None without one.

    tomllib is only in Python >= 3.11 and the runner supports 3.10, so the one key is read with a
    regular expression on the ``[project]`` table (a static string: setuptools' own rule for it).
    """
    path = pyproject or Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    table = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if table is None:
        return None
    found = re.search(r"""^version\s*=\s*["']([^"']+)["']""", table.group(1), re.M)
    return found.group(1) if found else None


def runner_version() -> str:
    """The installed distribution's version, else the source tree's, else ``unknown``."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return source_tree_version() or "unknown"


def version_line() -> str:
    """What ``--version`` prints: ``runner (diffusion-memory-runner) 0.1.0``."""
    return f"runner ({DISTRIBUTION}) {runner_version()}"
