"""Exporting one checkpoint: the files, written atomically beside it, and the two ways in.

* :func:`export_after_training`: the end of a completed run exports its final checkpoint
  (``export.enabled``, default on), from the models in memory.
* :func:`export_command`: ``mode=export train.resume=<checkpoint or run dir>`` exports any saved
  checkpoint afterwards: the trainer's models are built on the CPU with the run's settings, the
  checkpoint's trained weights loaded (runner/state/checkpoint.py), and the files written. No
  training, no plan, no plugin.

Layout (``checkpoints/step-N/export/``): ``pytorch_lora_weights.safetensors`` and/or
``lora_kohya.safetensors`` (LoRA), or ``diffusers/`` and/or the single original-layout file
(full fine-tune, ``export.full_format``), and ``export.json``.
The folder is written as a hidden ``.tmp-export-<pid>`` and renamed into place, like the
checkpoint itself, so a reader sees a complete export or none.
"""
from __future__ import annotations

import copy
import gc
import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf, open_dict

from runner.errors import as_os_error, storage_error
from runner.export.config import export_config
from runner.export.ema import write_ema_exports
from runner.export.lora import write_lora_files
from runner.files import fix_tree_modes, remove_path, swap_in_folder
from runner.trainer import ModelSet

log = logging.getLogger("runner")

EXPORT_DIR = "export"
FULL_DIR = "diffusers"
INFO_FILE = "export.json"


def base_model(cfg: Any) -> str:
    """What the trained weights sit on: ``model.path``, or the random-init architecture."""
    path = cfg.model.get("path")
    if path:
        return str(path)
    return f"random init ({cfg.trainer.get('_target_', '?')}, model.size={cfg.model.get('size')}, seed {cfg.train.seed})"


def _denoiser(trainer: Any, models: ModelSet) -> str:
    name = getattr(trainer, "denoiser", None)
    if name in models.trained:
        return str(name)
    if len(models.trained) != 1:
        raise ValueError(f"cannot tell which trained module to export among {sorted(models.trained)}")
    return next(iter(models.trained))


def export_models(trainer: Any, models: ModelSet, ckpt: Path, cfg: Any, step: int) -> Path | None:
    """Write ``ckpt/export/`` from ``models`` (whose trained weights are ``ckpt``'s); its path.

    ``None`` when the trainer cannot say which diffusers pipeline it belongs to (a user's trainer
    without ``pipeline_class()``): then ``trainable.safetensors`` stays the only weights file, and
    the log says so.
    """
    ec = export_config(cfg)
    if not callable(getattr(trainer, "pipeline_class", None)):
        log.info("export: trainer %s has no pipeline_class()/pipeline(models), so no diffusers/kohya export is "
                 "written; %s/trainable.safetensors (the runner's resume format) holds the trained weights",
                 type(trainer).__qualname__, ckpt)
        return None
    pipeline_class = trainer.pipeline_class()
    lora = str(cfg.model.train) != "full"  # any adapter (lora, lokr, loha)
    info: dict[str, Any] = {
        "step": int(step),
        "checkpoint": str(ckpt),
        "trainer": str(cfg.trainer.get("_target_", type(trainer).__qualname__)),
        "pipeline": pipeline_class.__name__,
        "base_model": base_model(cfg),
        "preset": cfg.get("preset"),
        "train": str(cfg.model.train),
        "base_model_version": getattr(trainer, "kohya_base_model_version", None),
    }
    with _staging(ckpt) as tmp:
        files: list[str] = []
        if lora:
            own = getattr(trainer, "write_lora_exports", None)  # several trained LoRAs (Wan 2.2 A14B's two experts)
            if callable(own):
                files += own(pipeline_class, models, tmp, info, ec)
            else:
                name = _denoiser(trainer, models)
                files += write_lora_files(trainer, pipeline_class, name, models[name], tmp, info, ec)
        else:
            files += write_full_files(trainer, models, tmp, info, ec)
        files += write_ema_exports(trainer, models, ckpt, tmp, info, cfg, _denoiser(trainer, models), FULL_DIR)  # ema.*
        files += _keep_earlier(ckpt / EXPORT_DIR, tmp, files)  # another export.lora_format adds, never deletes
        info["files"] = files
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    dest = ckpt / EXPORT_DIR
    log.info("export: %s", ", ".join(str(dest / f) for f in files))
    return dest


