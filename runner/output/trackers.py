"""Experiment trackers (``log.tracker=tensorboard|wandb|mlflow|...``), through accelerate.

accelerate already wraps every common tracker behind one API (``Accelerator(log_with=...)``,
``init_trackers``, ``accelerator.log``), so the runner does not talk to TensorBoard, W&B or MLflow
itself. This module only adds what accelerate leaves to its user:

* validation: accelerate silently drops a tracker whose package is not installed (a debug log
  line), so a run with ``log.tracker=wandb`` and no ``wandb`` would train without logging
  anything. :func:`validate_log_config` refuses it before anything is built;
* the values: a metrics.jsonl row holds ``None`` (a CUDA column on CPU) and strings; trackers
  take numbers, so rows are filtered to finite-or-NaN numbers. The resolved config goes in as
  hyperparameters (flattened to dotted keys, lists as text: TensorBoard's ``add_hparams`` takes
  scalars only) and, on TensorBoard, as one YAML text entry that reads like resolved_config.yaml;
* images: each tracker wants them in its own form (TensorBoard a batch array, MLflow one call per
  image, the rest a list of PIL images), which :meth:`Tracking.log_images` hides.

metrics.jsonl stays the run's own record; a tracker is a view of it. ``log.tracker=none`` (the
default) is :class:`NoTracking`, whose methods do nothing, so the loop calls them unconditionally.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Protocol

from runner.output.config import NONE, LogConfig

log = logging.getLogger("runner")


def logging_dir(log_cfg: Any, output_dir: Path) -> Path:
    return Path(log_cfg.logging_dir) if log_cfg.logging_dir else output_dir / "tracker"


def accelerator_kwargs(log_cfg: Any, output_dir: Path | None) -> dict[str, Any]:
    """The keyword arguments of ``Accelerator(...)`` that select the tracker: none for ``none``."""
    if log_cfg is None or str(log_cfg.tracker) == NONE or output_dir is None:
        return {}
    return {"log_with": str(log_cfg.tracker), "project_dir": str(logging_dir(log_cfg, output_dir))}


class Tracking(Protocol):
    """What the loop (and the sampler) call; :class:`NoTracking` when ``log.tracker=none``."""

    def log_metrics(self, step: int, row: dict[str, Any]) -> None: ...
    def log_images(self, step: int, images: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class NoTracking:
    """``log.tracker=none``: every call is a no-op, so callers need no ``if``."""

    def log_metrics(self, step: int, row: dict[str, Any]) -> None:
        pass

    def log_images(self, step: int, images: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class AccelerateTracking:
    """The trackers of an ``Accelerator`` built with ``log_with`` (runner/loop.py:make_accelerator)."""

    def __init__(self, accelerator: Any, project: str, config: dict[str, Any] | None = None) -> None:
        self.accelerator = accelerator
        hparams = flat_hparams(config or {})
        accelerator.init_trackers(project, config=hparams)
        if config is not None:
            from omegaconf import OmegaConf

            text = "```\n" + OmegaConf.to_yaml(OmegaConf.create(config)) + "```"  # markdown: TensorBoard renders it
            for tracker in accelerator.trackers:
                if tracker.name == "tensorboard":
                    tracker.log({"resolved_config": text}, step=0)
        self._closed = False

    def log_metrics(self, step: int, row: dict[str, Any]) -> None:
        values = {k: float(v) for k, v in row.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if values:
            self.accelerator.log(values, step=step)

    def log_images(self, step: int, images: dict[str, Any]) -> None:
        """``{name: PIL image}`` at ``step``, in each tracker's own form (see the module docstring)."""
        import numpy as np

        arrays = {name: np.asarray(img.convert("RGB")) for name, img in images.items()}
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":
                for name, a in arrays.items():
                    tracker.writer.add_images(name, a[None], global_step=step, dataformats="NHWC")
                tracker.writer.flush()
            elif tracker.name == "mlflow":
                import mlflow

                for name, img in images.items():
                    mlflow.log_image(img, key=name, step=step)
            elif hasattr(tracker, "log_images"):
                tracker.log_images({name: [img] for name, img in images.items()}, step=step)
            else:
                log.debug("tracker %s takes no images; skipped %d at step %d", tracker.name, len(images), step)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.accelerator.end_training()


def flat_hparams(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"steps": 3}}`` -> ``{"train.steps": 3}``; lists and other values as text.

    TensorBoard's ``add_hparams`` takes only bool/int/float/str/None values (a list raises), and
    every other tracker accepts that form too.
    """
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_hparams(value, name + "."))
        elif value is None or isinstance(value, (bool, int, str)):
            out[name] = value
        elif isinstance(value, float):
            out[name] = value if math.isfinite(value) else str(value)
        else:
            out[name] = str(value)
    return out


def start_tracking(accelerator: Any, cfg: Any) -> Tracking:
    """The run's tracking: :class:`NoTracking` unless the accelerator was built with a tracker."""
    if accelerator is None or not getattr(accelerator, "log_with", None):
        return NoTracking()
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(cfg, resolve=True) if cfg is not None else None
    log_cfg = cfg.get("log") if cfg is not None else None
    project = str(log_cfg.project) if log_cfg is not None else LogConfig.project
    return AccelerateTracking(accelerator, project, config)
