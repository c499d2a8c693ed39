"""`pip install .` ships everything `python -m runner` needs, conf/ included, from any directory."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """Build the wheel and install it (no deps: they are in this venv) into a private target dir."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(ROOT)],
                   check=True, capture_output=True)
    wheel = next(tmp.glob("*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "runner/conf/config.yaml" in names
    for preset in ("sdxl_24gb", "flux_24gb", "constrained"):
        assert f"runner/conf/preset/{preset}.yaml" in names
    # hydra/sweeper=runner_lora, and the sweeper class in Hydra's plugin namespace (hydra_plugins/runner_sweeper/install.py)
    assert "runner/conf/hydra/sweeper/runner_lora.yaml" in names
    assert "hydra_plugins/runner_sweeper/optuna_sweeper.py" in names
    target = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    return target


def test_every_package_dir_is_in_the_wheel(installed):
    for pkg_dir, installed_as in (("runner", "runner"), ("plugins", "runner/plugins")):
        for init in (ROOT / pkg_dir).rglob("__init__.py"):
            rel = init.relative_to(ROOT / pkg_dir)
            assert (installed / installed_as / rel).is_file(), f"{pkg_dir}/{rel.parent} is missing from pyproject's packages list"
    assert not (installed / "plugins").exists(), "plugins/ must ship as runner.plugins, not as a top-level package"


def test_installed_runner_works_from_another_directory(installed, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(installed)}
    code = "import runner, sys; print(runner.__file__)"
    where = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert where.stdout.startswith(str(installed)), where.stdout + where.stderr
    r = subprocess.run([sys.executable, "-m", "runner", "+preset=sdxl_24gb", "--cfg", "job"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "preset: sdxl_24gb" in r.stdout
