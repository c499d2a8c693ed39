"""``dist=fsdp``: the trained module built on ``meta`` on every rank, sharded, then filled shard by shard.

Why. Before this, every rank loaded the whole trained module on the host and then ``fully_shard``
kept its shard: for a Flux full fine-tune 44 GiB of float32 weights per rank at setup, ~430 GB of
host RAM on an 8-GPU node. Now each rank holds its shards of the trained weights and, briefly, one
slice at a time. Two ways, picked per run by :func:`build_models_for_rank`:

* ``slices``: the trained module's weights lie in safetensors files as stored (a diffusers folder's
  ``diffusion_pytorch_model*.safetensors``, or a single file in diffusers' key layout:
  ``DiffusersTrainer.weight_files``). Every rank builds the module with its parameters on ``meta``
  (``DiffusersTrainer.empty_modules``; its buffers real), ``fully_shard`` turns them into shards,
  and each rank reads only its rows of each tensor (``safe_open(...).get_slice``), converted to the
  parameter's dtype as the one-process load converts it. Host peak per rank: its shards plus one
  slice. The frozen modules are loaded as before, by every rank.
* ``broadcast``: no file to slice (random init from ``model.size``, an original-layout single file
  that must be converted whole, ``.bin`` weights). Rank 0 builds every module exactly as one
  process does; the other ranks build them with their parameters on ``meta`` (no random draws, so
  nothing depends on what rank 0 drew) and receive the frozen modules' tensors from rank 0 right
  away (random init), the trained module's after ``fully_shard`` through torch's
  ``set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))``:
  each tensor is broadcast whole, and each rank keeps its shard. Trade-off: rank 0 holds the whole
  trained module once, briefly (from its build until the broadcast ends), the others one tensor at
  a time. At random init the frozen modules cross the network too (rank 0's draws for the trained
  module come before theirs); from a file every rank loads its frozen modules as before.

Either way the weights are the bits one process would have: the same reads and conversions, or rank
0's own module. LoRA (``model.train`` other than ``full``) is loaded by broadcast: its adapters are
drawn at random over the loaded base, and only rank 0 draws them as one process does. Not covered
(loaded whole on every rank as before, said in the log): LoRA over a quantized base (a
``quantization`` plugin quantizes the base whole after it is loaded in ``model.dtype``; it stays whole
on every rank, runner/dist/runtime.py ``_unshardable_params``), a trainer that is not a
:class:`~runner.trainers.base.DiffusersTrainer`, and hosted mode (the loop builds its own modules).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runner.trainer import ModelSet

log = logging.getLogger("runner")


@dataclass
class PendingLoad:
    """What :meth:`DataParallel._shard` fills in after ``fully_shard`` (runner/dist/runtime.py)."""

    name: str  # the trained module
    mode: str  # slices | broadcast
    files: dict[str, tuple[str, str]] = field(default_factory=dict)  # slices: model key -> (file, key in it)


def load_mode(trainer: Any, spec: Any, train_mode: str, cfg: Any = None) -> tuple[str, str]:
    """How this run's ranks get the trained module (module docstring), and why: ``whole`` (every rank
    loads it whole, as one process), ``slices`` or ``broadcast``. The planner asks the same
    (runner/plan/dist.py: host RAM per rank)."""
    from runner import registry

    if not spec.sharded:
        return "whole", f"dist={spec.name}: every rank holds the whole module"
    if not callable(getattr(trainer, "weight_files", None)) or not hasattr(trainer, "empty_modules"):
        return "whole", f"{type(trainer).__name__} is not a built-in (DiffusersTrainer) trainer"
    quantized = [name for kind, name, _ in (registry.selected(cfg) if cfg is not None else []) if kind == "quantization"]
    if str(train_mode) != "full" and quantized:
        return "whole", (f"model.train={train_mode} with quantization={','.join(quantized)}: every rank loads the base "
                         "whole in model.dtype, then quantizes it; a quantized base stays whole on every rank")
    if str(train_mode) != "full":  # the adapters are drawn over the loaded base: rank 0's draws, as in one process
        return "broadcast", f"model.train={train_mode}: rank 0 builds the base and draws the adapters, and broadcasts them"
    if trainer.weight_files(trainer.denoiser) is not None:
        return "slices", "each rank reads its rows from the safetensors files"
    why = "random init" if trainer.source is None else "weights converted or read whole"
    return "broadcast", f"rank 0 builds the module whole ({why}) and broadcasts it"


def build_models_for_rank(ctx: Any) -> ModelSet:
    """The trainer's models on this rank (module docstring); ``ctx.dist.pending`` says what ``_shard`` fills in."""
    trainer, spec = ctx.trainer, ctx.run.dist
    mode, why = load_mode(trainer, spec, ctx.run.train_mode, ctx.cfg)
    if mode == "whole":
        if spec.sharded:
            log.info("dist=fsdp: every rank loads the trained module whole before sharding (%s)", why)
        return trainer.build_models("cpu")
    name = trainer.denoiser
    if mode == "slices":
        files = trainer.weight_files(name)
        generator = torch.get_rng_state()
        models = _build(trainer, frozenset({name}))
        if set(files) != set(models[name].state_dict()):  # a layout the slices cannot follow: read it whole
            log.info("dist=fsdp: %s's files do not hold its keys as stored; every rank loads it whole", name)
            del models
            torch.set_rng_state(generator)  # the frozen modules draw again what they drew in the first build
            return trainer.build_models("cpu")
        ctx.dist.pending = PendingLoad(name, "slices", files)
        log.info("dist=fsdp: %s built on meta; each rank reads its shard's rows from %d safetensors file(s)", name,
                 len({f for f, _ in files.values()}))
        return models
    # At random init rank 0's build of the trained module draws from the generator before the frozen modules
    # draw theirs: the other ranks build every module empty and receive them. Otherwise nothing drawn
    # depends on the trained module's build: every rank loads (or draws) its frozen modules as one process.
    random_init = trainer.source is None
    empty = frozenset(trainer.module_classes()) if random_init else frozenset({name})
    models = trainer.build_models("cpu") if spec.is_main else _build(trainer, empty)
    if random_init:
        for other, module in models.items():
            if other != name:
                broadcast_module(module, spec.is_main)
    _same_generator_as_rank0()  # e.g. the adapters' draws: the other ranks continue from rank 0's generator
    ctx.dist.pending = PendingLoad(name, "broadcast")
    log.info("dist=fsdp: rank 0 builds %s whole (%s); the other ranks receive their shards from it", name,
             why if str(ctx.run.train_mode) != "full" else "random init" if trainer.source is None else "weights read whole")
    return models


