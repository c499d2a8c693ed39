"""The run context (runner/context.py): typed claims refuse incompatible plugins; every module
change is undone in one place, even when the run fails; plugins never import the planner."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.module_changes import marked
from runner.plan import plan_step

ROOT = Path(__file__).resolve().parents[2]
BUILT: dict[str, torch.nn.Module] = {}


def test_incompatible_claims_name_both_plugins():
    cfg = compose_config(["offload=[park,stream]", "offload.stream.modules=[text_encoder]", "train.device=cpu"])
    with pytest.raises(UserError, match=r"offload=stream and offload=park both claim 'text_encoder' \(stream and drop\)"):
        plan_step(cfg)


def test_two_quantizations_of_one_module_are_refused():
    cfg = compose_config(["quantization=[nf4,fp8]", "model.train=lora", "train.device=cpu", "mode=plan"])
    with pytest.raises(UserError, match=r"quantization=(nf4|fp8) and quantization=(fp8|nf4) both claim 'unet' "
                                         r"\(quantize and quantize\)"):
        plan_step(cfg)


class FailingTrainer:
    """A working pixel trainer whose loss fails at its third call."""

    def __init__(self, cfg):
        from custom_trainer import PixelDiffusionTrainer

        self.inner = PixelDiffusionTrainer(cfg)
        self.calls = 0

    def build_models(self, device="cpu"):
        models = self.inner.build_models(device)
        if str(device) != "meta":
            BUILT["unet"] = models["unet"]
        return models

    def dataset(self):
        return self.inner.dataset()

    def example_batch(self, batch_size, device="meta"):
        return self.inner.example_batch(batch_size, device)

    def loss(self, models, batch):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("a bug in the user's loss")
        return self.inner.loss(models, batch)


def test_a_failing_run_still_undoes_every_plugin_change(tmp_path, monkeypatch, one_thread):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "assets"))
    cfg = compose_config(["trainer=custom", f"trainer._target_={__name__}.FailingTrainer", "data.resolution=16",
                          "checkpoint=blocks", "train.device=cpu", "train.steps=5", "train.progress=false",
                          f"output_dir={tmp_path}"])
    with pytest.raises(RuntimeError, match="a bug in the user's loss"):
        task(cfg)
    blocks = [m for m in BUILT["unet"].modules() if "forward" in m.__dict__ or marked(m, "checkpoint") is not None]
    assert blocks == [], "checkpoint wrappers left on the model after a failed run"


def test_plugins_never_import_the_planner():
    for path in sorted((ROOT / "plugins").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in names if m.startswith("runner.plan")], f"{path} imports the planner"


def test_the_core_imports_no_plugin_and_the_context_no_feature():
    """The core reads the plugins' declarations through the registry: no module of runner/ imports a
    plugin's module (only runner.plugins, which declares them all), and runner/context.py imports none
    of the features whose no-op objects the session injects."""
    for path in sorted((ROOT / "runner").rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in names if m.startswith("runner.plugins.")], f"{path} imports a plugin"
    tree = ast.parse((ROOT / "runner" / "context.py").read_text())
    guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for sub in node.body for n in ast.walk(sub)}
    runtime = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and id(n) not in guarded]
    features = ("runner.sampling", "runner.val", "runner.ema", "runner.compile", "runner.memory", "runner.output",
                "runner.data", "runner.distributed")
    assert not [m for m in runtime if m.startswith(features)], runtime
