"""Checkpoint loading unpickles nothing but tensors and plain values (weights_only=True).

A checkpoint folder someone sent you must not run code when resumed: a ``.pt`` file holding any
other object is refused with a UserError before anything in it is executed. Checkpoints of every
CPU optimizer still resume exactly, and so do ``rng.pt`` files of the earlier layout (numpy's RNG
key pickled as an ndarray).
"""
from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.output.report import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = ["train.steps=4", "train.save_every=2", "train.device=cpu", "train.progress=false"]
CKPT = Path("checkpoints") / "step-00000002"


def run_cfg(out: Path, *overrides: str) -> list[dict]:
    task(compose_config([f"output_dir={out}", *COMMON, *overrides]))
    return read_metrics(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread):
    """One uninterrupted 4-step run per optimizer, saved at step 2: {optimizer: (out_dir, losses)}."""
    cache: dict[str, tuple[Path, list[float]]] = {}

    def get(optimizer: str) -> tuple[Path, list[float]]:
        if optimizer not in cache:
            out = tmp_path_factory.mktemp(f"full-{optimizer}")
            rows = run_cfg(out, f"optimizer={optimizer}")
            assert [r["step"] for r in rows] == [1, 2, 3, 4]
            cache[optimizer] = (out, [r["loss"] for r in rows])
        return cache[optimizer]

    return get


def resume_losses(out: Path, ckpt: Path, optimizer: str) -> list[float]:
    rows = run_cfg(out, f"optimizer={optimizer}", f"train.resume={ckpt}")
    assert [r["step"] for r in rows] == [3, 4]
    return [r["loss"] for r in rows]


class _Payload:
    """Unpickling this creates ``marker`` (via os.system): proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


CPU_OPTIMIZERS = ["adamw", "adamw8bit", "adafactor", "prodigy", "adamw_schedulefree", "lion", "lion8bit", "came"]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / "step-00000004" / "trainable.safetensors")


@pytest.mark.parametrize("optimizer", CPU_OPTIMIZERS)
def test_resume_is_exact_for_every_cpu_optimizer(runs, tmp_path, optimizer):
    """4 steps straight vs 2 steps, saved, resumed, 2 more: the same losses and the same final weights and
    optimizer state, bit for bit (schedule-free: the checkpoints hold its evaluated weights and the resume
    recomputes the training point from them exactly as the straight run did after saving)."""
    out, full = runs(optimizer)
    for name in ("optimizer.pt", "scheduler.pt", "rng.pt"):  # every file loads with weights_only=True alone
        torch.load(out / CKPT / name, map_location="cpu", weights_only=True)
    resumed = tmp_path / "resumed"
    assert resume_losses(resumed, out / CKPT, optimizer) == full[2:]
    straight, cut = final_weights(out), final_weights(resumed)
    assert straight.keys() == cut.keys() and straight
    assert not [n for n in straight if not torch.equal(straight[n], cut[n])]
    state_a, state_b = (torch.load(o / "checkpoints" / "step-00000004" / "optimizer.pt", weights_only=True)["state"]
                        for o in (out, resumed))
    assert _tensors(state_a) and len(_tensors(state_a)) == len(_tensors(state_b))
    assert all(torch.equal(a, b) for a, b in zip(_tensors(state_a), _tensors(state_b)))


def _tensors(tree: object) -> list[torch.Tensor]:
    """Every tensor in a state_dict's state, in order (bitsandbytes nests its quantization state in a dict)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in _tensors(tree[k])]
    return []


@pytest.mark.parametrize("optimizer", CPU_OPTIMIZERS)
def test_the_planned_optimizer_state_is_the_real_ones_bytes(runs, optimizer):
    """The preflight plan (the planner's simulated step on fake tensors) against the real optimizer's state
    after 4 steps of the tiny SDXL U-Net (every storage of its saved state once: bitsandbytes' quantile maps
    are shared by every parameter)."""
    import json

    out, _ = runs(optimizer)
    planned = json.loads((out / "plan.json").read_text())["optimizer_state_bytes"]
    state = torch.load(out / "checkpoints" / "step-00000004" / "optimizer.pt", weights_only=True)["state"]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(state)}
    assert sum(planned.values()) == sum(storages.values()) > 0


