"""SLURM sweeps through hydra-submitit-launcher, run here with its local executor.

``hydra/launcher=submitit_local`` goes through the same launcher code as ``submitit_slurm`` (the
plugin's one ``BaseSubmititLauncher``; only the executor differs): the sweep's jobs are pickled and
run in fresh processes with submitit's job environment, ``tasks_per_node`` tasks each. With two
tasks per job, each job is a two-rank ``dist=ddp`` run, as one job of ``hydra/launcher=slurm`` is
on a cluster (runner/distributed/launch.py turns submitit's tasks into ranks).

The launcher is the ``slurm`` extra (``pip install '.[slurm]'``, also in the ``test`` extra CI
installs); without it these tests skip.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the slurm extra is not installed")

ROOT = Path(__file__).resolve().parents[3]


def test_the_shipped_slurm_launcher_config_runs_one_rank_per_gpu():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from runner import registry
    from runner.files import conf_dir

    from runner.config import load_all
    load_all()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["hydra/launcher=slurm", "hydra.launcher.nodes=2",
                                                       "hydra.launcher.gpus_per_node=4", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"].endswith("SlurmLauncher")
    assert (launcher["nodes"], launcher["gpus_per_node"], launcher["tasks_per_node"]) == (2, 4, 4)
    assert launcher["partition"] == "gpu" and launcher["timeout_min"] == 720


@pytest.mark.slow
def test_a_submitit_sweep_runs_two_jobs_of_two_ranks_and_summarises_both(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
         "hydra.launcher.timeout_min=15", "dist=ddp", "optimizer.lr=1e-4,1e-3", "train.steps=2", "train.progress=false",
         "train.preflight=false", "export.enabled=false", "data.demo_size=4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweeps = list((tmp_path / "multirun").glob("*/*"))
    assert len(sweeps) == 1
    rows = list(csv.DictReader((sweeps[0] / "sweep_summary.csv").open()))
    assert [r["job"] for r in rows] == ["0", "1"] and {r["status"] for r in rows} == {"ok"}
    assert ["optimizer.lr=0.0001" in r["overrides"] for r in rows] == [True, False]
    for r in rows:
        job = Path(r["dir"])
        assert json.loads((job / "job_summary.json").read_text())["steps_done"] == 2
        metrics = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        # two ranks took the global batch of 2: one sample each (one process would take both at once)
        assert [m["micro_batch_size"] for m in metrics] == [1, 1]
        assert "rank 0 of 2, DDP" in next(job.glob("*.log")).read_text()
    assert "sweep: 2 jobs, 2 ok" in proc.stdout
