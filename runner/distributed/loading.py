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
  that must be converted whole, ``.bin`` weights, LoRA). Rank 0 builds every module exactly as one
  process does; the other ranks build the trained module (at random init every module) with its
  parameters on ``meta`` (no random draws, so nothing depends on what rank 0 drew), receive the frozen
  modules' tensors from rank 0 right away (random init only), and the trained module's unit by unit
  as rank 0 shards it (:func:`shard_units`):
  each tensor is broadcast whole, and each rank keeps its rows. Trade-off: rank 0 holds the whole
  trained module once, briefly (from its build until its last unit is sharded), the others one tensor
  at a time. At random init the frozen modules cross the network too (rank 0's draws for the trained
  module come before theirs); from a file every rank loads its frozen modules as before.

Frozen modules that only fill a cache (:func:`rank0_only_modules`). Under ``offload=park`` rank 0 fills
the encoder cache first while the others wait (accelerate's ``main_process_first``); the others then
read its complete entries and park drops the modules that compute only cached outputs (the text
encoders, the VAE when latents are cached) without calling them. On one node every rank reads rank 0's
folder, so the other ranks build those modules with their parameters on ``meta`` (``empty_modules``)
and never hold their weights: each rank's host peak at setup drops by their bytes (Flux: T5-XXL and
CLIP, ~9.3 GiB in bf16). Kept on every rank: with ``sample.every`` or ``data.val_path`` (their prompts
and samples are encoded on every rank before park runs: FSDP's ranks all run the sampling pipeline and
every held-out forward), and across several nodes (a node may have its own cache folder, which its
ranks fill themselves). A rank that still finds entries missing stops with a UserError naming
``offload.park.cache_dir`` (plugins/park/loaded.py). A skipped module draws no random numbers, so at
random init the modules built after it would draw other values than rank 0's: the randomly initialised
modules the others build are taken from rank 0 (:func:`_same_draws`), and its generator too.

Either way the weights are the bits one process would have: the same reads and conversions, or rank
0's own module. LoRA (``model.train`` other than ``full``) is loaded by broadcast: its adapters are
drawn at random over the loaded base, and only rank 0 draws them as one process does.

A third way, for one process too: ``quantized``. A LoRA over a base that a ``quantization`` plugin
quantizes, with its weights in safetensors files as stored: every rank (or the one process) builds the
base on meta, draws the adapters itself as one process does, and the plugin reads each Linear layer
from the file just before it quantizes it (runner/meta_weights.py); the quantized weights stay whole
on every rank (runner/distributed/runtime.py ``_unshardable_params``), what FSDP2 can shard (norms, skipped
layers) is read whole, then sharded. Host peak: the base as quantized plus one tensor in flight, where
it was the whole base in ``model.dtype``. Not covered (loaded whole, then quantized, on every rank as
before, said in the log): such a base at random init (drawn layer by layer it would get other values),
DoRA and LoKr/LoHa (their init may read the base), an original-layout or ``.bin`` base. Not covered at
all (loaded whole on every rank): a trainer that is not a :class:`~runner.families.common.base.DiffusersTrainer`,
and hosted mode (the loop builds its own modules).
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
    """What :meth:`DataParallel._shard` fills in after ``fully_shard`` (runner/distributed/runtime.py)."""

    name: str  # the trained module
    mode: str  # slices | broadcast
    files: dict[str, tuple[str, str]] = field(default_factory=dict)  # slices: model key -> (file, key in it)


def load_mode(trainer: Any, spec: Any, train_mode: str, cfg: Any = None) -> tuple[str, str]:
    """How this run's ranks (or its one process) get the trained module (module docstring), and why:
    ``whole`` (every rank loads it whole, as one process), ``slices``, ``broadcast`` or ``quantized``
    (one process too). The planner asks the same (runner/plan/dist.py: host RAM per rank)."""
    builtin = callable(getattr(trainer, "weight_files", None)) and hasattr(trainer, "empty_modules")
    quantized = quantizers(trainer, cfg) if builtin and str(train_mode) != "full" else []
    if quantized:
        streamed, why = streamed_base(trainer, cfg, train_mode, quantized)
        ranks = "every rank reads" if spec.sharded else "read"
        whole = "; a quantized base stays whole on every rank" if spec.sharded else ""
        if streamed:
            return "quantized", (f"model.train={train_mode} with quantization={','.join(quantized)}: the base is built on "
                                 f"meta and {ranks} layer by layer from its safetensors files, each layer quantized as "
                                 f"it is read{whole}")
        return "whole", (f"model.train={train_mode} with quantization={','.join(quantized)}: the base is loaded whole in "
                         f"model.dtype, then quantized ({why}){whole}")
    if not spec.sharded:
        return "whole", f"dist={spec.name}: every rank holds the whole module"
    if not builtin:
        return "whole", f"{type(trainer).__name__} is not a built-in (DiffusersTrainer) trainer"
    if str(train_mode) != "full":  # the adapters are drawn over the loaded base: rank 0's draws, as in one process
        return "broadcast", f"model.train={train_mode}: rank 0 builds the base and draws the adapters, and broadcasts them"
    if trainer.weight_files(trainer.denoiser) is not None:
        return "slices", "each rank reads its rows from the safetensors files"
    why = "random init" if trainer.source is None else "weights converted or read whole"
    return "broadcast", f"rank 0 builds the module whole ({why}) and broadcasts it"


