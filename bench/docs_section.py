"""Replace one benchmark's generated section of docs/benchmarks.md, leaving everything else as is.

Each bench script owns the text between its two HTML comment markers (invisible when rendered), so
hand-written notes next to a section survive a re-run, and a first run appends the section.
"""
from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = "# Benchmarks and measured figures\n\nEvery figure here was produced by the command shown beside it.\n"


def replace_section(section: str, begin: str, end: str, path: Path = DOC) -> None:
    """Replace the text from ``begin`` to ``end`` in ``path`` with ``section``, which carries both
    markers itself; append it when the file has no such section yet."""
    section = section.strip("\n")
    doc = path.read_text() if path.exists() else HEADER
    if begin in doc and end in doc:
        head, rest = doc.split(begin, 1)
        _, tail = rest.split(end, 1)
        doc = head + section + tail
    else:
        doc = doc.rstrip("\n") + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc if doc.endswith("\n") else doc + "\n")
