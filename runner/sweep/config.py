"""``sweep.*``: what a sweep's trial is judged by and when a job stops early (torch-free).

``sweep.objective`` names one or several columns of the job's summary (runner/output/jobs.py); a job of a
``-m`` sweep returns them to the sweeper (``hydra/sweeper=optuna``: hydra_plugins/runner_sweeper/), each
with its direction. ``sweep.stop_if=k`` stops a grid sweep's job whose held-out loss is above k times the
best that a sibling job reached at the same step (runner/sweep/watch.py); Optuna's pruner does the same
for an Optuna sweep.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.errors import UserError, valid_list
from runner.val.config import score_names

# sweep.objective -> (the job summary's key, its default direction)
OBJECTIVES: dict[str, tuple[str, str]] = {
    "loss": ("final_loss", "minimize"),            # mean training loss of the last 10% of steps
    "val_loss": ("val_loss", "minimize"),          # the last held-out loss (data.val_fraction / data.val_path)
    "s_per_step": ("s_per_step", "minimize"),
    "peak_memory_gb": ("peak_memory_gb", "minimize"),
    "clip_score": ("clip_score", "maximize"),      # the last samples' image-prompt cosine (val.scores=[clip])
    "dino_score": ("dino_score", "maximize"),      # the last samples' cosine to the training images (val.scores=[dino])
}
DIRECTIONS = ("minimize", "maximize")
# A sweep with only these ended well (exit status 0): does_not_fit is train.auto_fit's answer for a trial that no
# setting fits in budget_gb (runner/fit/command.py NothingFits), reported, not run; killed: a trial an earlier, killed
# run of the same Optuna study left unfinished, which the resumed study failed and replaced by another trial.
OK_STATUSES = ("ok", "pruned", "does_not_fit", "killed")


@dataclass
class SweepConfig:
    """``sweep.*``: the trial's objective(s), their direction(s), and the grid sweep's early stop."""

    objective: Any = "loss"  # loss | val_loss | s_per_step | peak_memory_gb | clip_score | dino_score, or a list
    direction: Any = None  # minimize | maximize (or a list, one per objective); default: each objective's own
    stop_if: float | None = None  # k: stop a job whose val_loss is above k x the best sibling's at that step


@dataclass
class TrialOutcome:
    """What a ``-m`` sweep's job returns to the sweeper: how it ended and its value of each objective."""

    status: str  # ok | pruned (a failed job returns None)
    objectives: list[str]
    values: list[float | None]


def trial_outcome(cfg: Any, status: str, summary: dict[str, Any] | None) -> TrialOutcome:
    values = objective_values(cfg, summary or {})
    return TrialOutcome(status, objectives(cfg), values)


class SweepStop(Exception):
    """The job stopped early on the sweep's request (Optuna's pruner or ``sweep.stop_if``): status ``pruned``;
    its last checkpoint is kept and exported."""

    status = "pruned"
    exit_code = 0


def objectives(cfg: Any) -> list[str]:
    """``sweep.objective`` as a list of names (one name or several)."""
    value = cfg.sweep.get("objective", "loss") if cfg.get("sweep") is not None else "loss"
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


def directions(cfg: Any) -> list[str]:
    """One direction per objective: ``sweep.direction`` (one for all, or a list) or each objective's default."""
    names = objectives(cfg)
    given = cfg.sweep.get("direction") if cfg.get("sweep") is not None else None
    if given is None:
        return [OBJECTIVES[n][1] if n in OBJECTIVES else "minimize" for n in names]
    if isinstance(given, str):
        return [given] * len(names)
    return [str(d) for d in given]


def objective_values(cfg: Any, summary: dict[str, Any]) -> list[float | None]:
    """The job's value of each objective, from its summary (None where the job has none)."""
    out = []
    for name in objectives(cfg):
        v = summary.get(OBJECTIVES[name][0])
        out.append(float(v) if isinstance(v, (int, float)) else None)
    return out


def check_sweep_config(cfg: Any) -> None:
    """``sweep.*`` and ``model.lora_alpha_per_rank``: a UserError naming the key and what is valid."""
    per_rank = cfg.model.get("lora_alpha_per_rank")
    if per_rank is not None and not (isinstance(per_rank, (int, float)) and per_rank > 0):
        raise UserError(f"model.lora_alpha_per_rank={per_rank!r} is not valid: give alpha as a multiple of "
                        "model.lora_rank (e.g. 1 or 2), or leave it unset to use model.lora_alpha.")
    s = cfg.get("sweep")
    if s is None:
        return
    names = objectives(cfg)
    if not names:
        raise UserError("sweep.objective=[] is empty: name at least one of " + ", ".join(OBJECTIVES) + ".")
    for name in names:
        if name not in OBJECTIVES:
            raise UserError(f"sweep.objective={name!r} is not known: choose from {valid_list(name, OBJECTIVES)} "
                            "(or a list of them, e.g. sweep.objective=[val_loss,s_per_step]).")
    dirs = directions(cfg)
    for d in dirs:
        if d not in DIRECTIONS:
            raise UserError(f"sweep.direction={d!r} is not valid: choose minimize or maximize (or a list, one per "
                            "objective).")
    if len(dirs) != len(names):
        raise UserError(f"sweep.direction has {len(dirs)} entries but sweep.objective names {len(names)} "
                        f"({', '.join(names)}): give one direction for each, or one for all.")
    for name in names:
        score = name.removesuffix("_score")
        if name.endswith("_score") and score not in score_names(cfg):
            raise UserError(f"sweep.objective={name} needs the {score} score of the samples: add val.scores=[{score}] "
                            "(and sample.every=<steps> with sample.prompts=[...]).")
    stop = s.get("stop_if")
    if stop is not None and not (isinstance(stop, (int, float)) and stop > 1):
        raise UserError(f"sweep.stop_if={stop!r} is not valid: give k > 1 to stop a job whose val_loss is above k x "
                        "the best val_loss another job of the sweep reached at the same step (e.g. 2).")
    needs_val = "val_loss" in names or stop is not None
    data = cfg.get("data")
    held = float(data.get("val_fraction", 0) or 0) > 0 or data.get("val_path") is not None
    if needs_val and not held and cfg.get("mode", "train") == "train":
        key = "sweep.stop_if" if stop is not None else "sweep.objective=val_loss"
        raise UserError(f"{key} needs a held-out loss, but no data is held out: set data.val_fraction=0.1 (and "
                        "val.every=<steps> for a value at each validation), or data.val_path=<folder>.")
