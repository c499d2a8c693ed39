"""The plan follows the encoder cache (issue 46): the preflight counts park's cache entries and plans the
pre-pass only for what this run encodes; ``mode=plan`` reads no data and assumes a cold cache."""
from __future__ import annotations

import json

import pytest
from runner_setup import job

pytestmark = pytest.mark.usefixtures("one_thread")


def _plan(out) -> dict:
    return json.loads((out / "plan.json").read_text())


@pytest.mark.parametrize("preset", ["chroma_16gb", "flux_24gb"])
def test_the_card_peaks_where_its_plan_says_on_a_fresh_and_on_a_filled_cache(preset, tmp_path, monkeypatch):
    # The same cache_dir twice: the first run fills it (its plan has the pre-pass), the second reads it
    # whole (its plan has none). Before, the second run planned the first run's pre-pass: 0.783 of it.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    common = [f"+preset={preset}", "train.device=cuda_sim", "train.steps=2", f"offload.park.cache_dir={tmp_path / 'c'}"]
    for name in ("fresh", "filled"):
        s = job(tmp_path / name, *common)
        assert s["status"] == "ok", s.get("error")
        ratio = s["peak_memory_gb"] / s["planned_peak_gb"]
        assert 0.97 <= ratio <= 1.03, f"{preset}, {name} cache: the card peaked at {ratio:.3f} of its plan"
    fresh, filled = _plan(tmp_path / "fresh"), _plan(tmp_path / "filled")
    assert fresh["cache_fill"]["read"] and filled["cache_fill"]["read"]
    assert all(n == 0 < m for n, m in fresh["cache_fill"]["entries"].values())
    assert all(n == m > 0 for n, m in filled["cache_fill"]["entries"].values())
    assert fresh["cache_fill"]["parts"] == list(fresh["cache_fill"]["entries"]) and filled["cache_fill"]["parts"] == []
    in_fill = fresh["peak_phase"] == "setup, in cache fill"  # chroma: T5's pre-pass; flux: its VAE encodes in training
    assert in_fill == (preset == "chroma_16gb") and fresh["cache_fill"]["run_peak"] == ("pre-pass" if in_fill else "training")
    assert filled["cache_fill"]["run_peak"] == "training"
    assert filled["peak_bytes"] == fresh["cache_fill"]["training_peak_bytes"] <= fresh["peak_bytes"]
    assert {k: v for k, v in filled["phases"].items() if k != "setup"} == \
        {k: v for k, v in fresh["phases"].items() if k != "setup"}  # training is planned as before


def test_mode_plan_reads_no_data_and_says_it_assumes_a_cold_cache(tmp_path, capsys):
    from runner.__main__ import task
    from runner.cli.compose import compose_config
    from runner.cli.launch import run_job

    common = ["+preset=chroma_16gb", "train.device=cuda_sim", f"offload.park.cache_dir={tmp_path / 'c'}"]
    try:
        run_job(task, compose_config([f"output_dir={tmp_path / 'p'}", "mode=plan", *common]))
    except SystemExit:
        pass
    plan = _plan(tmp_path / "p")
    assert plan["cache_fill"]["read"] is False and plan["cache_fill"]["parts"] == ["latents", "text"]
    assert plan["peak_phase"] == "setup, in cache fill" and plan["cache_fill"]["run_peak"] == "pre-pass"
    assert not list((tmp_path / "c").rglob("*.safetensors"))  # nothing encoded
    out = capsys.readouterr().out
    assert "encoder cache not read (mode=plan reads no data): a cold cache assumed" in out
    assert "the run's peak is the pre-pass's" in out
