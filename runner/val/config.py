"""The ``val.*`` / ``data.val_*`` schema and checks, without torch (runner/val/holdout.py is the
held-out loss itself; runner/val/scores.py the CLIP and DINO scores of ``val.scores``).

Split from runner/val/holdout.py so that composing a run, ``--help`` and a config error never wait
for torch; the scan of a ``data.val_path`` folder (which imports the data code) is
:func:`check_val_path`, called by runner/checks.py's ``check_run`` beside ``data.path``'s.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from runner.errors import UserError, valid_list

SCORES_JSON = "scores.json"  # the run's CLIP / DINO scores (runner/val/scores.py)

# val.scores name -> the config.json model_type(s) its val.score_models.<name> folder may hold
SCORE_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "clip": ("clip",),                                  # transformers CLIPModel (image and text towers)
    "dino": ("dinov2", "dinov2_with_registers", "vit"),  # Dinov2Model (or a ViT, e.g. DINO v1) through AutoModel
}


@dataclass
class ScoreModels:
    """``val.score_models.*``: local folders of the models ``val.scores`` loads (safetensors only, never downloaded)."""

    clip: str | None = None  # a transformers CLIPModel folder (config.json, model.safetensors, tokenizer files)
    dino: str | None = None  # a transformers Dinov2Model folder (config.json, model.safetensors)


@dataclass
class ValConfig:
    """``val.*``: when and how the held-out loss of ``data.val_fraction`` / ``data.val_path`` is evaluated."""

    every: int = 0  # optimizer steps between evaluations; 0: only after the last step
    batch_size: Optional[int] = None  # held-out samples per forward; default: the training micro-batch
    seed: int = 0  # fixes the split and each held-out sample's noise and timestep, whatever train.seed
    scores: list[str] = field(default_factory=list)  # [clip, dino]: scores of the run's samples (runner/val/scores.py)
    score_models: ScoreModels = field(default_factory=ScoreModels)


def val_source(cfg: Any) -> tuple[float, Optional[str]]:
    data = cfg.get("data")
    return float(data.get("val_fraction", 0.0) or 0.0), data.get("val_path")


def check_val_config(cfg: Any) -> None:
    """Values of ``data.val_*`` and ``val.*``; a UserError naming the key (the ``data.val_path``
    folder's contents: :func:`check_val_path`)."""
    fraction, path = val_source(cfg)
    v = cfg.get("val")
    if not 0.0 <= fraction < 1.0:
        raise UserError(f"data.val_fraction={fraction!r} is not valid: give the share of the data set to hold out "
                        "for the validation loss, from 0 (none) to below 1 (e.g. 0.1).")
    if fraction > 0 and path is not None:
        raise UserError(f"data.val_fraction={fraction} and data.val_path={path!r} are both set: hold out part of "
                        "data.path (data.val_fraction) or use a separate folder (data.val_path), not both.")
    if v is None:
        return
    if int(v.every) < 0:
        raise UserError(f"val.every={v.every} is not valid: give the optimizer steps between evaluations of the "
                        "validation loss (e.g. 100), or 0 for one evaluation after the last step.")
    if v.batch_size is not None and int(v.batch_size) < 1:
        raise UserError(f"val.batch_size={v.batch_size} is not valid: give the held-out samples per forward pass "
                        "(at least 1), or leave it unset for the training micro-batch.")
    if not 0 <= int(v.seed) < 2**63:
        raise UserError(f"val.seed={v.seed} is not valid: give a whole number >= 0.")
    if int(v.every) > 0 and fraction == 0 and path is None:
        raise UserError(f"val.every={v.every} asks for a validation loss, but no data is held out: set "
                        "data.val_fraction=0.1 (hold out 10 % of data.path) or data.val_path=<folder of images with "
                        "captions>.")
    check_scores(cfg)


def score_names(cfg: Any) -> list[str]:
    """``val.scores`` as a list of names ([] when unset)."""
    v = cfg.get("val")
    value = v.get("scores") if v is not None else None
    if value is None:
        return []
    return [str(value)] if isinstance(value, str) else [str(x) for x in value]


def check_scores(cfg: Any) -> None:
    """``val.scores`` and ``val.score_models.*``: known names, samples to score, and each model folder
    (config.json of the right model type, safetensors weights, CLIP's tokenizer); a UserError naming the key."""
    names = score_names(cfg)
    for name in names:
        if name not in SCORE_MODEL_TYPES:
            raise UserError(f"val.scores={name!r} is not known: choose from {valid_list(name, SCORE_MODEL_TYPES)} "
                            "(or both, val.scores=[clip,dino]).")
    if len(set(names)) != len(names):
        raise UserError(f"val.scores={names} names a score twice: give each once, e.g. val.scores=[clip,dino].")
    models = cfg.val.get("score_models") or {}
    for name in SCORE_MODEL_TYPES:  # a folder given is checked even when its score is not asked for
        if models.get(name) is not None:
            check_score_folder(name, str(models.get(name)))
    if not names:
        return
    sample = cfg.get("sample")
    if sample is None or int(sample.get("every", 0)) == 0:
        raise UserError(f"val.scores={names} scores the run's samples, but sample.every=0 draws none: set "
                        "sample.every=<steps> and sample.prompts=[...] (the scores read samples/step-0, the base "
                        "model, and the last step).")
    tiny = str(cfg.model.get("size", "tiny")) == "tiny"
    for name in names:
        if models.get(name) is None and not tiny:
            raise UserError(f"val.score_models.{name} is not set, and val.scores names {name}: give a local folder "
                            f"of a transformers {'CLIPModel' if name == 'clip' else 'Dinov2Model'} with safetensors "
                            f"weights (val.score_models.{name}=/models/{'clip-vit-large-patch14' if name == 'clip' else 'dinov2-base'}); "
                            "nothing is downloaded. Only model.size=tiny scores with random-weight test models.")


def check_score_folder(name: str, folder: str) -> None:
    """``val.score_models.<name>``: a folder with config.json of a valid model type and safetensors weights."""
    key = f"val.score_models.{name}"
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise UserError(f"{key}={folder!r} is not a folder: give a local folder of a transformers model "
                        f"(config.json and model.safetensors), e.g. one saved by save_pretrained.")
    try:
        model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError) as e:
        raise UserError(f"{key}={folder!r} has no readable config.json ({type(e).__name__}): give a folder saved by "
                        "a transformers model's save_pretrained.") from None
    if model_type not in SCORE_MODEL_TYPES[name]:
        raise UserError(f"{key}={folder!r} holds a {model_type!r} model: give a folder of model_type "
                        f"{' or '.join(SCORE_MODEL_TYPES[name])}.")
    if not list(path.glob("*.safetensors")):
        raise UserError(f"{key}={folder!r} has no *.safetensors weights: the scores load safetensors only (never a "
                        "pickled .bin); save the model with save_pretrained(safe_serialization=True).")
    if name == "clip" and not any((path / f).is_file() for f in ("tokenizer.json", "vocab.json")):
        raise UserError(f"{key}={folder!r} has no tokenizer (tokenizer.json or vocab.json): save the CLIP "
                        "processor or tokenizer into the same folder (save_pretrained).")


def check_val_path(cfg: Any) -> None:
    """``mode=train`` with ``data.val_path``: the folder is scanned and checked now, before any
    model is built (imports the data code, so runner/checks.py calls it in ``check_run``)."""
    path = val_source(cfg)[1]
    if path is not None and cfg.get("mode") == "train":
        from runner.data import build_dataset

        with as_val_path():
            build_dataset(_with_path(cfg.data, str(path)))  # the folder's checks, before any model is built


@contextmanager
def as_val_path() -> Iterator[None]:
    """The data folder's own messages, naming the key the folder came from (data.val_path)."""
    try:
        yield
    except UserError as e:
        text = str(e).replace("data.path", "data.val_path")
        raise UserError(text.replace("to use the built-in demo set", "to hold out nothing")) from None


def _with_path(data_cfg: Any, path: str) -> Any:
    data = copy.deepcopy(data_cfg)
    data.path = path
    if hasattr(data, "get") and data.get("demo_prior"):  # the demo's prior set is training data, not held out
        data.demo_prior = 0
    return data