def quantizers(trainer: Any, cfg: Any) -> list[str]:
    """The quantization plugins of ``cfg`` that take the trained module's base: ``modules`` unset
    (every frozen base: plugins/quantization/common.py ``target_modules``) or naming it."""
    from runner import registry

    if cfg is None:
        return []
    return [name for kind, name, node in registry.selected(cfg) if kind == "quantization"
            and (not _named(node) or getattr(trainer, "denoiser", None) in _named(node))]


def _named(node: Any) -> list[str]:
    modules = node.get("modules", None) if hasattr(node, "get") else None
    return [str(m) for m in modules or []]


def streamed_base(trainer: Any, cfg: Any, train_mode: str, quantized: list[str]) -> tuple[bool, str]:
    """Whether the quantized base is built on meta and read layer by layer (runner/meta_weights.py),
    and if not, why not."""
    if str(train_mode) != "lora" or bool(cfg.model.get("lora_dora", False)):
        kind = "DoRA" if str(train_mode) == "lora" else f"model.train={train_mode}"
        return False, f"{kind}: the adapters' init is only known to read nothing of the base for plain LoRA"
    if trainer.source is None:
        return False, "random init: drawn whole, as one process draws it"
    if trainer.weight_files(trainer.denoiser) is None:
        return False, "its weights are converted from another layout or are not safetensors"
    return True, ""


def rank0_only_modules(cfg: Any, trainer: Any, plugins: list[Any], spec: Any) -> tuple[frozenset[str], str]:
    """The frozen modules only rank 0 loads (module docstring), and why (for the log and the plan).
    The same answer on every rank: it depends on the config, the trainer and the world only."""
    if not spec.active:
        return frozenset(), ""
    if not hasattr(trainer, "empty_modules") or not isinstance(getattr(trainer, "denoiser", None), str):
        return frozenset(), f"{type(trainer).__name__} is not a built-in (DiffusersTrainer) trainer"
    freed = frozenset().union(*(p.frees_after_cache_fill(trainer) for p in plugins))
    named = {str(m).rstrip("?") for p in plugins for m in (getattr(p.config, "modules", None) or ())}
    names = frozenset(n for n in freed if n in trainer.module_classes() and n != trainer.denoiser and n not in named)
    if not names:
        return frozenset(), ""
    keep = ("sample.every is set: every rank encodes the sample prompts before park runs"
            if cfg is not None and int((cfg.get("sample") or {}).get("every", 0) or 0) else
            "data.val_path is set: every rank encodes the held-out samples before park runs"
            if cfg is not None and (cfg.get("data") or {}).get("val_path") else
            f"{spec.nodes} nodes: a node's ranks may fill a cache folder of their own"
            if spec.world_size > spec.ranks_per_node else "")
    if keep:
        return frozenset(), f"{', '.join(sorted(names))} loaded on every rank ({keep})"
    return names, (f"{', '.join(sorted(names))} loaded on rank 0 only (they only fill the encoder cache, which "
                   "the other ranks read)")


