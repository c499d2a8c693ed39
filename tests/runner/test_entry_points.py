"""Third-party plugins and trainers join through entry points of an installed distribution.

The test writes a real (minimal) installed distribution — a module plus its ``*.dist-info``
with ``entry_points.txt`` — into a directory on PYTHONPATH, which is exactly what ``pip
install`` of a third-party package leaves behind, and runs the CLI in a subprocess.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets"

PLUGIN_MODULE = '''
from dataclasses import dataclass
from runner.plugin import Plugin, PluginConfig

@dataclass
class StampConfig(PluginConfig):
    name: str = "stamp"
    label: str = "hello"

class StampPlugin(Plugin):
    """Third-party demo: writes a file in configure_process."""
    kind = "tiling"
    name = "stamp"
    Config = StampConfig
    description = "third-party demo plugin"

    def configure_process(self, ctx):
        (ctx.output_dir / "stamp.txt").write_text(self.config.label)
'''


def make_distribution(site: Path) -> None:
    (site / "runner_stamp.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    (site / "custom_trainer.py").write_text((ASSETS / "custom_trainer.py").read_text())
    info = site / "runner_stamp-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: runner-stamp\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[runner.plugins]\nstamp = runner_stamp:StampPlugin\n\n"
        "[runner.trainers]\npixels = custom_trainer:PixelDiffusionTrainer\n"
    )


def test_entry_point_plugin_and_trainer_are_discovered_and_run(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    make_distribution(site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    listing = subprocess.run([sys.executable, "-m", "runner", "mode=plugins"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert listing.returncode == 0, listing.stderr
    assert "third-party demo plugin" in listing.stdout and "tiling.stamp.label" in listing.stdout
    assert "pixels" in listing.stdout

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "runner", "trainer=pixels", "tiling=stamp", "tiling.stamp.label=from-cli",
                        "train.steps=2", "data.resolution=16", "train.progress=false", f"output_dir={out}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "stamp.txt").read_text() == "from-cli"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
