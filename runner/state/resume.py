"""Resume on the checkpoint's own config, and refuse a resume that would change what was trained.

Why: a checkpoint only makes sense with the settings that produced it. Before this, a resume
re-composed the config from the new command line alone, so ``train.resume=X`` without repeating
the run's preset loaded an 8-bit optimizer's state into plain AdamW (``KeyError: 'exp_avg'``),
and a different LoRA rank died in ``copy_`` with a shape error.

How: every checkpoint stores, in ``config.yaml``, the command line that composed its run and the
composed config itself. On resume the config is composed again from the saved command line
followed by the new one (a key given in both takes the new value), so Hydra's own rules and the
schemas apply as in any run, and ``train.resume=X train.steps=500`` continues any run without
repeating its preset. The result is then compared with the saved config.

What may not change: the trainer, the model (size, weights, dtypes, train mode, LoRA rank, alpha
and targets), the optimizer's kind, quantization and the preset: they define the trained
weights and the optimizer state. A change there is refused before any model is built, in one
message that lists each difference. Everything else may change, and the log lists what did:
steps, the LR schedule and optimizer hyperparameters, saving, logging, data, the memory
plugins (resuming with another memory layout after an out-of-memory stop is the point), and the
distribution (``dist``, and the number of processes: a checkpoint of any format resumes on any
world size, runner/distributed/checkpoint.py).

The EMA of the weights (``ema.*``, runner/ema/average.py) may change too, because it is derived from the
trained weights and never feeds back into them or the optimizer: turning it on starts the average
from the resumed weights; turning it off leaves the checkpoint's ``ema.safetensors`` where it is;
``ema.device`` and ``ema.dtype`` only say where and in which precision the saved average is kept
(loaded there, bit for bit when the dtype is unchanged); ``ema.decay``/``every``/``start``/``warmup``
apply from the resumed step, like a changed learning rate. The held-out validation settings
(``data.val_*``, ``val.*``) may change as well; the curve is then not comparable with the earlier part.

Outside Hydra (a test or a script calling ``run(compose_config([...]))``), the command line is not
known: the config is used as given, and still compared with the saved one; ``mode=export`` then
takes the checkpoint's command line with only its own keys (mode, train.resume, output_dir).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.errors import UserError

log = logging.getLogger("runner")

SAVED_CONFIG = "config.yaml"
# What defines the trained weights and the optimizer state: a resume may not change these.
TRAINED = ("trainer", "model", "optimizer.name", "quantization", "preset")
# Never taken from the checkpoint's command line: where this run writes, what it is asked to do, and
# how many processes it runs on (a checkpoint resumes on another world size: runner/distributed/checkpoint.py).
OWN = ("train.resume", "output_dir", "mode", "dist.world_size")
_MISSING = object()


def saved_config_text(cfg: DictConfig, overrides: Sequence[str] | None) -> str:
    """``config.yaml`` of a checkpoint: the run's command line (null when unknown: not run by Hydra)
    and its composed config (unresolved)."""
    return OmegaConf.to_yaml(OmegaConf.create({"overrides": None if overrides is None else list(overrides),
                                               "config": OmegaConf.to_container(cfg, resolve=False)}))


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(saved: Sequence[str], new: Sequence[str]) -> list[str]:
    """The saved command line, less what the new one sets again or what is the new run's own, then the new one."""
    replaced = {_key(o) for o in new}
    kept = [o for o in saved if _key(o) not in replaced and not _key(o).startswith("hydra")
            and not any(_key(o) == k or _key(o).startswith(k + ".") for k in OWN)]
    return [*kept, *new]


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every leaf of a plain container; empty dicts and lists are leaves."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, node


