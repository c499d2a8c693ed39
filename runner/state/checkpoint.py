"""Atomic training checkpoints and resume.

Why our own format and not ``accelerate.Accelerator.save_state``: that writes whole models
(including a frozen multi-GB base next to a few MB of LoRA weights) and writes in place, so a
crash mid-write leaves a half checkpoint that looks complete. Here a checkpoint is a directory::

    checkpoints/step-00000010/
        trainable.safetensors   trained parameters only (full fine-tune or LoRA), by name
        optimizer.pt            optimizer state_dict
        scheduler.pt            LR scheduler state_dict
        rng.pt                  torch CPU (and CUDA) RNG states, python and numpy RNG
        state.json              step, samples seen, micro-batch size, format version
        config.yaml             the run's composed config: the base of a resume (runner/state/resume.py)
        trained.json            parameter names, shapes, dtypes; optimizer kind and state layout
    checkpoints/latest          name of the newest complete checkpoint

It is written into a hidden temporary directory, each file fsynced, then renamed into place;
``latest`` is replaced atomically afterwards. A reader therefore sees either the previous
checkpoint or the new one, never a torn one.

The ``.pt`` files hold only tensors, numbers, strings, ``None`` and plain containers, and are read
with ``torch.load(weights_only=True)``: a checkpoint someone sent you cannot run code when resumed.
A file that would need any other object unpickled is refused with a :class:`UserError`. The one
non-plain object the runner used to write, numpy's RNG key (an ``ndarray``), is now saved as an
int64 tensor; ``rng.pt`` files of the earlier layout load with numpy's array reconstruction (and
nothing else) allowlisted.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from runner.errors import UserError, as_os_error, storage_error
from runner.files import fix_tree_modes, swap_in_folder
from runner.guards.nonfinite import check_finite_weights
from runner.trainer import ModelSet

SHARDED = "sharded"  # the DCP folder inside a checkpoint of dist=fsdp (runner/distributed/checkpoint.py writes it)

log = logging.getLogger("runner")

FORMAT_VERSION = 1
FILES = ("trainable.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "state.json")


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    samples_seen: int = 0
    micro_batch_size: int = 0  # 0 = as configured (per rank when several processes trained)
    format_version: int = FORMAT_VERSION
    world_size: int = 1  # processes that trained it (a resume may use another number: runner/distributed/checkpoint.py)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _numpy_rng_state() -> tuple:
    """``np.random.get_state()`` with its uint32 key as an int64 tensor (loadable with weights_only)."""
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    return (name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached_gaussian))


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": _numpy_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, key, *rest = state["numpy"]
    if isinstance(key, torch.Tensor):  # current layout; older rng.pt files hold the ndarray itself
        key = key.numpy().astype(np.uint32)
    np.random.set_state((name, key, *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainable_state_dict(models: ModelSet) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu").contiguous() for n, p in models.named_trainable_parameters()}


def save_checkpoint(
    root: Path,
    state: TrainState,
    models: ModelSet,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    keep: int = 2,
    config_text: str | None = None,
    optimizer_name: str | None = None,
    more_files: Callable[[Path], list[str]] | None = None,
) -> Path:
    """Write ``root/step-N`` atomically, point ``root/latest`` at it, prune to ``keep``.

    ``more_files(folder)`` writes more files into the checkpoint before it is completed and returns
    their names (``ema.safetensors``: runner/ema/average.py); they are fsynced and renamed with the rest.

    Weights holding NaN or inf are refused (:class:`runner.guards.nonfinite.NonFiniteStop`): a checkpoint
    is what the user goes back to. A failed write (full disk, read-only folder) removes its
    temporary folder, so it does not keep the disk full, and ends in a
    :class:`runner.errors.StorageError` that says how many bytes the checkpoint needs; the newest
    complete checkpoint stays as it was.
    """
    weights = trainable_state_dict(models)
    check_finite_weights(weights, state.step)
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_file(weights, str(tmp / "trainable.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict() if scheduler is not None else {}, tmp / "scheduler.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2))
        extra = []  # what a resume checks against (runner/state/resume.py): the run's config, the trained state
        if config_text is not None:
            (tmp / "config.yaml").write_text(config_text)
            (tmp / "trained.json").write_text(json.dumps(describe_trained_state(weights, optimizer, optimizer_name)))
            extra = ["config.yaml", "trained.json"]
        if more_files is not None:
            extra += more_files(tmp)
        fix_tree_modes(tmp)  # safetensors writes 0600 through a temporary file; 0644/0755 as open() would
        for name in (*FILES, *extra):
            _fsync_file(tmp / name)
        _fsync_dir(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        os_error = as_os_error(e, tmp)
        if os_error is not None:
            raise _save_failed(os_error, root, state.step, weights, optimizer) from None
        raise
    try:
        publish_checkpoint(tmp, final, root)
    except OSError as e:
        raise _save_failed(e, root, state.step, weights, optimizer) from None
    _prune(root, keep, final)
    return final


def publish_checkpoint(tmp: Path, final: Path, root: Path) -> None:
    """Make the completed folder ``tmp`` the checkpoint ``final`` and point ``root/latest`` at it,
    each by an atomic rename (a re-save of the same step, e.g. right after an interrupted one,
    swaps the old folder out first)."""
    swap_in_folder(tmp, final)
    latest_tmp = root / f".latest-{os.getpid()}"
    latest_tmp.write_text(final.name + "\n")
    _fsync_file(latest_tmp)
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)


def _save_failed(error: OSError, root: Path, step: int, weights: dict[str, torch.Tensor],
                 optimizer: torch.optim.Optimizer) -> UserError:
    tensors = list(weights.values()) + [t for s in optimizer.state.values() for t in s.values()
                                        if isinstance(t, torch.Tensor)]
    needed = sum(t.numel() * t.element_size() for t in tensors)
    latest = root / "latest"
    try:
        newest = f"{root / latest.read_text().strip()} is intact" if latest.is_file() else "none was saved before"
    except OSError:
        newest = "the earlier ones are untouched"
    return storage_error(error, f"Saving the checkpoint of step {step} into {root}", root, needed_bytes=needed,
                         advice=f"The newest complete checkpoint: {newest}. Training stopped here.")


def _prune(root: Path, keep: int, newest: Path) -> None:
    """Delete all but the ``keep`` newest checkpoints. Each is first renamed to a hidden name, so a
    kill in the middle of deleting never leaves a visible, half-deleted ``step-N``; the hidden
    rest is removed by :func:`remove_leftovers` at the next start."""
    if keep <= 0:
        return
    ckpts = sorted(p for p in root.glob("step-*") if p.is_dir())
    for p in ckpts[:-keep]:
        if p != newest:
            doomed = root / f".prune-{p.name}-{os.getpid()}"
            try:
                os.replace(p, doomed)
            except OSError:
                continue
            shutil.rmtree(doomed, ignore_errors=True)


_LEFTOVER = re.compile(r"^\.(?:tmp|old|prune)-step-\d+-(\d+)$|^\.latest-(\d+)$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process has just started its run: nothing of it is in flight yet
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def remove_leftovers(root: Path) -> list[str]:
    """Remove what an interrupted save or prune left in ``root`` (hidden ``.tmp-``, ``.old-``,
    ``.prune-`` folders and ``.latest-`` files) whose writer process is gone; their names."""
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        m = _LEFTOVER.match(p.name)
        if m is None or _alive(int(m.group(1) or m.group(2))):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p.name)
    if removed:
        log.info("removed %d leftovers of an interrupted save in %s: %s", len(removed), root, ", ".join(sorted(removed)))
    return removed


def find_checkpoint(path: str | Path) -> Path:
    """Resolve ``train.resume``: a checkpoint dir, a ``checkpoints`` dir, or a run dir."""
    p = Path(path)
    if (p / "state.json").is_file():
        return p
    for root in (p, p / "checkpoints"):
        latest = root / "latest"
        if latest.is_file():
            target = root / latest.read_text().strip()
            if (target / "state.json").is_file():
                return target
            raise UserError(
                f"train.resume: {latest} points at '{target.name}', which is missing or incomplete. "
                f"Resume from one of the complete checkpoints in {root} instead."
            )
    raise UserError(
        f"train.resume={str(path)!r} holds no checkpoint: expected a directory with state.json "
        "(checkpoints/step-N) or a run directory with checkpoints/latest."
    )


# Globals an rng.pt of the earlier layout needs (numpy's RNG key as an ndarray): rebuilding a uint32
# array, nothing that calls arbitrary code. Allowlisted for rng.pt only.
_reconstruct = (np._core if hasattr(np, "_core") else np.core).multiarray._reconstruct
_LEGACY_RNG_GLOBALS: list[Any] = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), _reconstruct]
if hasattr(np, "_core"):  # numpy >= 2 reading a file pickled by numpy 1
    _LEGACY_RNG_GLOBALS.append((_reconstruct, "numpy.core.multiarray._reconstruct"))


def _torch_load(path: Path) -> Any:
    """``torch.load`` that unpickles nothing but tensors and plain values; a UserError otherwise."""
    allowed = _LEGACY_RNG_GLOBALS if path.name == "rng.pt" else []
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(allowed):
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)|function (<[^>]*>)|got (<[^>]*>)", str(e))
        why = (f"loading it would need unpickling arbitrary Python objects (it references "
               f"{next(g for g in found.groups() if g)}), which can run code" if found else
               "it is not a torch.save file of tensors and plain values: it is corrupt, or loading it would "
               "need unpickling arbitrary Python objects, which can run code")
        raise UserError(
            f"Checkpoint file {path} is refused: {why}. Nothing in it was executed. Checkpoints written by this "
            "runner hold only tensors, numbers, strings and plain containers. Resume only from checkpoints this "
            "runner wrote, or start without train.resume."
        ) from None


def _load(path: Path, what: str) -> Any:
    if not path.is_file():
        raise UserError(f"Checkpoint file {path} is missing; the checkpoint is incomplete. Resume from another one.")
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        if path.suffix == ".json":
            return json.loads(path.read_text())
        return _torch_load(path)
    except (SafetensorError, json.JSONDecodeError, RuntimeError, EOFError, OSError, ValueError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]  # an empty file raises a bare EOFError
        raise UserError(
            f"Checkpoint file {path} is corrupt ({what} could not be read: {reason}). "
            "Resume from an earlier checkpoint in the same directory or start without train.resume."
        ) from None


def describe_trained_state(weights: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                           optimizer_name: str | None) -> dict[str, Any]:
    """``trained.json``: what a resume must match: parameter names, shapes and dtypes, the optimizer's
    kind and its state layout (per parameter: state keys with shapes and dtypes)."""
    sd = optimizer.state_dict()
    layout = {str(i): {k: [list(v.shape), str(v.dtype).replace("torch.", "")] if isinstance(v, torch.Tensor) else
                       type(v).__name__ for k, v in st.items()} for i, st in sd["state"].items()}
    return {
        "parameters": {n: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")} for n, t in weights.items()},
        "optimizer": {"name": optimizer_name, "class": type(optimizer).__name__,
                      "param_groups": [len(g["params"]) for g in sd["param_groups"]], "state": layout},
    }


def _check_weights(ckpt: Path, weights: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter]) -> None:
    """Refuse, before anything is loaded, saved weights whose names or shapes do not fit this model."""
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise UserError(
            f"Checkpoint {ckpt} does not match this model: {len(missing)} trained parameters missing "
            f"(e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]}). "
            "Resume with the same trainer, model.size and model.train settings it was saved with."
        )
    shapes = [f"{n}: saved {tuple(weights[n].shape)}, this run {tuple(p.shape)}"
              for n, p in params.items() if tuple(weights[n].shape) != tuple(p.shape)]
    if shapes:
        raise UserError(
            f"Checkpoint {ckpt} does not match this model: {len(shapes)} trained parameters have another shape "
            f"({'; '.join(shapes[:3])}). A different model.lora_rank, lora_targets or model.size does this; resume "
            "with the settings the checkpoint was saved with (its config.yaml) or start a new run."
        )


def _check_optimizer(ckpt: Path, opt_state: dict[str, Any], optimizer: torch.optim.Optimizer,
                     optimizer_name: str | None) -> None:
    """Refuse optimizer state of another kind or for other parameter groups, before loading it."""
    described = ckpt / "trained.json"
    if described.is_file() and optimizer_name is not None:
        saved_name = _load(described, "the trained-state description").get("optimizer", {}).get("name")
        if saved_name is not None and saved_name != optimizer_name:
            raise UserError(
                f"Checkpoint {ckpt} holds the state of optimizer={saved_name}, but this run uses optimizer="
                f"{optimizer_name}. Resume with optimizer={saved_name}, or start a new run without train.resume."
            )
    saved_groups = [len(g.get("params", [])) for g in opt_state.get("param_groups", [])]
    groups = [len(g["params"]) for g in optimizer.param_groups]
    if saved_groups != groups:
        raise UserError(
            f"Checkpoint file {ckpt / 'optimizer.pt'} holds optimizer state for parameter groups of sizes "
            f"{saved_groups}; this run's optimizer has {groups}. Resume with the settings it was saved with."
        )


def load_trainable_weights(ckpt: Path, models: ModelSet) -> None:
    """Copy ``ckpt``'s trained weights into ``models``, names and shapes checked first (``mode=export``
    needs no optimizer state)."""
    if is_sharded(ckpt):  # written by dist=fsdp: read whole in this process
        load_sharded_weights(ckpt, models)
        return
    weights = _load(ckpt / "trainable.safetensors", "the trained weights")
    params = dict(models.named_trainable_parameters())
    _check_weights(ckpt, weights, params)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name].to(p.dtype))


def load_checkpoint(
    ckpt: Path, models: ModelSet, optimizer: torch.optim.Optimizer, scheduler: Any, optimizer_name: str | None = None
) -> TrainState:
    """Restore weights, optimizer, scheduler and RNG from ``ckpt``; return the saved state.

    Every file is read and checked against this run first (names, shapes, optimizer kind and
    groups): a refused checkpoint changes nothing.
    """
    raw_state = _load(ckpt / "state.json", "the step state")
    try:
        state = TrainState(**raw_state)
    except TypeError:
        raise UserError(f"Checkpoint file {ckpt / 'state.json'} has unexpected fields {sorted(raw_state)}.") from None
    weights = _load(ckpt / "trainable.safetensors", "the trained weights")
    opt_state = _load(ckpt / "optimizer.pt", "the optimizer state")
    sched_state = _load(ckpt / "scheduler.pt", "the scheduler state")
    rng = _load(ckpt / "rng.pt", "the RNG state")
    params = dict(models.named_trainable_parameters())
    _check_weights(ckpt, weights, params)
    _check_optimizer(ckpt, opt_state, optimizer, optimizer_name)
    try:
        optimizer.load_state_dict(opt_state)
    except (ValueError, KeyError) as e:
        raise UserError(f"Checkpoint file {ckpt / 'optimizer.pt'} does not match this optimizer: {e}") from None
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name].to(p.dtype))
    if scheduler is not None and sched_state:
        scheduler.load_state_dict(sched_state)
    set_rng_state(rng)
    return state


def is_sharded(ckpt: Path) -> bool:
    return (Path(ckpt) / SHARDED / ".metadata").is_file()


def check_described(ckpt: Path, models: ModelSet, optimizer_name: str | None) -> None:
    """Names and shapes (trained.json) and the optimizer's kind against this run, before loading."""
    described = ckpt / "trained.json"
    if not described.is_file():
        raise UserError(f"Checkpoint {ckpt} is sharded but has no trained.json; it is incomplete. Resume from "
                        "another one.")
    info = _load(described, "the trained-state description")
    saved = {n: tuple(d["shape"]) for n, d in info.get("parameters", {}).items()}
    params = dict(models.named_trainable_parameters())
    missing, unexpected = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
    shapes = [f"{n}: saved {saved[n]}, this run {tuple(p.shape)}" for n, p in params.items()
              if n in saved and saved[n] != tuple(p.shape)]
    if missing or unexpected or shapes:
        raise UserError(
            f"Checkpoint {ckpt} does not match this model: {len(missing)} trained parameters missing (e.g. "
            f"{missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]}), {len(shapes)} of another shape "
            f"({'; '.join(shapes[:2])}). Resume with the settings it was saved with (its config.yaml).")
    saved_name = info.get("optimizer", {}).get("name")
    if optimizer_name is not None and saved_name is not None and saved_name != optimizer_name:
        raise UserError(f"Checkpoint {ckpt} holds the state of optimizer={saved_name}, but this run uses optimizer="
                        f"{optimizer_name}. Resume with optimizer={saved_name}, or start a new run without "
                        "train.resume.")


def load_sharded_weights(ckpt: Path, models: ModelSet) -> None:
    """``mode=export`` (one process): the trained weights of a sharded checkpoint, read whole."""
    import torch.distributed.checkpoint as dcp

    check_described(ckpt, models, None)
    params = dict(models.named_trainable_parameters())
    target = {"model": {n: torch.empty_like(p, device="cpu") for n, p in params.items()}}
    dcp.load(target, checkpoint_id=str(ckpt / SHARDED), no_dist=True)  # this process alone, even beside a group
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(target["model"][n].to(p.dtype))