def write_full_files(trainer: Any, models: ModelSet, folder: Path, info: dict[str, Any], ec: Any) -> list[str]:
    """A full fine-tune's files as ``export.full_format`` asks: ``diffusers/`` and/or the family's single
    original-layout file (runner/export/single_file.py; the family was checked before step 1)."""
    files: list[str] = []
    if ec.wants_full("diffusers"):
        trainer.pipeline(models).save_pretrained(str(folder / FULL_DIR), safe_serialization=True)
        files.append(FULL_DIR)
    if ec.wants_full("single_file"):
        from runner.export.single_file import write_single_file

        files.append(write_single_file(str(trainer.family), models, folder, info).name)
    return files


def _keep_earlier(dest: Path, tmp: Path, files: list[str]) -> list[str]:
    """The files of an earlier export of this checkpoint that this one does not write, copied into it.

    Why: ``mode=export export.lora_format=kohya`` after training replaced the whole folder, so the
    diffusers file written at the end of training was deleted. Both come from the same checkpoint's
    weights (the folder lives inside it), so keeping the other format's files is exact."""
    try:
        earlier = json.loads((dest / INFO_FILE).read_text()).get("files", [])
    except (OSError, ValueError):
        return []
    kept = []
    for name in earlier:
        src = dest / str(name)
        if name in files or "/" in str(name) or str(name).startswith("."):
            continue
        if src.is_dir():
            shutil.copytree(src, tmp / name)
        elif src.is_file():
            shutil.copy2(src, tmp / name)
        else:
            continue
        kept.append(str(name))
    if kept:
        log.info("export: kept from the earlier export of this checkpoint: %s", ", ".join(kept))
    return kept


def _pid_alive(pid: int) -> bool:
    """Whether another process with ``pid`` runs (its staging folder is still being written)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


@contextmanager
def _staging(ckpt: Path) -> Iterator[Path]:
    """A hidden folder in ``ckpt`` to write into, fsynced and renamed to ``ckpt/export`` on success.

    A failure removes it and leaves any earlier export as it was; a full disk or read-only
    folder becomes a StorageError that says the checkpoint itself is intact.
    """
    for old in ckpt.glob(".*-export-*"):  # what a killed export left
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            remove_path(old)
    tmp = ckpt / f".tmp-export-{os.getpid()}"
    dest = ckpt / EXPORT_DIR
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        yield tmp
        fix_tree_modes(tmp)  # safetensors and save_pretrained write 0600 temporaries; 0644/0755 as open() would
        for root, _, names in os.walk(tmp):
            for n in names:
                with open(os.path.join(root, n), "rb") as f:
                    os.fsync(f.fileno())
        swap_in_folder(tmp, dest)  # an earlier export is renamed aside, then removed
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        os_error = as_os_error(e, tmp)
        if os_error is not None:
            raise storage_error(
                os_error, f"Exporting checkpoint {ckpt}", tmp,
                advice=f"The checkpoint itself is intact: export it later with mode=export train.resume={ckpt}.",
            ) from None
        raise


def export_checkpoint(cfg: Any, ckpt: Path, run: Any = None, trainer: Any = None) -> Path | None:
    """Build the trainer's models on the CPU as the run did (seed, dtypes, LoRA), load ``ckpt``'s
    trained weights into them and export. Host RAM: one copy of the models, as at the run's start."""
    from accelerate.utils import set_seed

    from runner.parts import build_trainer, prepare_models
    from runner.resolved import resolve
    from runner.state.checkpoint import load_trainable_weights

    run = run if run is not None else resolve(cfg)
    trainer = trainer if trainer is not None else build_trainer(cfg, run)
    set_seed(run.seed)  # as the run did before build_models: random-init frozen modules come out the same
    models = prepare_models(trainer.build_models("cpu"), cfg.model, run)
    load_trainable_weights(ckpt, models)
    step = int(json.loads((ckpt / "state.json").read_text()).get("step", 0))
    return export_models(trainer, models, ckpt, cfg, step)


