"""``hydra/sweeper=optuna``: hydra-optuna-sweeper's sweeper, with what the runner's trials need.

Hydra instantiates sweepers only from the ``hydra_plugins`` package, hence this folder. The runner stores
:class:`RunnerOptunaConf` as ``hydra/sweeper=optuna`` in place of the plugin's own config
(hydra_plugins/runner_sweeper/install.py), so the plugin's name runs this class. What differs from the plugin's sweeper:

- The objective(s) and their directions come from ``sweep.objective`` / ``sweep.direction`` (the job returns
  a :class:`~runner.sweep.config.TrialOutcome`), unless ``hydra.sweeper.direction`` is set.
- The study resumes: ``hydra.sweeper.n_trials`` is the study's total, so a killed sweep run again with the
  same ``hydra.sweep.dir`` (its SQLite storage) runs only the trials still missing; a trial the kill left
  ``RUNNING`` is marked failed (user attribute ``runner_killed``; its job ``killed`` in the summary) and not
  counted. A seeded sampler draws from seed + the trials already there, not the first run's draws again.
- A job number is its trial number, so a job can find its own trial in the storage and report to the
  pruner (runner/sweep/watch.py): the plugin's sweeper keeps the trial object to itself.
- ``hydra/sweeper=optuna`` with no search space and ``model.train=lora`` searches runner_lora's space
  (conf/hydra/sweeper/runner_lora.yaml); any ``hydra.sweeper.params`` or range on the command line replaces it.
- A failed job (status failed / oom / ...) is a failed trial and the sweep goes on; a pruned job is a pruned
  trial. (The plugin's ``max_failure_rate`` still applies: 1.0 in the runner's preset.)

Hydra's plugin scan runs this module without registering it in ``sys.modules``, so it has no
``from __future__ import annotations``: dataclasses resolve string annotations through ``sys.modules``.
"""
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf
from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
from omegaconf import OmegaConf

from runner.sweep.config import TrialOutcome, directions

if TYPE_CHECKING:  # optuna loads when a sweep starts, not when Hydra scans its plugins at every start
    import optuna

log = logging.getLogger("runner")

KILLED = "runner_killed"  # user attribute of a trial a killed sweep left RUNNING


@dataclass
class RunnerOptunaConf(OptunaSweeperConf):
    """``hydra/sweeper=optuna`` in the runner: the plugin's keys, with the runner's defaults and a pruner."""

    _target_: str = "hydra_plugins.runner_sweeper.optuna_sweeper.RunnerOptunaSweeper"
    direction: Any = None  # None: from sweep.objective / sweep.direction; else minimize | maximize | a list
    # The study lives in the sweep folder: the same command with the same hydra.sweep.dir continues it.
    storage: Any | None = "sqlite:///${hydra.sweep.dir}/optuna.db"
    study_name: str | None = "runner"
    n_trials: int = 20  # the study's total: a resumed sweep runs only the trials still missing
    n_jobs: int = 1  # trials per batch (the basic launcher runs a batch's jobs one after another)
    max_failure_rate: float = 1.0  # a failed or out-of-memory trial is recorded and the search goes on
    # Stops a trial whose held-out loss (each val.every steps) is worse than the median of earlier trials at that
    # step; null: none. Any optuna.pruners class (_target_: optuna.pruners.HyperbandPruner, ...).
    pruner: Any = field(default_factory=lambda: {"_target_": "optuna.pruners.MedianPruner", "n_startup_trials": 2,
                                                 "n_warmup_steps": 0})


