"""A sweep's objective and early stop, without a sweep: the ``sweep.*`` checks, the pruner reached through
the study's storage (as a job of ``hydra/sweeper=optuna`` reaches it), ``sweep.stop_if`` against sibling
jobs' metrics, and the best job's command."""
from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from runner.cli.compose import compose_config, expand_sweeps
from runner.adapters import lora_alpha
from runner.checks import check_config
from runner.errors import UserError
from runner.sweep.config import objective_values
from runner.sweep.report import best_lines, best_rows
from runner.sweep.watch import Watch, best_sibling, own_trial

optuna = pytest.importorskip("optuna")


@pytest.mark.parametrize("overrides, words", [
    (["sweep.objective=accuracy"], ["sweep.objective='accuracy'", "val_loss"]),
    (["sweep.objective=val_loss", "data.val_fraction=0"], ["sweep.objective=val_loss needs a held-out loss"]),
    (["sweep.stop_if=0.5", "data.val_fraction=0.25"], ["sweep.stop_if=0.5", "k > 1"]),
    (["sweep.stop_if=2"], ["sweep.stop_if needs a held-out loss"]),
    (["sweep.objective=[loss,s_per_step]", "sweep.direction=[minimize]"], ["sweep.direction has 1", "2"]),
    (["sweep.direction=down"], ["sweep.direction='down'", "minimize or maximize"]),
    (["model.lora_alpha_per_rank=0"], ["model.lora_alpha_per_rank=0", "multiple of model.lora_rank"]),
])
def test_each_sweep_key_is_checked_before_step_1(overrides, words):
    with pytest.raises(UserError) as e:
        check_config(compose_config(overrides))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_objectives_directions_and_alpha_per_rank():
    cfg = compose_config(["sweep.objective=[val_loss,s_per_step]", "data.val_fraction=0.25", "model.lora_rank=8",
                          "model.lora_alpha_per_rank=2"])
    check_config(cfg)
    assert objective_values(cfg, {"val_loss": 0.5, "s_per_step": 2, "final_loss": 9.0}) == [0.5, 2.0]
    assert lora_alpha(cfg.model) == 16.0
    assert lora_alpha(compose_config(["model.lora_alpha=3"]).model) == 3.0


def test_a_val_loss_objective_holds_out_a_tenth_unless_told_otherwise():
    assert compose_config(["sweep.objective=val_loss"]).data.val_fraction == 0.1
    assert compose_config(["sweep.objective=[s_per_step,val_loss]"]).data.val_fraction == 0.1
    assert compose_config([]).data.val_fraction == 0.0
    assert compose_config(["sweep.objective=val_loss", "data.val_path=/x"]).data.val_fraction == 0.0
    assert compose_config(["sweep.objective=val_loss", "data.val_fraction=0.3"]).data.val_fraction == 0.3


def test_an_optuna_interval_is_checked_at_both_ends():
    combos = expand_sweeps(["optimizer.lr=tag(log,interval(1e-5,1e-3))", "model.lora_rank=choice(4,8)"])
    assert combos == [["optimizer.lr=1e-05", "model.lora_rank=4"], ["optimizer.lr=1e-05", "model.lora_rank=8"],
                      ["optimizer.lr=0.001", "model.lora_rank=4"], ["optimizer.lr=0.001", "model.lora_rank=8"]]


def _hydra(tmp_path, num, pruner):
    return OmegaConf.create({"job": {"num": num}, "sweeper": {
        "storage": f"sqlite:///{tmp_path}/optuna.db", "study_name": "runner", "pruner": pruner}})


def test_a_job_finds_its_trial_in_the_storage_and_the_pruner_stops_it(tmp_path):
    """Trial 0 completed with val_loss 1.0 at steps 2 and 4. A job finds its trial by its job number (the trial's
    number) in the storage and reports there: trial 1's 0.9 at step 2 goes on, trial 2's 5.0 (above the
    median of 1.0) is pruned; without a pruner the value is reported and nothing stops."""
    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="runner", storage=storage)
    first = study.ask()
    first.report(1.0, 2)
    first.report(1.0, 4)
    study.tell(first, 1.0)
    study.ask(), study.ask(), study.ask()  # trials 1-3: RUNNING, as the sweeper leaves them while their jobs run
    pruner = {"_target_": "optuna.pruners.MedianPruner", "n_startup_trials": 1, "n_warmup_steps": 0}
    good = Watch(own_trial(_hydra(tmp_path, 1, pruner)))
    assert good.check(2, 0.9) is None
    assert good.check(3, None) is None  # no validation at this step: nothing reported
    reason = Watch(own_trial(_hydra(tmp_path, 2, pruner))).check(2, 5.0)
    assert reason is not None and "pruner stopped trial 2 at step 2" in reason
    assert Watch(own_trial(_hydra(tmp_path, 3, None))).check(2, 100.0) is None
    study.ask()  # trial 4: a held-out loss of NaN stops it at once (with a pruner), whatever the median says
    assert "pruner stopped trial 4 at step 2" in (Watch(own_trial(_hydra(tmp_path, 4, pruner))).check(2, math.nan) or "")
    trials = optuna.load_study(study_name="runner", storage=storage).trials
    assert [t.intermediate_values for t in trials[1:4]] == [{2: 0.9}, {2: 5.0}, {2: 100.0}]


