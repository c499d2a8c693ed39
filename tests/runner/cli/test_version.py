"""runner.cli.version: the package's version from its metadata, or from the source tree's pyproject.toml."""
from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import runner
from runner.cli.version import runner_version, source_tree_version, version_line

ROOT = Path(__file__).resolve().parents[3]


def test_metadata_and_source_tree_agree():
    assert runner_version() == version("diffusion-memory-runner") == source_tree_version(ROOT / "pyproject.toml")
    assert runner.__version__ == runner_version()
    assert version_line() == f"runner (diffusion-memory-runner) {runner_version()}"


def test_source_tree_version_reads_the_project_table_only(tmp_path):
    toml = tmp_path / "pyproject.toml"
    toml.write_text('[tool.x]\nversion = "9.9"\n\n[project]\nname = "p"\nversion = "1.2.3"\n\n[tool.y]\nversion = "0"\n')
    assert source_tree_version(toml) == "1.2.3"
    toml.write_text('[project]\nname = "p"\ndynamic = ["version"]\n')
    assert source_tree_version(toml) is None
    assert source_tree_version(tmp_path / "missing.toml") is None


def test_without_metadata_the_source_tree_answers(monkeypatch):
    from importlib.metadata import PackageNotFoundError

    import runner.cli.version as v

    def missing(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(v, "version", missing)
    assert v.runner_version() == source_tree_version(ROOT / "pyproject.toml")
