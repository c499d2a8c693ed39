"""A trainer drawing noise with the runner's helper from seeds its encode step computes is planned and
trained on the presets whose encode runs inside the planned step (no latent cache): tests/assets/noisy_encode_trainer.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from bad_input import run_main

ASSETS = str(Path(__file__).resolve().parents[2] / "assets")


@pytest.mark.parametrize("preset, cls", [("flux_24gb", "NoisyFlux"), ("flux_24gb_full", "NoisyFlux"),
                                         ("flux_kontext_24gb", "NoisyKontext")])
def test_per_sample_randn_in_the_encode_step_plans_and_trains(tmp_path, preset, cls):
    sys.path.insert(0, ASSETS)
    try:
        result = run_main([f"+preset={preset}", f"trainer._target_=noisy_encode_trainer.{cls}", "train.steps=2",
                           "train.progress=false", "data.demo_size=2", f"output_dir={tmp_path}",
                           f"hydra.run.dir={tmp_path / 'h'}"])
    finally:
        sys.path.remove(ASSETS)
    assert result.code == 0, result.text[-3000:]
    summary = json.loads((tmp_path / "job_summary.json").read_text())
    assert summary["status"] == "ok" and summary["planned_peak_gb"] > 0  # the preflight planned the step