def export_after_training(ctx: Any, result: Any) -> Path | None:
    """Export the final checkpoint of a completed run (after teardown; a no-op when
    ``export.enabled=false``, when the run was interrupted, or when nothing was saved).

    A LoRA is exported from the models in memory: plugins never change the adapters. A full
    fine-tune needs every frozen module for its pipeline folder; when a plugin dropped or
    quantized one, the training models are released and the checkpoint is exported from a fresh
    CPU build instead (:func:`export_checkpoint`), which costs the load time once more.
    """
    cfg = ctx.cfg
    if not export_config(cfg).enabled or result.checkpoint is None or result.interrupted_by is not None:
        return None
    if not callable(getattr(ctx.trainer, "pipeline_class", None)):  # before any rebuild: there is nothing to export
        return export_models(ctx.trainer, ctx.models, result.checkpoint, cfg, result.steps_done)
    facts = ctx.facts
    if ctx.run.dist.sharded:  # dist=fsdp: no rank holds the whole weights; read them from the sharded checkpoint
        ctx.models = ctx.optimizer = None
        gc.collect()
        return export_checkpoint(cfg, result.checkpoint, ctx.run, ctx.trainer)
    if str(cfg.model.train) == "full" and (facts.dropped or facts.quantized):
        log.info("export: frozen modules were changed by plugins (dropped: %s; quantized: %s); "
                 "rebuilding them on the CPU for the pipeline folder",
                 ", ".join(sorted(facts.dropped)) or "none", ", ".join(sorted(facts.quantized)) or "none")
        ctx.models = ctx.optimizer = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return export_checkpoint(cfg, result.checkpoint, ctx.run, ctx.trainer)
    return export_models(ctx.trainer, ctx.models, result.checkpoint, cfg, result.steps_done)


def with_run_settings(cfg: Any, ckpt: Path) -> Any:
    """``cfg`` with the trainer, model, data, preset and seed of the run that saved ``ckpt``
    (its ``resolved_config.yaml``), so ``mode=export train.resume=<dir>`` needs no other override."""
    saved_path = ckpt.parent.parent / "resolved_config.yaml"
    if ckpt.parent.name != "checkpoints" or not saved_path.is_file():
        log.info("mode=export: no resolved_config.yaml beside %s; using this command's trainer and model settings", ckpt)
        return cfg
    saved = OmegaConf.load(saved_path)
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        if "trainer" in saved:
            cfg.trainer = saved.trainer  # untyped node: the saved trainer's own fields
        for key in ("model", "data"):  # typed nodes: merged into their schema
            if key in saved:
                cfg[key] = OmegaConf.merge(cfg[key], saved[key])
        cfg.preset = saved.get("preset")
        cfg.train.seed = saved.get("train", {}).get("seed", cfg.train.seed)
    log.info("mode=export: trainer, model and data settings of %s", saved_path)
    return cfg


def export_command(cfg: Any, out: Path) -> Path | None:
    """``mode=export``: export the checkpoint ``train.resume`` names; no training, no plan."""
    from runner.state.checkpoint import find_checkpoint

    ckpt = find_checkpoint(cfg.train.resume)
    path = export_checkpoint(with_run_settings(cfg, ckpt), ckpt)
    print(f"exported {ckpt} -> {path}" if path else f"nothing exported for {ckpt} (see the log)")
    return path
