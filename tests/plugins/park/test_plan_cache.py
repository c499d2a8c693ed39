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
    # the fill time is planned for the entries the preflight counted missing, none for the filled cache
    assert fresh["cache_fill"]["fill"]["entries"] == {p: m for p, (_, m) in fresh["cache_fill"]["entries"].items()}
    assert fresh["cache_fill"]["fill"]["seconds"] > 0 and filled["cache_fill"]["fill"] is None
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


def test_an_nf4_filled_cache_is_never_read_as_bf16(tmp_path, monkeypatch):
    # The text entries' keys hold the text encoders' quantization and dtype (the quantization plugin's
    # settings): a bf16 run re-encodes them, reading only the latents; an nf4 run again reads them all,
    # as its preflight counts (the planner keys as the run does).
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    common = ["offload=park", f"offload.park.cache_dir={tmp_path / 'c'}", "model.train=lora", "train.steps=1",
              "data.demo_size=4", "model.dtype=bfloat16"]
    nf4 = ["quantization=nf4", "quantization.nf4.modules=[text_encoder,text_encoder_2]"]
    runs = {"nf4": [*common, *nf4], "bf16": common, "nf4 again": [*common, *nf4]}
    counted = {}
    for name, overrides in runs.items():
        s = job(tmp_path / name.replace(" ", "_"), *overrides)
        assert s["status"] == "ok", s.get("error")
        counted[name] = _plan(tmp_path / name.replace(" ", "_"))["cache_fill"]["entries"]
    assert counted["nf4"] == {"latents": [0, 4], "text": [0, 4]}
    assert counted["bf16"] == {"latents": [4, 4], "text": [0, 4]}  # not the nf4 embeddings
    assert counted["nf4 again"] == {"latents": [4, 4], "text": [4, 4]}


def test_the_cache_keys_hold_the_encoders_dtype():
    # model.dtype is the frozen encoders' dtype (a CPU run keeps float32, so resolved for a CUDA target).
    from runner.parts import build_trainer
    from runner.cli.compose import compose_config
    from runner.plan.target import DEVICE
    from runner.resolved import resolve

    def signature(dtype: str) -> dict:
        cfg = compose_config(["train.mixed_precision=bf16", f"model.dtype={dtype}", "model.train=lora"])
        return build_trainer(cfg, resolve(cfg, target="cuda", device=DEVICE)).cache_signature("text")

    bf16, fp32 = signature("bfloat16"), signature("float32")
    assert {m["dtype"] for m in bf16["modules"].values()} == {"bfloat16"}
    assert {m["dtype"] for m in fp32["modules"].values()} == {"float32"}
