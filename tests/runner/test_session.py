"""One setup (runner/session.py): a job validates once, scans its data folder once, builds each
plugin once and resolves once, on the command line and in hosted mode alike; a resume that composes
the config again on the checkpoint's command line validates that config once more."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from bad_input import run_main
from PIL import Image

import runner.cli.compose
import runner.checks
import runner.data
import runner.resolved
import runner.session
from runner.plugin import Plugin


def write_folder(root: Path, n: int = 4) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (40, 48), (40 * i, 100, 200)).save(root / f"img{i}.png")
        (root / f"img{i}.txt").write_text(f"a picture number {i}")
    return root


@pytest.fixture
def counts(monkeypatch) -> Counter:
    """How often each setup step ran: the config checks, the folder scans, the plugins built for
    the run (the planner's simulated copies are its own and not counted), the resolves."""
    seen: Counter = Counter()

    def counted(name, fn, when=lambda *a, **k: True):
        def wrapper(*args, **kwargs):
            if when(*args, **kwargs):
                seen[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    check = counted("validate", runner.checks.check_config)
    monkeypatch.setattr(runner.checks, "check_config", check)
    monkeypatch.setattr(runner.cli.compose, "check_config", check)
    monkeypatch.setattr(runner.data, "FolderDataset", counted("scan", runner.data.FolderDataset))
    resolve = counted("resolve", runner.resolved.resolve)
    monkeypatch.setattr(runner.resolved, "resolve", resolve)
    monkeypatch.setattr(runner.session, "resolve", resolve)
    init = Plugin.__init__

    def plugin_init(self, config, run):
        if not run.simulate:
            seen[f"plugin {self.kind}/{self.name}"] += 1
        init(self, config, run)

    monkeypatch.setattr(Plugin, "__init__", plugin_init)
    return seen


COMMON = ["train.steps=2", "train.batch_size=2", "train.progress=false", "train.device=cpu", "data.resolution=32"]


def test_a_command_line_job_validates_scans_builds_and_resolves_once(tmp_path, counts):
    data = write_folder(tmp_path / "data")
    out = tmp_path / "run"
    result = run_main([*COMMON, f"data.path={data}", f"output_dir={out}", f"hydra.run.dir={tmp_path / 'h'}",
                       "offload=[park]", "checkpoint=blocks", "tiling=vae"])
    assert result.code == 0, result.err
    assert (out / "metrics.jsonl").is_file()
    # each plugin (the default allocator and the three chosen) built once for the run; the folder
    # scanned once (at validation, handed to the trainer)
    assert counts == {"validate": 1, "scan": 1, "resolve": 1, "plugin allocator/default": 1, "plugin offload/park": 1,
                      "plugin checkpoint/blocks": 1, "plugin tiling/vae": 1}, counts


def test_a_resume_validates_its_recomposed_config_once_more(tmp_path, counts):
    data = write_folder(tmp_path / "data")
    out = tmp_path / "run"
    first = run_main([*COMMON, f"data.path={data}", f"output_dir={out}", f"hydra.run.dir={tmp_path / 'h1'}"])
    assert first.code == 0, first.err
    counts.clear()
    again = run_main([f"train.resume={out}", "train.steps=3", f"output_dir={tmp_path / 'run2'}",
                      f"hydra.run.dir={tmp_path / 'h2'}"])
    assert again.code == 0, again.err
    # the command line as typed (no data.path: the demo set), then the config composed on the
    # checkpoint's command line (its data.path, scanned once and handed to the trainer): two checks,
    # each resolving and building the plugins once; the job runs with the second's
    assert counts == {"validate": 2, "resolve": 2, "plugin allocator/default": 2, "scan": 1}, counts


def test_hosted_mode_validates_and_resolves_once(tmp_path, counts, monkeypatch):
    import runner.hosted

    monkeypatch.setattr(runner.hosted, "validate", runner.checks.validate)
    common = [o for o in COMMON if not o.startswith("train.batch_size")]  # a hosted loop's batches are its own
    run = runner.hosted.session([*common, "offload=[park]"], output_dir=tmp_path / "hosted")
    try:
        assert run.ctx.run is run.run
    finally:
        run.finish()
    assert counts == {"validate": 1, "resolve": 1, "plugin allocator/default": 1, "plugin offload/park": 1}, counts
