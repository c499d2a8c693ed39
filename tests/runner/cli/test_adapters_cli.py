"""Every adapter runs on the tiny default from the command line and writes the files README's
adapter section promises (``python -m runner model.train=... train.steps=3``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

ADAPTERS = {  # command line -> the export files of the tiny default (SDXL)
    "dora": (["model.train=lora", "model.lora_dora=true"], ["pytorch_lora_weights.safetensors"]),
    "lokr": (["model.train=lokr"], ["lora_comfy.safetensors"]),
    "loha": (["model.train=loha"], ["lora_comfy.safetensors"]),
}


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_an_adapter_trains_three_steps_on_the_tiny_default(tmp_path, adapter):
    overrides, files = ADAPTERS[adapter]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "runner", *overrides, "train.steps=3", "train.progress=false",
                        f"output_dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    export = tmp_path / "checkpoints" / "step-00000003" / "export"
    assert json.loads((export / "export.json").read_text())["files"] == files
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line] == [1, 2, 3]
