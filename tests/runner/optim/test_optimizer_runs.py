"""The optimizers users asked for (issue 32), from the command line on the tiny default model.

One real ``python -m runner -m optimizer=prodigy,adamw_schedulefree,lion,lion8bit,came train.steps=3``
(one subprocess, one job per optimizer: the README's command, swept): every job trains its 3 steps,
its preflight plan counted the optimizer state the real optimizer then held, byte for byte, and each
optimizer's own behaviour shows in its outputs.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from runner.output import jobs
from runner.output.report import read_metrics

NEW = ("prodigy", "adamw_schedulefree", "lion", "lion8bit", "came")


def test_each_new_optimizer_trains_the_tiny_default_from_the_command_line(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-m", "runner", "-m", f"optimizer={','.join(NEW)}", "train.steps=3",
                        "train.progress=false", f"hydra.sweep.dir={tmp_path}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    with open(tmp_path / jobs.SWEEP_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(x["overrides"].split()[0], x["status"], x["steps_done"]) for x in rows] == [
        (f"optimizer={name}", "ok", "3") for name in NEW]
    for name, row in zip(NEW, rows):
        out = Path(row["dir"])
        metrics = read_metrics(out / "metrics.jsonl")
        assert [m["step"] for m in metrics] == [1, 2, 3] and all(math.isfinite(m["loss"]) for m in metrics)
        logged = re.search(rf"optimizer={name} state after the first step: (\d+) bytes", (out / "__main__.log").read_text())
        planned = json.loads((out / "plan.json").read_text())["optimizer_state_bytes"]
        assert logged and sum(planned.values()) == int(logged.group(1)) > 0, name
        final = out / "checkpoints" / "step-00000003"
        assert (final / "export").is_dir()
        groups = torch.load(final / "optimizer.pt", weights_only=True)["param_groups"]
        if name == "prodigy":  # its lr multiplies the step size it estimates, reported beside the loss
            assert all(m["lr"] == 1.0 for m in metrics) and all(m["prodigy_d"] > 0 for m in metrics)
            assert groups[0]["d"] == metrics[-1]["prodigy_d"]
        else:
            assert all("prodigy_d" not in m for m in metrics)
        if name == "adamw_schedulefree":  # saved in eval mode: the checkpoint holds the evaluated weights
            assert not any(g["train_mode"] for g in groups)
