"""mode=fit and train.auto_fit (runner/fit/): the search picks a configuration the planner confirms fits,
writes a preset that trains, says when nothing fits, and changes the math only when allowed.

On the tiny SDXL model planned for this CPU (train.device=cpu): the step at 64 px, batch 2, is
weights 8.5 MB + gradients 7.9 MB + AdamW state 15.8 MB + activations. The budgets below are
chosen from those figures so that exactly the stated savings are needed.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from bad_input import assert_clean_failure, run_main
from omegaconf import OmegaConf

from runner.cli.compose import compose_config
from runner.checks import validate
from runner.fit.search import fitted_overrides
from runner.fit.space import Knobs, overrides_for
from runner.output.report import read_metrics
from runner.plan import plan_step

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["train.device=cpu", "data.resolution=64", "train.max_grad_norm=0", "train.progress=false"]
MiB = 2**20


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # park's encoder cache, the CPU calibration


def fit_json(out: Path) -> dict:
    return json.loads((out / "fit.json").read_text())


def test_fit_needs_two_savings_confirms_a_fit_and_its_preset_trains(tmp_path):
    base = plan_step(compose_config(TINY))
    budget = base.required_bytes - 6.5 * MiB  # gradients (7.9 MB) must go, and then some activations
    out = tmp_path / "fit"
    r = run_main(["mode=fit", *TINY, f"budget_gb={budget / 2**30:.6f}", f"output_dir={out}"])
    assert r.code == 0, r.text[-3000:]
    assert "chosen:" in r.out and "+preset=fit" in r.out
    record = fit_json(out)
    winner = record["winner"]
    changed = [k for k, v in winner["knobs"].items() if v != record["base"]["knobs"][k] and k != "every_n"]
    assert len(changed) >= 2, changed
    assert winner["confirmed"] and winner["required_bytes"] <= budget
    assert winner["knobs"]["fused"]  # the only way to lose the gradients on a CPU without changing the math
    # The preset reproduces the chosen configuration...
    conf = Path(record["preset"]).parents[1]
    cfg = compose_config([f"hydra.searchpath=[file://{conf}]", "+preset=fit", "train.device=cpu"])
    validate(cfg)
    again = plan_step(cfg)
    assert again.required_bytes == winner["required_bytes"]
    # ... and so does the equivalent command line.
    assert plan_step(compose_config(winner["overrides"])).required_bytes == winner["required_bytes"]
    # Train with it: the preflight plan fits the budget the preset carries.
    run = tmp_path / "run"
    r = run_main([f"hydra.searchpath=[file://{conf}]", "+preset=fit", "train.device=cpu", "train.steps=2",
                  "train.progress=false", "export.enabled=false", f"output_dir={run}"])
    assert r.code == 0, r.text[-3000:]
    assert len(read_metrics(run / "metrics.jsonl")) == 2
    assert json.loads((run / "plan.json").read_text())["fits"]


def test_when_nothing_fits_it_says_so_and_names_the_closest_with_its_bytes_over(tmp_path):
    out = tmp_path / "fit"
    r = run_main(["mode=fit", *TINY, "budget_gb=0.01", f"output_dir={out}"])
    assert_clean_failure(r, "No configuration fits")
    assert r.code == 3
    assert "NOTHING FITS" in r.out and "Closest:" in r.out and "over the budget" in r.out
    closest = fit_json(out)["closest"]
    assert closest["confirmed"] and closest["required_bytes"] > 0.01 * 2**30
    assert not (out / "conf").exists()


def test_math_changing_settings_only_when_allowed(tmp_path):
    base = plan_step(compose_config(TINY))
    budget = (base.required_bytes - 20 * MiB) / 2**30  # below weights + state: only LoRA gets there
    r = run_main(["mode=fit", *TINY, f"budget_gb={budget:.6f}", f"output_dir={tmp_path / 'a'}"])
    assert r.code == 3 and "fit.allow=[lora]" in r.out, r.text[-3000:]
    r = run_main(["mode=fit", *TINY, f"budget_gb={budget:.6f}", "fit.allow=[lora]", f"output_dir={tmp_path / 'b'}"])
    assert r.code == 0, r.text[-3000:]
    assert fit_json(tmp_path / "b")["winner"]["knobs"]["train"] == "lora"


def test_auto_fit_trains_with_the_chosen_settings(tmp_path):
    base = plan_step(compose_config(TINY))
    budget = (base.required_bytes - 6.5 * MiB) / 2**30
    out = tmp_path / "run"
    r = run_main([*TINY, "train.auto_fit=true", f"budget_gb={budget:.6f}", "train.steps=2", "export.enabled=false",
                  f"output_dir={out}"])
    assert r.code == 0, r.text[-3000:]
    assert fit_json(out)["winner"]["knobs"]["fused"]
    assert json.loads((out / "plan.json").read_text())["run"]["optimizer"].endswith("fused backward")
    saved = (out / "checkpoints" / "step-00000002" / "config.yaml").read_text()
    assert "fused_backward: true" in saved  # a resume recomposes the chosen settings
    resolved = OmegaConf.load(out / "resolved_config.yaml")  # the run's record: the config it trained with
    assert resolved.optimizer.fused_backward is True and resolved.train.auto_fit is False


def test_overrides_replace_what_the_candidate_changes_and_keep_the_rest():
    cfg = compose_config(["+preset=sdxl_24gb"])
    user = ["+preset=sdxl_24gb", "+offload=activations", "optimizer.lr=1e-5", "mode=fit", "fit.top=3"]
    assert fitted_overrides(user) == ["+preset=sdxl_24gb", "+offload=activations", "optimizer.lr=1e-5"]
    from runner.fit.space import base_knobs

    base = base_knobs(compose_config(fitted_overrides(user)))
    assert base.park and base.activations and base.checkpoint == "full" and base.optimizer == "adamw8bit"
    k = Knobs(**{**base.__dict__, "stream_gb": 3.0, "activations": False, "checkpoint": "every_n", "micro": 1})
    over = overrides_for(k, base, cfg, fitted_overrides(user))
    assert "+offload=activations" not in over and "offload=[park,stream]" in over
    assert "offload.stream.device_budget_gb=3" in over and "train.grad_accum=2" in over
    assert "checkpoint.blocks.mode=every_n" in over and "optimizer.lr=1e-5" in over
    composed = compose_config(over)
    validate(compose_config([*over, "mode=plan"]))
    assert base_knobs(composed) == k


@pytest.mark.parametrize("optimizer, offered", [("adamw", [False, True]), ("lion8bit", [False, True]),
                                                ("prodigy", [False]), ("adamw_schedulefree", [False])])
def test_fused_backward_is_searched_only_for_optimizers_that_update_each_parameter_alone(optimizer, offered):
    """prodigy and adamw_schedulefree couple the parameters' updates: fused backward is refused for them
    (runner/optim/fused.py), so the search never proposes it."""
    from runner.fit.space import Space, base_knobs

    base = base_knobs(compose_config([f"optimizer={optimizer}"]))
    space = Space(base=base, batch=2, allow=frozenset(), on_cuda=True, max_grad_norm=0.0, precision="bf16",
                  trained_gib=1.0, streamable=True, cacheable=True)
    assert sorted(space.values()["fused"]) == offered
    for k in space.candidates():  # every candidate the search would try is one the runner accepts
        if k.fused:
            validate(compose_config([f"optimizer={optimizer}", "optimizer.fused_backward=true", "mode=plan"]))
            break


def test_host_ram_while_training_counts_the_offloaded_activations():
    """Offloaded activations wait on the host during forward and backward, not between steps: the plan's
    host_training_bytes holds them (and fit's host check reads it), host_steady_bytes does not."""
    from runner.fit.search import Candidate

    plan = plan_step(compose_config(["+preset=sdxl_24gb", "offload=[park,activations]", "checkpoint=none", "mode=plan"]))
    assert plan.host_pinned_bytes > 0
    assert plan.host_training_bytes >= plan.host_steady_bytes + plan.host_pinned_bytes
    cand = Candidate(knobs=None, overrides=[], estimate=None, plan=plan)
    assert cand.host_bytes == plan.host_training_bytes
    assert not cand.fits(limit=plan.required_bytes, host_limit=plan.host_training_bytes - 1)
    assert cand.fits(limit=plan.required_bytes, host_limit=plan.host_training_bytes)
