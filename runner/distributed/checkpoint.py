"""Checkpoints of several processes, and resume across formats and world sizes.

Two formats, one folder layout (``checkpoints/step-N/``, written atomically as in
runner/state/checkpoint.py: a hidden folder, fsynced, renamed; ``latest`` replaced after):

* **full** (one process, ``dist=ddp``): runner/state/checkpoint.py's own: ``trainable.safetensors``
  and ``optimizer.pt`` hold everything. Under DDP every rank holds the same weights and optimizer
  state, so rank 0 writes it alone and the others wait for the verdict.
* **sharded** (``dist=fsdp``): the trained weights and the optimizer state, keyed by parameter
  name, go through ``torch.distributed.checkpoint`` (DCP) into ``sharded/``: every rank writes
  its own shards at once, nothing is gathered on one rank. Rank 0 writes the small files
  (``state.json``, ``scheduler.pt``, ``rng.pt``, ``config.yaml``, ``trained.json``). With
  ``ema.enabled`` each rank's EMA shards go into the same DCP folder (key ``ema``) and rank 0
  writes ``ema.json`` beside them (runner/ema/shards.py, which also resumes them).

Resume (``train.resume``), in any combination:

==========================  =======================  =======================================
checkpoint \\ run            one process / DDP        FSDP
==========================  =======================  =======================================
full                        as before, every rank    full tensors split into this run's
                            reads the files          shards (``set_state_dict``)
sharded                     DCP reads the shards     DCP re-splits the shards for this
                            into full tensors        world size
==========================  =======================  =======================================

so a run resumes on another number of processes and in the other mode; the sample order is the
global one (runner/distributed/runtime.py), so the loss curve continues as if nothing changed. The
optimizer state moves between formats by parameter name (``torch.distributed.checkpoint.
state_dict``'s form); what cannot move: the state of an optimizer FSDP does not shard (8-bit
bitsandbytes; refused with ``dist=fsdp`` anyway), and a step of ``offload=optimizer``'s host
optimizer into FSDP (refused too). ``mode=export`` reads a sharded checkpoint in one process.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.errors import UserError, as_os_error, storage_error
from runner.state.checkpoint import (  # noqa: F401 - is_sharded, load_sharded_weights: re-exported
    check_described, _check_optimizer, _check_weights, describe_trained_state, _fsync_dir, _fsync_file,
    is_sharded, _load, load_checkpoint, load_sharded_weights, _prune, publish_checkpoint, rng_state,
    set_rng_state, SHARDED, TrainState,
)
from runner.trainer import ModelSet

log = logging.getLogger("runner")

SMALL_FILES = ("state.json", "scheduler.pt", "rng.pt")
EMA_KEY = "ema"  # the EMA's shards in the DCP state dict (runner/ema/shards.py reads them)


class TrainedModules(nn.Module):
    """The trained modules under their ModelSet names, so state-dict keys are the runner's own
    parameter names (``unet.conv_in.weight``) whatever wraps them."""

    def __init__(self, models: ModelSet) -> None:
        super().__init__()
        for name in sorted(models.trained):
            self.add_module(name, models[name])


def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, **kw)


def _state_dicts(models: ModelSet, optimizer: Any) -> tuple[nn.Module, dict[str, Any], dict[str, Any]]:
    """(holder, model state dict, optimizer state dict) keyed by the runner's parameter names."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    holder = TrainedModules(models)
    msd, osd = get_state_dict(holder, optimizer, options=_options())
    return holder, msd, osd


def _set_state_dicts(holder: nn.Module, optimizer: Any, msd: dict[str, Any], osd: dict[str, Any], full: bool) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(holder, optimizer, model_state_dict=msd, optim_state_dict=osd,
                   options=_options(full_state_dict=full))


# ---- save ------------------------------------------------------------------------------------------
def save_sharded(dist_: Any, root: Path, state: Any, models: ModelSet, optimizer: Any, scheduler: Any, keep: int,
                 config_text: str | None, optimizer_name: str | None, more_files: Any = None,
                 more_shards: dict[str, Any] | None = None) -> Path:
    """``dist=fsdp``: every rank writes its shards through DCP; rank 0 the rest (module docstring).
    ``more_shards``: more sharded tensors by name, saved under key ``ema`` (the EMA's, runner/ema/shards.py);
    ``more_files(folder)``: rank 0's files that describe them (names written)."""
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp

    from runner.distributed.launch import cpu_group

    main = dist_.is_main
    final = root / f"step-{state.step:08d}"
    pid = torch.tensor([os.getpid() if main else 0], dtype=torch.int64)
    tdist.broadcast(pid, src=0, group=cpu_group())  # one hidden folder for every rank: rank 0's name
    tmp = root / f".tmp-{final.name}-{int(pid.item())}"
    error: BaseException | None = None
    params = dict(models.named_trainable_parameters())
    if not dist_.all_agree(all(bool(torch.isfinite(_local(p)).all()) for p in params.values())):
        from runner.guards.nonfinite import NonFiniteStop

        raise NonFiniteStop(f"The trained weights hold NaN or inf after step {state.step}; no checkpoint was "
                            "written (a checkpoint is what you go back to). The previous checkpoint is kept.",
                            step=state.step)
    if main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            error = e
    if not dist_.all_agree(error is None):
        raise _failed(error, root, state.step)
    try:
        _, msd, osd = _state_dicts(models, optimizer)
        content = {"model": msd, "optim": osd}
        if more_shards:
            content[EMA_KEY] = more_shards
        dcp.save(content, checkpoint_id=str(tmp / SHARDED))
    except Exception as e:  # noqa: BLE001 - DCP gathers every rank's failure into one exception on all ranks
        error = e
    if main and error is None:
        try:
            torch.save(scheduler.state_dict() if scheduler is not None else {}, tmp / "scheduler.pt")
            torch.save(rng_state(), tmp / "rng.pt")
            (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2))
            names = list(SMALL_FILES)
            if config_text is not None:
                (tmp / "config.yaml").write_text(config_text)
                (tmp / "trained.json").write_text(json.dumps(describe_trained_state(params, optimizer, optimizer_name)))
                names += ["config.yaml", "trained.json"]
            if more_files is not None:
                names += more_files(tmp)
            for name in names:
                _fsync_file(tmp / name)
            for f in (tmp / SHARDED).iterdir():
                _fsync_file(f)
            _fsync_dir(tmp / SHARDED)
            _fsync_dir(tmp)
            publish_checkpoint(tmp, final, root)
        except BaseException as e:  # noqa: BLE001 - reported below, on every rank
            error = e
    if not dist_.all_agree(error is None):
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _failed(error, root, state.step)
    if main:
        _prune(root, keep, final)
    return final


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _failed(error: BaseException | None, root: Path, step: int) -> UserError:
    """The same kind of error on every rank: the writer's own where it failed, a pointer elsewhere."""
    if error is None:
        return UserError(f"Saving the checkpoint of step {step} into {root} failed on another rank (its message says "
                         "why); training stopped, the newest complete checkpoint is kept.")
    os_error = as_os_error(error, root)
    if os_error is not None:
        return storage_error(os_error, f"Saving the checkpoint of step {step} into {root}", root,
                             advice="The newest complete checkpoint is kept. Training stopped here.")
    if isinstance(error, UserError):
        return error
    raise error


