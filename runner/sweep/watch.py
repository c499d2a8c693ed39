"""A sweep job's early stop, asked at each validation (runner/loop.py): Optuna's pruner or ``sweep.stop_if``.

Optuna: hydra-optuna-sweeper keeps its ``Trial`` objects in the sweeper, so the job finds its own trial in
the study's storage instead (the runner's sweeper makes the job number the trial number,
hydra_plugins/runner_sweeper/optuna_sweeper.py). This works for any launcher whose jobs see the sweep folder (the SQLite
file), in the sweeper's process or not. Each held-out loss is reported as the trial's intermediate value at
its step, and the pruner configured under ``hydra.sweeper.pruner`` decides.

``sweep.stop_if=k`` (any ``-m`` sweep): the job stops when its held-out loss is above k times the lowest
that another job of the same sweep folder wrote at the same step (their metrics.jsonl), or is not finite.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

log = logging.getLogger("runner")

SWEEPER = "hydra_plugins.runner_sweeper.optuna_sweeper.RunnerOptunaSweeper"


class Watch:
    """``check(step, val_loss)`` -> why the job stops now, or None. A no-op outside a sweep."""

    def __init__(self, trial: Any = None, stop_if: float | None = None, sweep_dir: Path | None = None,
                 own_dir: Path | None = None) -> None:
        self.trial, self.stop_if, self.sweep_dir, self.own_dir = trial, stop_if, sweep_dir, own_dir

    @property
    def active(self) -> bool:
        return self.trial is not None or self.stop_if is not None

    def check(self, step: int, val_loss: float | None) -> str | None:
        if val_loss is None or not self.active:
            return None
        if self.trial is not None:
            self.trial.report(float(val_loss), step)
            # A NaN held-out loss never recovers; Optuna's pruners do not all stop on it (MedianPruner did not)
            diverged = not math.isfinite(val_loss) and type(self.trial.study.pruner).__name__ != "NopPruner"
            if diverged or self.trial.should_prune():
                return f"Optuna's pruner stopped trial {self.trial.number} at step {step} (val_loss {val_loss:.6g})"
        if self.stop_if is not None:
            best = best_sibling(self.sweep_dir, self.own_dir, step)
            if not math.isfinite(val_loss):
                return f"sweep.stop_if: val_loss at step {step} is {val_loss}"
            if best is not None and val_loss > self.stop_if * best:
                return (f"sweep.stop_if={self.stop_if:g}: val_loss {val_loss:.6g} at step {step} is above "
                        f"{self.stop_if:g} x {best:.6g}, the lowest another job of the sweep had at that step")
        return None


def best_sibling(sweep_dir: Path | None, own_dir: Path | None, step: int) -> float | None:
    """The lowest finite val_loss at ``step`` among the other job folders of the sweep (their metrics.jsonl)."""
    from runner.output.report import read_metrics

    if sweep_dir is None or not sweep_dir.is_dir():
        return None
    best = None
    for d in sweep_dir.iterdir():
        path = d / "metrics.jsonl"
        if not path.is_file() or (own_dir is not None and d.resolve() == own_dir.resolve()):
            continue
        for row in read_metrics(path):
            v = row.get("val_loss")
            if row.get("step") == step and isinstance(v, (int, float)) and math.isfinite(v):
                best = v if best is None else min(best, v)
    return best


def build_watch(cfg: DictConfig, out: Path, world_size: int) -> Watch:
    """The job's watch: its Optuna trial in an Optuna sweep, ``sweep.stop_if`` in any ``-m`` sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return Watch()
    hc = HydraConfig.get()
    trial = own_trial(hc) if str(hc.sweeper.get("_target_", "")) == SWEEPER else None
    stop_if = cfg.sweep.get("stop_if")
    watch = Watch(trial, None if stop_if is None else float(stop_if), Path(str(hc.sweep.dir)), out)
    if watch.active and world_size > 1:
        log.warning("sweep: early stop (Optuna's pruner, sweep.stop_if) is off in a run of several processes: "
                    "each would have to agree on it; the job runs all its steps")
        return Watch()
    if watch.active and int(cfg.val.every) == 0:
        log.info("sweep: val.every=0, so the held-out loss is computed once, after the last step: the job "
                 "cannot stop early (set val.every=<steps>)")
    return watch


def own_trial(hc: Any) -> Any:
    """This job's ``optuna.trial.Trial`` (its number is the job number), on the study's storage, with the
    pruner of ``hydra.sweeper.pruner`` (Optuna's NopPruner when unset)."""
    import optuna
    from hydra.utils import instantiate

    sw = hc.sweeper
    if sw.get("storage") is None:
        log.warning("sweep: hydra.sweeper.storage=null keeps the study in the sweeper's memory, where a job cannot "
                    "report to it: no pruning (the preset's sqlite:///<sweep dir>/optuna.db allows it)")
        return None
    pruner = instantiate(sw.pruner) if sw.get("pruner") is not None else optuna.pruners.NopPruner()
    storage = optuna.storages.get_storage(str(sw.storage))
    study = optuna.load_study(study_name=str(sw.study_name), storage=storage, pruner=pruner)
    study_id = storage.get_study_id_from_name(str(sw.study_name))
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, int(hc.job.num))
    return optuna.trial.Trial(study, trial_id)
