"""The fast tier (``make test``: ``-m "not slow"``) still covers every module: each tests/ folder keeps
at least one fast test, and every path the slow rule of tests/conftest.py names exists.

Read from the sources, without collecting (collection imports every test module: a minute here).
A test is slow when tests/conftest.py lists its file (SLOW_FILES) or its function (SLOW_TESTS), its
module's ``pytestmark`` says ``slow``, or a ``pytest.mark.slow`` decorator does; ``gpu`` tests skip
without CUDA, so they cover nothing here either.
"""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import SLOW_FILES, SLOW_TESTS

TESTS = Path(__file__).resolve().parent
SKIPPED_MARKS = ("slow", "gpu")


def _marks(node: ast.AST) -> set[str]:
    """The ``pytest.mark.<name>`` names an expression holds (a decorator, a pytestmark list)."""
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}


def fast_tests(path: Path) -> list[str]:
    """The test functions of one file that ``make test`` runs on a machine without CUDA."""
    rel = path.relative_to(TESTS).as_posix()
    if rel in SLOW_FILES:
        return []
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            if _marks(node.value) & set(SKIPPED_MARKS):
                return []
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name.startswith("test_")]
    return [f.name for f in functions if f"{rel}::{f.name}" not in SLOW_TESTS
            and not any(_marks(d) & set(SKIPPED_MARKS) for d in f.decorator_list)]


def test_every_slow_path_exists():
    """A renamed or moved test would leave its entry behind and join the fast tier unnoticed."""
    missing = [rel for rel in SLOW_FILES if not (TESTS / rel).is_file()]
    for entry in SLOW_TESTS:
        rel, name = entry.split("::")
        if not (TESTS / rel).is_file() or f"def {name}(" not in (TESTS / rel).read_text():
            missing.append(entry)
    assert not missing, f"tests/conftest.py names tests that are not there: {missing}"


def test_every_tests_folder_keeps_a_fast_test():
    folders = sorted({p.parent for p in TESTS.rglob("test_*.py")})
    assert len(folders) > 10, folders  # the tree mirrors runner/ and plugins/
    uncovered = [f.relative_to(TESTS).as_posix() or "." for f in folders
                 if not any(fast_tests(p) for p in f.glob("test_*.py"))]
    assert not uncovered, f"no fast test left in: {uncovered} (make test would not cover them)"


def test_the_rule_sees_the_marks_it_counts():
    """The static reading agrees with the marks: a file all slow has none, this file has its own."""
    assert fast_tests(TESTS / SLOW_FILES[0]) == []
    assert "test_every_slow_path_exists" in fast_tests(Path(__file__))
    assert fast_tests(TESTS / "runner" / "distributed" / "test_dist_training.py") == []  # pytestmark = slow