def test_rng_file_of_the_earlier_layout_still_resumes_exactly(runs, tmp_path):
    out, full = runs("adamw")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(out / CKPT, ckpt)
    rng = torch.load(ckpt / "rng.pt", weights_only=True)
    name, key, pos, has_gauss, gauss = rng["numpy"]
    rng["numpy"] = (name, key.numpy().astype(np.uint32), pos, has_gauss, gauss)  # as np.random.get_state() gives
    torch.save(rng, ckpt / "rng.pt")
    with pytest.raises(pickle.UnpicklingError):  # numpy objects need the (rng.pt only) allowlist
        torch.load(ckpt / "rng.pt", weights_only=True)
    assert resume_losses(tmp_path / "resumed", ckpt, "adamw") == full[2:]


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng.pt"])
@pytest.mark.parametrize("fmt", ["torch.save", "pickle"])
def test_a_malicious_checkpoint_file_is_refused_and_nothing_runs(runs, tmp_path, name, fmt):
    out, _ = runs("adamw")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(out / CKPT, ckpt)
    marker = tmp_path / "pwned"
    payload = {"state": _Payload(marker), "param_groups": []}
    if fmt == "torch.save":
        torch.save(payload, ckpt / name)
    else:
        (ckpt / name).write_bytes(pickle.dumps(payload))

    # The payload is real: an unrestricted load runs it.
    if fmt == "torch.save":
        torch.load(ckpt / name, weights_only=False)
    else:
        pickle.loads((ckpt / name).read_bytes())
    assert marker.exists()
    marker.unlink()

    with pytest.raises(UserError) as e:
        run_cfg(tmp_path / "resumed", f"train.resume={ckpt}")
    msg = str(e.value)
    assert name in msg and "refused" in msg and "unpickling arbitrary" in msg, msg
    assert not marker.exists()
    metrics = tmp_path / "resumed" / "metrics.jsonl"
    assert not metrics.exists() or not read_metrics(metrics), "no step may run"


def test_a_truncated_checkpoint_file_is_still_reported_as_corrupt(runs, tmp_path):
    out, _ = runs("adamw")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(out / CKPT, ckpt)
    data = (ckpt / "optimizer.pt").read_bytes()
    (ckpt / "optimizer.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"optimizer\.pt is corrupt"):
        run_cfg(tmp_path / "resumed", f"train.resume={ckpt}")
    (ckpt / "optimizer.pt").write_bytes(b"")
    with pytest.raises(UserError, match=r"optimizer\.pt is corrupt"):
        run_cfg(tmp_path / "resumed2", f"train.resume={ckpt}")


def test_schedulefree_evaluates_and_saves_its_averaged_weights_and_sampling_changes_no_weight(tmp_path):
    """optimizer=adamw_schedulefree: samples and validation run on its evaluated weights and give the training
    point back bit for bit, so turning them on changes no loss and no weight; a resumed run (which samples
    at its first step) continues exactly; checkpoints and the export hold the evaluated weights."""
    sf = ["optimizer=adamw_schedulefree", "optimizer.lr=1e-3", "data.val_fraction=0.25"]
    evaluating = ["sample.every=1", "sample.steps=2", "sample.prompts=[a red circle]", "val.every=1"]
    plain = run_cfg(tmp_path / "plain", *sf)  # validation only after the last step
    busy = run_cfg(tmp_path / "busy", *sf, *evaluating)
    assert [r["loss"] for r in busy] == [r["loss"] for r in plain]
    assert [r["step"] for r in busy if "val_loss" in r] == [1, 2, 3, 4]
    assert len(list((tmp_path / "busy" / "samples").glob("step-*"))) == 5  # the start and every step
    weights = final_weights(tmp_path / "plain")
    for other in ("busy",):
        assert all(torch.equal(weights[n], t) for n, t in final_weights(tmp_path / other).items())

    resumed = run_cfg(tmp_path / "resumed", *sf, *evaluating, f"train.resume={tmp_path / 'plain' / CKPT}")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in plain][2:]
    assert all(torch.equal(weights[n], t) for n, t in final_weights(tmp_path / "resumed").items())

    final = tmp_path / "plain" / "checkpoints" / "step-00000004"
    groups = torch.load(final / "optimizer.pt", weights_only=True)["param_groups"]
    assert groups and not any(g["train_mode"] for g in groups)  # saved in eval mode, as schedulefree asks
    exported = load_file(final / "export" / "diffusers" / "unet" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(weights[f"unet.{n}"], t) for n, t in exported.items())  # the export: the same weights