def build_models_for_rank(ctx: Any) -> ModelSet:
    """The trainer's models on this rank (module docstring); ``ctx.dist.pending`` says what ``_shard`` fills
    in, ``ModelSet.unread`` what a quantization plugin reads as it quantizes (runner/meta_weights.py)."""
    trainer, spec = ctx.trainer, ctx.run.dist
    mode, why = load_mode(trainer, spec, ctx.run.train_mode, ctx.cfg)
    rank0_only, said = rank0_only_modules(ctx.cfg, trainer, ctx.schedule.plugins, spec)
    if said:
        log.info("dist=%s: %s", spec.name, said)
    skip = frozenset() if spec.is_main else rank0_only  # built with parameters on meta on this rank
    if mode == "quantized":
        return _same_draws(trainer, rank0_only, _build_unread(trainer, why, skip), spec.is_main,
                           filled=trainer.denoiser)
    if mode == "whole":
        if spec.sharded:
            log.info("dist=fsdp: every rank loads the trained module whole before sharding (%s)", why)
        elif str(ctx.run.train_mode) != "full" and quantizers(trainer, ctx.cfg):  # one process: why not streamed
            log.info("%s: %s", getattr(trainer, "denoiser", "the trained module"), why)
        return _same_draws(trainer, rank0_only, _build(trainer, skip), spec.is_main)
    name = trainer.denoiser
    if mode == "slices":
        files = trainer.weight_files(name)
        generator = torch.get_rng_state()
        models = _build(trainer, frozenset({name}) | skip)
        if set(files) != set(models[name].state_dict()):  # a layout the slices cannot follow: read it whole
            log.info("dist=fsdp: %s's files do not hold its keys as stored; every rank loads it whole", name)
            del models
            torch.set_rng_state(generator)  # the frozen modules draw again what they drew in the first build
            return _same_draws(trainer, rank0_only, _build(trainer, skip), spec.is_main)
        ctx.dist.pending = PendingLoad(name, "slices", files)
        log.info("dist=fsdp: %s built on meta; each rank reads its shard's rows from %d safetensors file(s)", name,
                 len({f for f, _ in files.values()}))
        return _same_draws(trainer, rank0_only, models, spec.is_main, filled=name)
    # At random init rank 0's build of the trained module draws from the generator before the frozen modules
    # draw theirs: the other ranks build every module empty and receive them. Otherwise nothing drawn
    # depends on the trained module's build: every rank loads (or draws) its frozen modules as one process.
    random_init = trainer.source is None
    empty = frozenset(trainer.module_classes()) if random_init else frozenset({name}) | skip
    models = trainer.build_models("cpu") if spec.is_main else _build(trainer, empty)
    if random_init:
        for other, module in models.items():
            if other != name and other not in rank0_only:  # rank 0's draws; its cache-only modules stay its own
                broadcast_module(module, spec.is_main)
    elif rank0_only:  # a module the files do not hold, drawn after a skipped one: rank 0's (see _same_draws)
        _broadcast_drawn(trainer, models, rank0_only | {name}, spec.is_main)
    _same_generator_as_rank0()  # e.g. the adapters' draws: the other ranks continue from rank 0's generator
    ctx.dist.pending = PendingLoad(name, "broadcast")
    log.info("dist=fsdp: rank 0 builds %s whole (%s); the other ranks receive their shards from it", name,
             why if str(ctx.run.train_mode) != "full" else "random init" if trainer.source is None else "weights read whole")
    return models


def _build_unread(trainer: Any, why: str, skip: frozenset[str] = frozenset()) -> ModelSet:
    """The models with the trained module's base on meta, its weights left in its files (``quantized``);
    ``skip``: modules this rank builds without weights (:func:`rank0_only_modules`)."""
    from runner.meta_weights import UnreadWeights

    name = trainer.denoiser
    generator = torch.get_rng_state()
    models = _build(trainer, frozenset({name}) | skip)
    unread = UnreadWeights(trainer.weight_files(name))
    missing = unread.missing(models[name])
    if missing:  # a layout the layer-by-layer read cannot follow: load it whole
        log.info("%s's files do not hold its keys as stored (e.g. %s); it is loaded whole, then quantized", name,
                 missing[0])
        del models
        torch.set_rng_state(generator)  # the frozen modules draw again what they drew in the first build
        return _build(trainer, skip)
    models.unread[name] = unread
    log.info("%s: %s", name, why)
    return models


def _same_draws(trainer: Any, rank0_only: frozenset[str], models: ModelSet, is_main: bool,
                filled: str = "") -> ModelSet:
    """``models`` as rank 0 built them, where the other ranks skipped ``rank0_only``. Skipping a module
    skips its random draws, which shifts the draws of every module built after it: the randomly
    initialised modules the others did build (not ``filled``, the trained module read from its files
    later) are taken from rank 0, as the broadcast load takes them, and so is rank 0's generator. Every
    rank calls this with the same arguments (their collectives match). Trade-off: at random init those
    modules cross the network once; weights read from files are not sent."""
    if rank0_only:
        _broadcast_drawn(trainer, models, rank0_only | {filled}, is_main)
        _same_generator_as_rank0()
    return models


