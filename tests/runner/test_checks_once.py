"""Each plugin's settings are checked once in a train run: its node check (the torch-free stage) once,
its ``validate()`` against the resolved run once, however many stages (checks, session, preflight)
build the plugin."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.core.config_store import ConfigStore

from runner import registry
from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.context import RunContext
from runner.plugin import Plugin, PluginConfig

ROOT = Path(__file__).resolve().parents[2]
CALLS: dict[str, int] = {}


@dataclass
class CountingConfig(PluginConfig):
    name: str = "counting"
    calls_per_step: int = 1


def count_node_check(node: object, key: str) -> None:
    CALLS["check"] = CALLS.get("check", 0) + 1


class CountingPlugin(Plugin):
    """A tiling plugin that checks its settings and counts the steps it sees."""

    kind = "tiling"
    name = "counting"
    Config = CountingConfig

    def __init__(self, config: object, run: object) -> None:
        super().__init__(config, run)
        CALLS["built"] = CALLS.get("built", 0) + 1

    def validate(self) -> None:
        CALLS["validate"] = CALLS.get("validate", 0) + 1

    def on_step_end(self, ctx: RunContext, step: int) -> None:
        CALLS["steps"] = CALLS.get("steps", 0) + int(self.config.calls_per_step)


@pytest.fixture
def counting_plugin():
    registry.register_plugin(CountingPlugin)
    registry.declare_plugin("tiling", "counting", CountingConfig, f"{__name__}:CountingPlugin", check=count_node_check)
    CALLS.clear()
    yield
    del registry._PLUGINS[("tiling", "counting")]
    ConfigStore.instance().repo["tiling"].pop("counting.yaml", None)


def test_a_plugins_settings_are_checked_once_per_train_run(counting_plugin, tmp_path, monkeypatch, one_thread):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "assets"))
    cfg = compose_config(["trainer=custom", "trainer._target_=custom_trainer.PixelDiffusionTrainer", "data.resolution=16", "+tiling=counting", "train.device=cpu",
                          "train.steps=2", "train.progress=false", f"output_dir={tmp_path}"])
    task(cfg)
    assert (CALLS["check"], CALLS["validate"]) == (1, 1)
    assert CALLS["steps"] >= 2  # the plugin was in the run's steps (the preflight's simulated step calls it too)


def test_mode_plan_resolves_once_and_simulates_the_plugins_its_checks_built(counting_plugin, tmp_path, monkeypatch,
                                                                            one_thread):
    """mode=plan: one resolve and one build of each plugin, which the simulated step then runs."""
    import runner.checks as checks

    resolves = []
    real = checks.resolve_for_mode
    monkeypatch.setattr(checks, "resolve_for_mode", lambda cfg: resolves.append(1) or real(cfg))
    import runner.plan.simulate as simulate

    monkeypatch.setattr(simulate, "resolve", lambda *a, **k: pytest.fail("the plan resolved the run again"))
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "assets"))
    cfg = compose_config(["trainer=custom", "trainer._target_=custom_trainer.PixelDiffusionTrainer", "data.resolution=16",
                          "+tiling=counting", "train.device=cpu", "mode=plan", f"output_dir={tmp_path}"])
    task(cfg)
    assert (len(resolves), CALLS["check"], CALLS["built"], CALLS["validate"]) == (1, 1, 1, 1)
    assert CALLS["steps"] == 1  # the plan's one simulated step ran the plugin built by the checks


def test_a_declared_requirement_is_refused_by_the_jobs_checks(counting_plugin, monkeypatch):
    from runner.checks import validate
    from runner.errors import UserError

    monkeypatch.setattr(CountingPlugin, "requires", ("checkpoint/blocks",))
    with pytest.raises(UserError, match=r"tiling=counting needs checkpoint=blocks selected too"):
        validate(compose_config(["+tiling=counting", "train.device=cpu", "mode=plan", "checkpoint=none"]))
    validate(compose_config(["+tiling=counting", "train.device=cpu", "mode=plan", "checkpoint=blocks"]))
