"""``log.*``: which experiment tracker a run logs to (torch-free: composing and checking a config
never loads a tracker or torch; runner/output/trackers.py is the code)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from runner.errors import UserError, valid_list

# log.tracker -> (the module accelerate looks for, the pip package that provides it)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "comet_ml": ("comet_ml", "comet-ml"),
    "aim": ("aim", "aim"),
    "clearml": ("clearml", "clearml"),
    "dvclive": ("dvclive", "dvclive"),
    "swanlab": ("swanlab", "swanlab"),
    "trackio": ("trackio", "trackio"),
}


NONE = "none"


@dataclass
class LogConfig:
    """``log``: where per-step metrics, sample images and the resolved config go besides metrics.jsonl."""

    tracker: str = NONE  # none | tensorboard | wandb | mlflow | comet_ml | aim | clearml | dvclive | swanlab | trackio
    project: str = "diffusion-memory-runner"  # the tracker's project (W&B project, MLflow experiment, TensorBoard subfolder)
    logging_dir: Optional[str] = None  # trackers that write locally (tensorboard, ...); default <output_dir>/tracker
    every: int = 10  # without a terminal: one progress line in the log every this many steps (runner/output/progress.py)


def validate_log_config(log_cfg: Any) -> None:
    """Refuse an unknown tracker, a tracker whose package is missing, and a bad ``log.every``."""
    import importlib.util

    name = str(log_cfg.tracker)
    if name != NONE and name not in TRACKERS:
        raise UserError(f"log.tracker={name!r} is not a tracker the runner knows. "
                        f"Valid: {valid_list(name, [NONE, *TRACKERS])}.")
    if name != NONE:
        module, package = TRACKERS[name]
        alternatives = ("tensorboard", "tensorboardX") if name == "tensorboard" else (module,)
        if not any(importlib.util.find_spec(m) is not None for m in alternatives):
            raise UserError(f"log.tracker={name} needs the Python package '{package}', which is not installed "
                            f"in this environment. Install it (pip install {package}) or choose log.tracker=none "
                            "(metrics.jsonl is written in any case).")
    if int(log_cfg.every) < 1:
        raise UserError(f"log.every={log_cfg.every} must be a whole number of steps, 1 or more.")


def output_dir(cfg: Any) -> Path:
    """The run's output folder: ``output_dir``, else Hydra's run directory."""
    if cfg.output_dir:
        return Path(cfg.output_dir)
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    raise UserError("output_dir is not set and no Hydra run directory exists; set output_dir=<folder>.")