def _under(path: str, prefixes: Sequence[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def differences(saved: Any, cfg: DictConfig) -> list[tuple[str, Any, Any]]:
    """(path, saved value, new value) of every leaf that differs, interpolations as written. A plugin
    kind whose selection changed is one entry (``quantization: [] -> ['nf4']``), not one per setting."""
    from runner.plugin import KINDS

    new_tree = OmegaConf.to_container(cfg, resolve=False)
    old, new = dict(_leaves(saved)), dict(_leaves(new_tree))
    out = []
    for kind in KINDS:
        before, after = sorted((saved.get(kind) or {}).keys()), sorted((new_tree.get(kind) or {}).keys())
        if before != after:
            out.append((kind, before, after))
    changed_kinds = {k for k, _, _ in out}
    out += [(p, old.get(p, _MISSING), new.get(p, _MISSING)) for p in sorted(old.keys() | new.keys())
            if not _under(p, OWN) and p.split(".")[0] not in changed_kinds and old.get(p, _MISSING) != new.get(p, _MISSING)]
    return out


def _show(value: Any) -> str:
    return "(unset)" if value is _MISSING else repr(value)


def load_saved(ckpt: Any) -> dict[str, Any] | None:
    path = ckpt / SAVED_CONFIG
    if not path.is_file():
        return None
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path), resolve=False)  # YAML only: nothing is executed
    except Exception as e:
        raise UserError(f"Checkpoint file {path} is corrupt ({str(e).splitlines()[0]}). Resume from another "
                        "checkpoint or start without train.resume.") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        raise UserError(f"Checkpoint file {path} does not hold a saved run config. Resume from another checkpoint.")
    return saved


def check_unchanged(saved_config: dict[str, Any], cfg: DictConfig, where: Any) -> list[tuple[str, Any, Any]]:
    """The allowed differences; a UserError listing the others (what the checkpoint trained)."""
    diffs = differences(saved_config, cfg)
    refused = [d for d in diffs if _under(d[0], TRAINED)]
    if refused:
        lines = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, a, b in refused)
        raise UserError(
            f"train.resume={cfg.train.resume}: this run would change what the checkpoint trained ({lines}). A "
            "checkpoint continues only with the trainer, model, LoRA settings, optimizer kind, quantization and "
            f"preset it was saved with (see {where}). Drop those overrides to resume, or start a new run "
            "without train.resume."
        )
    return [d for d in diffs if not _under(d[0], TRAINED)]


def resume_base(cfg: DictConfig, overrides: Sequence[str] | None = None) -> tuple[DictConfig, list[str] | None]:
    """The run's config and its effective command line; with ``train.resume``, composed on the
    checkpoint's saved command line and checked against its saved config (module docstring).

    ``overrides``: this run's command line; by default Hydra's, when Hydra runs the job.
    """
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None
    if not cfg.train.get("resume"):
        return cfg, None if overrides is None else list(overrides)
    from runner.state.checkpoint import find_checkpoint

    ckpt = find_checkpoint(cfg.train.resume)
    saved = load_saved(ckpt)
    if saved is None:
        log.info("resume: %s has no saved config (an older checkpoint); using this run's config as given", ckpt)
        return cfg, None if overrides is None else list(overrides)
    own = [f"{k}={OmegaConf.select(cfg, k)}" for k in OWN if OmegaConf.select(cfg, k) is not None]
    if overrides is None and cfg.mode == "export":  # export a checkpoint as it was trained
        if saved.get("overrides") is None:  # nor was its command line known: its config, with this run's own keys
            from runner.compose import compose_config

            cfg = OmegaConf.merge(compose_config(own), {k: v for k, v in saved["config"].items() if k not in OWN})
            cfg.mode, cfg.train.resume = "export", own_value(own, "train.resume")
            return cfg, None
        overrides = own
    effective = None if overrides is None else list(overrides)
    if overrides is not None:
        from hydra.initialize import get_gh_backup, restore_gh_from_backup

        from runner.compose import compose_config

        effective = merge_overrides(saved.get("overrides") or [], overrides)
        backup = get_gh_backup()  # composing must leave the running Hydra app's state as it was
        try:
            cfg = compose_config(effective)
        finally:
            restore_gh_from_backup(backup)
    allowed = check_unchanged(saved["config"], cfg, ckpt / SAVED_CONFIG)
    log.info("resume: from %s on its saved command line%s", ckpt,
             "; changed (saved -> now): " + ", ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, a, b in allowed)
             if allowed else " (nothing changed)")
    return cfg, effective


def own_value(own: Sequence[str], key: str) -> str:
    return next(o.split("=", 1)[1] for o in own if o.startswith(key + "="))