def _metrics(path, rows):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_stop_if_compares_with_the_best_sibling_at_the_same_step(tmp_path):
    _metrics(tmp_path / "0_lr=1e-4", [{"step": 1, "loss": 1}, {"step": 2, "loss": 1, "val_loss": 1.0}])
    _metrics(tmp_path / "1_lr=2e-4", [{"step": 2, "loss": 1, "val_loss": 0.8}, {"step": 4, "val_loss": float("nan")}])
    own = tmp_path / "2_lr=1"
    _metrics(own, [{"step": 2, "val_loss": 0.1}])  # its own rows never count
    assert best_sibling(tmp_path, own, 2) == 0.8
    assert best_sibling(tmp_path, own, 4) is None  # only non-finite values there
    watch = Watch(stop_if=2.0, sweep_dir=tmp_path, own_dir=own)
    assert watch.check(2, 1.6) is None  # 1.6 <= 2 x 0.8
    reason = watch.check(2, 1.7)
    assert reason is not None and "above 2 x 0.8" in reason
    assert watch.check(4, 50.0) is None  # no sibling value at step 4 to compare with
    assert "nan" in (watch.check(4, float("nan")) or "")
    assert not Watch().active and Watch().check(2, 99.0) is None


def test_the_best_job_and_the_pareto_front_with_their_commands():
    rows = [{"job": 0, "status": "ok", "val_loss": 0.5, "s_per_step": 2.0, "overrides": ["optimizer.lr=1e-4"]},
            {"job": 1, "status": "ok", "val_loss": 0.4, "s_per_step": 3.0, "overrides": ["optimizer.lr=2e-4", "a=b c"]},
            {"job": 2, "status": "pruned", "val_loss": 0.1, "s_per_step": 1.0, "overrides": []},
            {"job": 3, "status": "ok", "val_loss": 0.6, "s_per_step": 3.5, "overrides": []}]
    assert [r["job"] for r in best_rows(rows, ["val_loss"], ["minimize"])] == [1]
    assert [r["job"] for r in best_rows(rows, ["val_loss"], ["maximize"])] == [3]
    assert [r["job"] for r in best_rows(rows, ["val_loss", "s_per_step"], ["minimize", "minimize"])] == [0, 1]
    cfg = compose_config(["sweep.objective=val_loss", "data.val_fraction=0.25"])
    text = "\n".join(best_lines(rows, cfg))
    assert "best by val_loss (minimize):" in text and "job 1: val_loss=0.4" in text
    assert "python -m runner optimizer.lr=2e-4 'a=b c'" in text


def test_sweep_samples_shows_each_jobs_newest_sample_in_a_row(tmp_path):
    from PIL import Image

    from runner.sweep.samples import LABEL_H, write_sweep_samples

    rows = []
    for job, colour in enumerate([(255, 0, 0), (0, 0, 255)]):
        d = tmp_path / f"{job}_lr={job}"
        for step, c in ((2, (0, 255, 0)), (10, colour)):  # the newest step's image is the one shown
            (d / "samples" / f"step-{step}").mkdir(parents=True)
            Image.new("RGB", (64, 64), c).save(d / "samples" / f"step-{step}" / "00-a-cat.png")
        rows.append({"job": job, "status": "ok", "dir": str(d)})
    rows.append({"job": 2, "status": "failed", "dir": str(tmp_path / "2_none")})  # no samples: no row
    out = write_sweep_samples(rows, tmp_path / "sweep_samples.png", size=32)
    with Image.open(out) as grid:
        assert grid.size == (160, 2 * (32 + LABEL_H))
        assert grid.getpixel((16, LABEL_H + 16)) == (255, 0, 0)
        assert grid.getpixel((16, 32 + 2 * LABEL_H + 16)) == (0, 0, 255)
    assert write_sweep_samples(rows[2:], tmp_path / "none.png") is None


def test_the_objective_against_each_swept_key_and_the_pareto_front(tmp_path):
    from runner.sweep.picture import swept_values, write_objective_plot

    rows = [{"job": i, "status": s, "val_loss": v, "s_per_step": t, "overrides": [f"optimizer.lr={lr}", f"model.lora_rank={k}",
                                                                                "train.steps=4"]}
            for i, (s, v, t, lr, k) in enumerate([("ok", 0.5, 2.0, 1e-5, 4), ("ok", 0.4, 3.0, 1e-3, 8),
                                                  ("pruned", 0.9, 1.0, 1e-2, 4), ("failed", None, None, 1e-4, 8)])]
    assert swept_values(rows) == {"model.lora_rank": ["4", "8", "4", "8"],
                                  "optimizer.lr": ["1e-05", "0.001", "0.01", "0.0001"]}
    one = compose_config(["sweep.objective=val_loss", "data.val_fraction=0.25"])
    assert write_objective_plot(rows, one, tmp_path / "a.png") == ["model.lora_rank", "optimizer.lr"]
    two = compose_config(["sweep.objective=[val_loss,s_per_step]", "data.val_fraction=0.25"])
    assert write_objective_plot(rows, two, tmp_path / "b.png") == ["model.lora_rank", "optimizer.lr", "pareto"]
    assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "b.png").stat().st_size > 0
    assert write_objective_plot(rows[:1], one, tmp_path / "c.png") is None  # one job: nothing swept