class RunnerOptunaSweeper(OptunaSweeper):
    """The plugin's sweeper with a resumable trial count, the runner's objectives and a pruner setting."""

    def __init__(self, pruner: Any | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pruner = pruner  # used by each job (runner/sweep/watch.py), which reports to the study itself

    def sweep(self, arguments: list[str]) -> None:
        import optuna
        from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

        impl = self.sweeper
        if isinstance(impl.sampler, functools.partial) and impl.sampler.func == optuna.samplers.GridSampler:
            return super().sweep(arguments)  # the grid sampler's fixed trial count: the plugin's own loop
        impl._process_searchspace_config()
        space, fixed = create_params_from_overrides(impl._parse_sweeper_params_config() + list(arguments))
        for name in fixed:
            space.pop(name, None)
        if not space and impl.config.model.get("train") == "lora":
            space, fixed = create_params_from_overrides(_lora_space() + list(arguments))
            for name in fixed:
                space.pop(name, None)
            log.info("optuna: no search space given, so model.train=lora searches hydra/sweeper=runner_lora's: %s",
                     ", ".join(f"{k} {d}" for k, d in space.items()))
        if not space:
            log.warning("optuna: no search space, so every trial runs the same settings: use "
                        "hydra/sweeper=runner_lora, or give ranges ('optimizer.lr=tag(log,interval(1e-5,1e-3))', "
                        "'model.lora_rank=choice(4,8)') on the command line or under hydra.sweeper.params")
        dirs = impl._get_directions() if impl.direction is not None else directions(impl.config)
        study = optuna.create_study(study_name=impl.study_name, storage=impl.storage, sampler=impl.sampler,
                                    directions=dirs, load_if_exists=True)
        _reseed_on_resume(study, impl.config.hydra.sweeper.get("sampler"))
        done = _close_killed(study, Path(str(impl.config.hydra.sweep.dir)))
        to_go = impl.n_trials - done
        log.info("optuna: study %r in %s, %s; %d of %d trials done, %d to run", study.study_name, impl.storage,
                 "/".join(dirs), done, impl.n_trials, max(to_go, 0))
        while to_go > 0:
            batch = [study.ask() for _ in range(min(to_go, max(1, impl.n_jobs)))]
            overrides = impl._configure_trials(batch, space, fixed)
            returns = impl.launcher.launch(overrides, initial_job_idx=batch[0].number)  # job number = trial number
            for trial, ret in zip(batch, returns):
                _tell(study, trial, ret, len(dirs))
            to_go -= len(batch)
        _save_results(study, len(dirs), f"{impl.config.hydra.sweep.dir}/optimization_results.yaml")


def _lora_space() -> list[str]:
    """The search space of conf/hydra/sweeper/runner_lora.yaml as overrides (``optimizer.lr=tag(log,...)``)."""
    from runner.files import conf_dir

    params = OmegaConf.load(conf_dir() / "hydra" / "sweeper" / "runner_lora.yaml").params
    return [f"{k}={v}" for k, v in params.items()]


def _reseed_on_resume(study: "optuna.Study", sampler: Any) -> None:
    """A resumed study with a seeded sampler draws from seed + its trial count: the same seed again would repeat
    the first run's random draws (TPE's first trials), spending trials on settings already tried."""
    n = len(study.trials)
    if n and sampler is not None and sampler.get("seed") is not None:
        from hydra.utils import instantiate

        study.sampler = instantiate(sampler, seed=int(sampler.seed) + n)
        log.info("optuna: resumed study of %d trials: sampler seed %d + %d", n, int(sampler.seed), n)


def _close_killed(study: "optuna.Study", sweep_dir: Path) -> int:
    """Mark the trials a killed sweep left RUNNING as failed (their job folders ``killed``: runner/output/jobs.py);
    the number of trials that count as done."""
    from optuna.trial import TrialState

    from runner.output.jobs import mark_killed

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)):
        study._storage.set_trial_user_attr(t._trial_id, KILLED, True)
        study.tell(t.number, state=TrialState.FAIL)
        mark_killed(sweep_dir, t.number)
        log.info("optuna: trial %d was left running by an earlier sweep that stopped: marked failed", t.number)
    return sum(1 for t in study.get_trials(deepcopy=False) if not t.user_attrs.get(KILLED))


def _tell(study: "optuna.Study", trial: "optuna.Trial", ret: Any, n_objectives: int) -> None:
    """The job's end as the trial's state: complete with its values, pruned, or failed."""
    from optuna.trial import TrialState

    try:
        outcome = ret.return_value
    except Exception as e:  # noqa: BLE001 - the job raised through the launcher: a failed trial, the sweep goes on
        log.warning("optuna: trial %d failed: %s", trial.number, e)
        outcome = None
    if isinstance(outcome, TrialOutcome) and outcome.status == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
        return
    values = list(outcome.values) if isinstance(outcome, TrialOutcome) else []
    if len(values) == n_objectives and all(v is not None for v in values):
        study.tell(trial, values=values if n_objectives > 1 else values[0])
        return
    if isinstance(outcome, TrialOutcome):
        missing = [n for n, v in zip(outcome.objectives, values) if v is None]
        log.warning("optuna: trial %d has no value for %s: marked failed", trial.number, ", ".join(missing))
    study.tell(trial, state=TrialState.FAIL)


def _save_results(study: "optuna.Study", n_objectives: int, path: str) -> None:
    """optimization_results.yaml as the plugin writes it: the best trial, or the Pareto front."""
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not done:
        log.warning("optuna: no trial completed, so there is no best trial")
        return
    if n_objectives == 1:
        best = study.best_trial
        results: dict[str, Any] = {"name": "optuna", "best_params": best.params, "best_value": best.value}
    else:
        results = {"name": "optuna", "solutions": [{"params": t.params, "values": t.values} for t in study.best_trials]}
    OmegaConf.save(OmegaConf.create(results), path)