def save_replicated(dist_: Any, save: Any) -> Path:
    """``dist=ddp``: rank 0 writes the full checkpoint (every rank holds the same state); the others
    wait for it, and every rank stops when it failed."""
    path: Path | None = None
    error: BaseException | None = None
    if dist_.is_main:
        try:
            path = save()
        except BaseException as e:  # noqa: BLE001 - re-raised on rank 0, reported on the others
            error = e
    ok = dist_.all_agree(error is None)
    if error is not None:
        raise error
    if not ok:
        raise UserError("Saving the checkpoint failed on rank 0 (its message says why); training stopped on every "
                        "rank, the newest complete checkpoint is kept.")
    return path if path is not None else Path(".")  # only rank 0's path is ever used


# ---- load ------------------------------------------------------------------------------------------
def load_any(ckpt: Path, models: ModelSet, optimizer: Any, scheduler: Any, optimizer_name: str | None,
             sharded_run: bool) -> Any:
    """Restore a checkpoint of either format into this run (module docstring's table); the saved
    :class:`~runner.state.checkpoint.TrainState`."""

    if is_sharded(ckpt):
        return _load_sharded(ckpt, models, optimizer, scheduler, optimizer_name)
    if sharded_run:
        return _load_full_into_shards(ckpt, models, optimizer, scheduler, optimizer_name)
    return load_checkpoint(ckpt, models, optimizer, scheduler, optimizer_name=optimizer_name)


def _small_files(ckpt: Path) -> tuple[Any, Any, Any]:

    raw = _load(ckpt / "state.json", "the step state")
    try:
        state = TrainState(**raw)
    except TypeError:
        raise UserError(f"Checkpoint file {ckpt / 'state.json'} has unexpected fields {sorted(raw)}.") from None
    return state, _load(ckpt / "scheduler.pt", "the scheduler state"), _load(ckpt / "rng.pt", "the RNG state")


def _load_sharded(ckpt: Path, models: ModelSet, optimizer: Any, scheduler: Any, optimizer_name: str | None) -> Any:
    import torch.distributed.checkpoint as dcp


    check_described(ckpt, models, optimizer_name)
    state, sched, rng = _small_files(ckpt)
    holder, msd, osd = _state_dicts(models, optimizer)  # this run's layout: full tensors or this world's shards
    target = {"model": msd, "optim": osd}
    try:
        dcp.load(target, checkpoint_id=str(ckpt / SHARDED))
    except Exception as e:  # noqa: BLE001 - DCP's own errors name keys; make them one paragraph
        raise UserError(f"Checkpoint {ckpt / SHARDED} could not be read ({type(e).__name__}: "
                        f"{(str(e).strip().splitlines() or [''])[0]}). Resume from another checkpoint.") from None
    _set_state_dicts(holder, optimizer, target["model"], target["optim"], full=False)
    if scheduler is not None and sched:
        scheduler.load_state_dict(sched)
    set_rng_state(rng)
    return state


def _load_full_into_shards(ckpt: Path, models: ModelSet, optimizer: Any, scheduler: Any,
                           optimizer_name: str | None) -> Any:
    """A full checkpoint into an FSDP run: every rank reads the files and keeps its shards."""

    state, sched, rng = _small_files(ckpt)
    weights = _load(ckpt / "trainable.safetensors", "the trained weights")
    opt_state = _load(ckpt / "optimizer.pt", "the optimizer state")
    params = dict(models.named_trainable_parameters())
    _check_weights(ckpt, weights, params)
    _check_optimizer(ckpt, opt_state, optimizer, optimizer_name)
    names = list(params)  # the optimizer was built from these parameters, in this order
    osd = {"state": {names[i]: s for i, s in opt_state.get("state", {}).items()},
           "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in opt_state["param_groups"]]}
    holder = TrainedModules(models)
    _set_state_dicts(holder, optimizer, {n: weights[n] for n in names}, osd, full=True)
    if scheduler is not None and sched:
        scheduler.load_state_dict(sched)
    set_rng_state(rng)
    return state