def _build(trainer: Any, empty: frozenset[str]) -> ModelSet:
    trainer.empty_modules = empty
    try:
        return trainer.build_models("cpu")
    finally:
        trainer.empty_modules = frozenset()


def materialize(module: nn.Module, device: torch.device) -> None:
    """Storage for a module whose parameters are on ``meta`` (``to_empty``), keeping its real buffers
    as they are, where they are (``fully_shard`` moved them to the compute device; with
    ``dist.cpu_offload`` the shards are made on the host, the buffers stay on the device)."""
    buffers = {n: b for n, b in module.named_buffers() if b.device.type != "meta"}
    module.to_empty(device=device)
    for n, b in buffers.items():
        owner, _, key = n.rpartition(".")
        module.get_submodule(owner)._buffers[key] = b


def broadcast_module(module: nn.Module, is_main: bool) -> None:
    """Every parameter and buffer of a (not sharded) module from rank 0, in place."""
    import torch.distributed as dist

    from runner.dist.launch import cpu_group

    if not is_main:
        materialize(module, torch.device("cpu"))
    with torch.no_grad():  # host tensors: over the gloo group (NCCL takes device tensors only)
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(torch.view_as_real(t.data) if t.is_complex() else t.data, src=0, group=cpu_group())


def _same_generator_as_rank0() -> None:
    """Rank 0 drew the random init; the others take its generator state, so later draws agree with one process."""
    import torch.distributed as dist

    from runner.dist.launch import cpu_group

    state = torch.get_rng_state()
    dist.broadcast(state, src=0, group=cpu_group())
    torch.set_rng_state(state)


def fill_sharded(pending: PendingLoad, module: nn.Module, full_state: dict[str, torch.Tensor] | None,
                 device: torch.device, is_main: bool) -> None:
    """After ``fully_shard``: this rank's shards of ``module`` from the files or from rank 0.
    ``full_state``: rank 0's whole module (broadcast mode), taken before ``fully_shard``."""
    if pending.mode == "broadcast":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if not is_main:
            materialize(module, device)
        set_model_state_dict(module, full_state if is_main else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return
    materialize(module, device)
    _read_slices(module, pending.files)


def _read_slices(module: nn.Module, files: dict[str, tuple[str, str]]) -> None:
    """Each tensor's rows this rank keeps (FSDP2's dim-0 chunks), read with ``get_slice`` and
    converted to the parameter's dtype; buffers (every rank holds them whole) read whole."""
    from safetensors import safe_open

    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    by_file: dict[str, list[str]] = {}
    for key, (file, _) in files.items():
        by_file.setdefault(file, []).append(key)
    with torch.no_grad():
        for file, keys in by_file.items():
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in keys:
                    target = tensors[key]
                    local = target.to_local() if hasattr(target, "to_local") else target
                    rows = _rows(target, local)
                    stored = f.get_slice(files[key][1])
                    part = stored[rows[0]:rows[1]] if rows is not None else stored[:]
                    local.copy_(part.to(local.dtype))


def _rows(target: torch.Tensor, local: torch.Tensor) -> tuple[int, int] | None:
    """The rows [lo, hi) of ``target`` this rank holds (torch.chunk's split over the shard mesh
    dimension, as FSDP2 shards dim 0); None for a tensor held whole."""
    if local.shape == target.shape or target.dim() == 0:
        return None
    mesh = target.device_mesh
    k = mesh.size(mesh.ndim - 1)
    index = mesh.get_local_rank(mesh.ndim - 1)
    n = target.shape[0]
    size = -(-n // k)
    lo = min(index * size, n)
    hi = min(lo + size, n)
    if hi - lo != local.shape[0]:
        raise RuntimeError(f"dist=fsdp: a shard of {tuple(target.shape)} has {local.shape[0]} rows, expected {hi - lo}")
    return lo, hi
