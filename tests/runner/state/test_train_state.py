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


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adafactor"])
def test_resume_is_exact_for_every_cpu_optimizer(runs, tmp_path, optimizer):
    out, full = runs(optimizer)
    for name in ("optimizer.pt", "scheduler.pt", "rng.pt"):  # every file loads with weights_only=True alone
        torch.load(out / CKPT / name, map_location="cpu", weights_only=True)
    assert resume_losses(tmp_path / "resumed", out / CKPT, optimizer) == full[2:]


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