def _broadcast_drawn(trainer: Any, models: ModelSet, leave: frozenset[str], is_main: bool) -> None:
    """Every randomly initialised module but ``leave``, from rank 0 (:func:`_same_draws`)."""
    source = getattr(trainer, "module_source", None)
    for name, module in models.items():
        if name not in leave and callable(source) and source(name).get("random_init"):
            broadcast_module(module, is_main)


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

    from runner.distributed.launch import cpu_group

    if not is_main:
        materialize(module, torch.device("cpu"))
    with torch.no_grad():  # host tensors: over the gloo group (NCCL takes device tensors only)
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(torch.view_as_real(t.data) if t.is_complex() else t.data, src=0, group=cpu_group())


def _same_generator_as_rank0() -> None:
    """Rank 0 drew the random init; the others take its generator state, so later draws agree with one process."""
    import torch.distributed as dist

    from runner.distributed.launch import cpu_group

    state = torch.get_rng_state()
    dist.broadcast(state, src=0, group=cpu_group())
    torch.set_rng_state(state)


def shard_units(module: nn.Module, blocks: list[nn.Module], shard: Any, pending: PendingLoad | None,
                device: torch.device, comm: torch.device, is_main: bool) -> list[Any]:
    """``shard(block)`` for every block, then ``shard(module, root=True)``; with ``pending`` this rank's
    shards filled too (module docstring). ``device``: where the shards are made (the host with
    ``dist.cpu_offload``); ``comm``: where broadcast tensors travel (the compute device: NCCL's).

    Broadcast, unit by unit. Rank 0 sends each unit's tensors whole just before it shards that unit, so
    the unit's whole weights are dropped as its shards are made: rank 0 holds the whole module plus
    one unit's shards at most, not the whole module next to all of its shards. The other ranks shard
    their empty module first, then keep their rows of each tensor as it arrives (one whole tensor in
    flight). The same bytes torch's ``set_model_state_dict(..., broadcast_from_rank0=True)`` sends,
    in the order of the units.
    """
    if pending is None or pending.mode == "slices" or not is_main:
        groups = _unit_keys(module, blocks) if pending is not None else []
        units = [*(shard(b) for b in blocks), shard(module, root=True)]
        if pending is not None:
            materialize(module, device)
            if pending.mode == "slices":
                _read_slices(module, pending.files)
            else:
                _receive(module, [k for g in groups for k in g], comm)
        return units
    units = []
    groups = _unit_keys(module, blocks)
    for block, keys in zip([*blocks, module], groups):
        _send(module, keys, comm)
        units.append(shard(block, root=block is module))
    return units


def _unit_keys(module: nn.Module, blocks: list[nn.Module]) -> list[list[str]]:
    """The state-dict keys of each block, then the rest (the root unit's)."""
    keys = list(module.state_dict())
    names = {id(m): n for n, m in module.named_modules()}
    groups, taken = [], set()
    for block in blocks:
        prefix = names[id(block)] + "."
        groups.append([k for k in keys if k.startswith(prefix)])
        taken.update(groups[-1])
    groups.append([k for k in keys if k not in taken])
    return groups


def _tensor(module: nn.Module, key: str) -> torch.Tensor:
    owner, _, name = key.rpartition(".")
    sub = module.get_submodule(owner)
    return sub._parameters[name] if name in sub._parameters else sub._buffers[name]


def _send(module: nn.Module, keys: list[str], device: torch.device) -> None:
    import torch.distributed as dist

    with torch.no_grad():
        for key in keys:
            t = _tensor(module, key).detach().to(device)
            dist.broadcast(torch.view_as_real(t) if t.is_complex() else t, src=0)
            del t


def _receive(module: nn.Module, keys: list[str], device: torch.device) -> None:
    import torch.distributed as dist

    with torch.no_grad():
        for key in keys:
            target = _tensor(module, key)
            local = target.to_local() if hasattr(target, "to_local") else target
            full = torch.empty(tuple(target.shape), dtype=local.dtype, device=device)
            dist.broadcast(torch.view_as_real(full) if full.is_complex() else full, src=0)
            rows = _rows(target, local)
            local.copy_(full[rows[0]:rows[1]] if rows is not None else full)
            del full


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
