"""The training loop's side of ``dist=ddp|fsdp``: :class:`Distribution` (a no-op for one process).

What the loop asks of it, each behind one hook in runner/loop.py:

* :meth:`Distribution.shard`: this rank's contiguous share of the step's global batch. The global
  batch (indices and per-sample seeds) is the one-process batch of the same step, whatever the
  world size; so every optimizer step sees the same samples with the same noise, and a resume on
  another number of processes continues the same curve.
* :meth:`Distribution.prepare_models`: before the optimizer is built, the trained modules are
  wrapped: DDP (torch's, prepared by accelerate) or FSDP2 (``fully_shard`` per repeated block,
  runner/blocks.py, and on the module). Under a bf16/fp16 autocast with float32 trained weights
  each unit gets ``MixedPrecisionPolicy(param_dtype=<autocast dtype>, reduce_dtype=float32)``
  (:func:`mixed_precision_policy`, decided as ``ResolvedRun.fsdp_param_dtype``): float32 masters in
  the shards and in the optimizer, bf16 weights gathered one unit at a time, float32 gradient
  reduction. Autocast still runs around the step for the activations; the weights it would cast
  (and cache for the whole forward) arrive in bf16 already.
* loading (runner/distributed/loading.py): under ``dist=fsdp`` a full fine-tune's trained module arrives
  here on ``meta`` (``Distribution.pending``); after ``fully_shard`` each rank fills its shards from
  its slices of the safetensors files, or from rank 0's broadcast.
* :meth:`Distribution.attempts`: each attempt of a step's passes agreed on by every rank
  (runner/distributed/agree.py), the loss averaged over ranks.

Loss and gradient weighting. runner/loop.py:forward_backward weights each micro-batch's loss by
``len(micro-batch) / len(this rank's batch)``, so a rank's gradient is the mean over its share; DDP
and FSDP both *average* the ranks' gradients (sum / world size), and every rank has the same share,
so the result is the mean over the global batch: the one-process gradient. The logged loss is the
mean of the ranks' means: the global batch's mean loss.

DDP without a synchronising backward. A DDP model all-reduces gradients inside its backward. An
out-of-memory error on one rank in the middle of a backward would leave the others waiting in that
all-reduce, so here the attempt's passes call the trained modules directly (DDP's reducer is
idle, nothing is communicated), the ranks agree that every rank finished, and only then is DDP's
backward run once on a zero-valued function of every trained parameter: DDP all-reduces each
parameter's accumulated gradient in its buckets, as it does for gradients accumulated under
``no_sync`` (torch's documented behaviour). Cost: the all-reduce no longer overlaps the last
micro-batch's backward (the whole gradient is sent after the passes); the gradients stay in DDP's
buckets between steps (``gradient_as_bucket_view``), so they are not held twice.

FSDP2 through ``fully_shard`` directly. accelerate's FSDP plugin turns FSDP on only for GPU
process groups (``DistributedType.MULTI_CPU`` is not among its FSDP types in accelerate 1.15), so
the plugin would silently fall back to DDP in this repository's CPU tests. The runner calls the
function accelerate's plugin calls, with the settings it would pass (``reshard_after_forward``,
``CPUOffloadPolicy``, a unit per repeated block and one for the rest), so that the code the CPU
tests run is the code that runs on GPUs. Unlike accelerate's plugin it keeps the resolved trained
dtype (accelerate upcasts trained bf16 weights to float32 under mixed precision) and leaves
precision to the run's autocast, as one process does.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from runner.errors import UserError

if TYPE_CHECKING:
    from runner.context import RunContext
    from runner.resolved import ResolvedRun

log = logging.getLogger("runner")


class Distribution:
    """One process: every hook is the identity or a no-op."""

    active = False
    is_main = True
    grads_to_none = True  # the loop's zero_grad(set_to_none=...)
    pending: Any = None  # dist=fsdp: the trained module's weights still to fill in after fully_shard (dist/loading.py)

    def __init__(self, run: ResolvedRun) -> None:
        self.run = run

    def shard(self, indices: list[int], seeds: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        return indices, seeds

    def gradient_reducer(self) -> Callable[[torch.Tensor], None] | None:
        """What fused backward calls on each gradient before its parameter steps; None: nothing to average."""
        return None

    def prepare_models(self, ctx: RunContext) -> None:
        return None

    def defer_placement(self, ctx: RunContext) -> None:
        return None

    def attempts(self, passes: Callable[[int], float]) -> Callable[[int], float]:
        return passes

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def barrier(self) -> None:
        return None

    def reshard(self) -> None:
        """dist=fsdp: every unit back to its shards (a no-grad forward leaves the root unit gathered)."""
        return None

    def agreed(self, passes: Callable[[int], float]) -> Callable[[int], float]:
        """A pass outside training (the held-out loss) that every rank runs together: agreed on like a step
        under dist=fsdp, whose forwards are collectives; else as it is (every rank's forward is its own)."""
        return passes

    def all_agree(self, ok: bool) -> bool:
        return ok

    def agree_stop(self, signum: int | None) -> int | None:
        return signum

    def save_checkpoint(self, root: Path, state: Any, models: Any, optimizer: Any, scheduler: Any, keep: int,
                        config_text: str | None, optimizer_name: str | None,
                        more_files: Callable[[Path], list[str]] | None = None,
                        more_shards: dict[str, Any] | None = None) -> Path:
        """runner/state/checkpoint.py's checkpoint (every rank's, when several hold the same state).
        ``more_files``: what else one process's checkpoint holds (the EMA: runner/ema/average.py);
        ``more_shards``: sharded tensors by key for the DCP checkpoint of dist=fsdp (the EMA's shards)."""
        from runner.state.checkpoint import save_checkpoint

        state.world_size = self.run.dist.world_size if self.active else 1
        return save_checkpoint(root, state, models, optimizer, scheduler, keep, config_text=config_text,
                               optimizer_name=optimizer_name, more_files=more_files)

    def load_checkpoint(self, ckpt: Path, models: Any, optimizer: Any, scheduler: Any,
                        optimizer_name: str | None) -> Any:
        """A checkpoint of any format and world size (runner/distributed/checkpoint.py)."""
        from runner.distributed.checkpoint import load_any

        return load_any(ckpt, models, optimizer, scheduler, optimizer_name, sharded_run=self.run.dist.sharded)


def build_distribution(run: ResolvedRun) -> Distribution:
    """The run's :class:`Distribution`: the no-op for one process (and in the planner's simulation)."""
    if not run.dist.active or run.simulate:
        return Distribution(run)
    return DataParallel(run)


class DataParallel(Distribution):
    """``dist=ddp`` and ``dist=fsdp`` with more than one process (module docstring)."""

    active = True

    def __init__(self, run: ResolvedRun) -> None:
        super().__init__(run)
        import torch.distributed as dist

        from runner.distributed.agree import Agreement

        if not dist.is_initialized():
            raise RuntimeError("runner.distributed: the process group is not initialised (runner/distributed/launch.py joins it)")
        self.spec = run.dist
        self.is_main = run.dist.is_main
        self.grads_to_none = run.dist.name != "ddp"  # DDP: gradients live in its buckets between steps
        self.agreement = Agreement(run.dist.world_size)
        self.ddp: Any = None
        self.fsdp_root: Any = None
        self.units: list[Any] = []  # dist=fsdp: every fully_shard unit (the blocks, then the root)
        self.reduce_in_hooks = False  # dist=ddp with fused backward: each gradient averaged in its hook (_replicate)

    # ---- the global batch ---------------------------------------------------------------------
    def shard(self, indices: list[int], seeds: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Rank r takes samples ``[r * n, (r + 1) * n)`` of the step's global batch (n = batch / world)."""
        n = len(indices) // self.spec.world_size
        lo = self.spec.rank * n
        return indices[lo:lo + n], seeds[lo:lo + n]

    # ---- models ---------------------------------------------------------------------------------
    def prepare_models(self, ctx: RunContext) -> None:
        trained = {name: ctx.models[name] for name in sorted(ctx.models.trained)}
        if not trained:
            raise UserError(f"dist={self.spec.name}: the trainer trains no module; there is nothing to distribute.")
        if self.spec.name == "fsdp":
            self._shard(ctx, trained)
        else:
            self._replicate(ctx, trained)

    def defer_placement(self, ctx: RunContext) -> None:
        """dist=fsdp: leave the trained module on the host; ``fully_shard`` moves it to the device one unit at a
        time and keeps this rank's shards (the whole module never visits one GPU)."""
        if self.spec.sharded:
            ctx.facts.placed.update(ctx.models.trained)

    def _replicate(self, ctx: RunContext, trained: dict[str, nn.Module]) -> None:
        if bool((ctx.cfg.get("optimizer") or {}).get("fused_backward", False)) if ctx.cfg is not None else False:
            self._replicate_for_fused_backward(trained)
            return
        holder = GradientSync(trained)  # DDP's kwargs: accelerator_options() below, given to the Accelerator
        with warnings.catch_warnings():
            # torch 2.13 deprecates broadcast_buffers for forward_sync_buffers, which would still sync at init;
            # its own advice for buffers that must not be synced is to keep broadcast_buffers=False.
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            self.ddp = ctx.accelerator.prepare_model(holder, device_placement=False)
        log.info("dist=ddp: %s replicated on %d ranks (weights broadcast from rank 0), gradients averaged after each "
                 "step's passes in %s MiB buckets", ", ".join(trained), self.spec.world_size, self.spec.bucket_mb)

    def _replicate_for_fused_backward(self, trained: dict[str, nn.Module]) -> None:
        """dist=ddp with ``optimizer.fused_backward``: no DDP. Its buckets would hold every trained
        gradient for the whole run, the memory fused backward exists to free; instead the weights are
        broadcast from rank 0 (what DDP does at construction) and each gradient is averaged over the
        ranks in its post-accumulate-grad hook, just before its parameter steps (:meth:`gradient_reducer`).
        Every rank runs the same graph, so the hooks (and their all-reduces) come in the same order.
        Trade-off: one all-reduce per parameter, none overlapping the next one, instead of DDP's buckets."""
        import torch.distributed as dist

        with torch.no_grad():
            for module in trained.values():
                for t in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(t.data, src=0)
        self.reduce_in_hooks = True
        log.info("dist=ddp with fused backward: %s replicated on %d ranks (weights broadcast from rank 0); each gradient "
                 "is averaged over the ranks in its hook, then its parameter steps (no DDP buckets)",
                 ", ".join(trained), self.spec.world_size)

    def gradient_reducer(self) -> Callable[[torch.Tensor], None] | None:
        if not self.reduce_in_hooks:
            return None
        import torch.distributed as dist

        world = self.spec.world_size

        def average(grad: torch.Tensor) -> None:
            dist.all_reduce(grad)
            grad.div_(world)

        return average

    def _shard(self, ctx: RunContext, trained: dict[str, nn.Module]) -> None:
        from torch.distributed.fsdp import fully_shard

        from runner.blocks import find_repeated_blocks
        from runner.distributed.agree import agree_before_fsdp_collectives

        if len(trained) > 1:
            raise UserError(
                f"dist=fsdp shards one trained module; this trainer trains {len(trained)} ({', '.join(trained)}). Use "
                "dist=ddp, or train one module.")
        name, module = next(iter(trained.items()))
        blocks = ctx.models.blocks.get(name) or find_repeated_blocks(module)
        mesh = self._mesh(ctx.device)
        kwargs: dict[str, Any] = {"reshard_after_forward": self.spec.reshard_after_forward, "mesh": mesh}
        if self.spec.cpu_offload:
            kwargs["offload_policy"] = cpu_offload_policy(ctx.device)
        policy = mixed_precision_policy(self.run.fsdp_param_dtype)
        if policy is not None:
            kwargs["mp_policy"] = policy
        ignored = _unshardable_params(module)
        if ignored:
            kwargs["ignored_params"] = ignored
            for sub in module.modules():  # fully_shard leaves ignored parameters where they are: move them now
                if any(p in ignored for p in sub.parameters(recurse=False)):
                    sub.to(ctx.device)
        from runner.distributed.loading import shard_units

        root_kwargs = {k: v for k, v in kwargs.items() if k != "reshard_after_forward"}  # the root keeps its rest
        pending, self.pending = self.pending, None  # built on meta (runner/distributed/loading.py): shards filled here
        units = shard_units(module, blocks, lambda m, root=False: fully_shard(m, **(root_kwargs if root else kwargs)),
                            pending, torch.device("cpu") if self.spec.cpu_offload else ctx.device, ctx.device,
                            self.is_main)
        self.fsdp_root = units[-1]
        self.units = units
        agree_before_fsdp_collectives(units, self.agreement)
        log.info("dist=fsdp: %s sharded over %d rank(s) in %d units (%d repeated blocks + the rest)%s%s%s", name,
                 self.spec.shard_size, len(units), len(blocks),
                 "; sharded weights on the host" if self.spec.cpu_offload else "",
                 "" if policy is None else f"; float32 shards, each unit all-gathered in "
                 f"{str(policy.param_dtype).replace('torch.', '')}, gradients reduce-scattered in float32",
                 f"; {len(ignored)} quantized tensors kept whole on every rank" if ignored else "")

    def _mesh(self, device: torch.device) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        kind = device.type
        world, shard = self.spec.world_size, self.spec.shard_size
        if shard == world:
            return init_device_mesh(kind, (world,), mesh_dim_names=("shard",))
        return init_device_mesh(kind, (world // shard, shard), mesh_dim_names=("replicate", "shard"))

    # ---- one attempt of a step's passes ----------------------------------------------------------
    def attempts(self, passes: Callable[[int], float]) -> Callable[[int], float]:
        return self.agreement.attempts(passes, self._after_failure, self._synchronize_gradients)

    def _after_failure(self) -> None:
        if self.fsdp_root is not None:
            self.fsdp_root.reset_iter_state()  # torch's recovery after an exception mid-forward/backward

    def _synchronize_gradients(self) -> None:
        """DDP: all-reduce (average) every trained parameter's gradient (module docstring)."""
        if self.ddp is None:
            return
        self.ddp().backward()

    # ---- coordination -----------------------------------------------------------------------------
    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Rank 0 runs the block first (fills the encoder cache), the others after it finished."""
        from accelerate import PartialState

        return PartialState().main_process_first()

    def barrier(self) -> None:
        import torch.distributed as dist

        from runner.distributed.launch import cpu_group

        dist.barrier(group=cpu_group())

    def reshard(self) -> None:
        for unit in self.units:
            unit.reshard()

    def agreed(self, passes: Callable[[int], float]) -> Callable[[int], float]:
        """dist=fsdp: every attempt agreed on as a training step's (an OOM on one rank is retried by all, the
        loss is the ranks' mean); dist=ddp: as in one process (no collective in the forward)."""
        if self.fsdp_root is None:
            return passes
        return self.agreement.attempts(passes, self._after_failure, lambda: None)

    def agree_stop(self, signum: int | None) -> int | None:
        """A stop signal received by any rank, on every rank (they stop after the same step)."""
        import torch.distributed as dist

        from runner.distributed.launch import cpu_group

        t = torch.tensor([signum or 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
        return int(t.item()) or None

    def save_checkpoint(self, root: Path, state: Any, models: Any, optimizer: Any, scheduler: Any, keep: int,
                        config_text: str | None, optimizer_name: str | None,
                        more_files: Callable[[Path], list[str]] | None = None,
                        more_shards: dict[str, Any] | None = None) -> Path:
        """DDP: rank 0 writes the full checkpoint, with ``more_files`` (the EMA, the same on every rank);
        FSDP: a sharded one (runner/distributed/checkpoint.py): ``more_shards`` (the EMA's shards) in its DCP
        folder, written by every rank, and ``more_files`` (the EMA's ema.json) by rank 0."""
        from runner.distributed.checkpoint import save_replicated, save_sharded

        state.world_size = self.spec.world_size
        if self.spec.sharded:
            return save_sharded(self, root, state, models, optimizer, scheduler, keep, config_text, optimizer_name,
                                more_files=more_files, more_shards=more_shards)
        parent = super().save_checkpoint
        return save_replicated(self, lambda: parent(root, state, models, optimizer, scheduler, keep, config_text,
                                                    optimizer_name, more_files))

    def all_agree(self, ok: bool) -> bool:
        """True on every rank when ``ok`` is true on every rank."""
        import torch.distributed as dist

        from runner.distributed.launch import cpu_group

        t = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(t, group=cpu_group())
        return int(t.item()) == 0


class GradientSync(nn.Module):
    """The module DDP wraps: the trained modules as children, and a forward that is a zero-valued
    function of every trained parameter. Its backward through DDP all-reduces the gradients that
    the step's passes accumulated (runtime module docstring)."""

    def __init__(self, trained: dict[str, nn.Module]) -> None:
        super().__init__()
        self.trained = nn.ModuleDict(trained)

    def forward(self) -> torch.Tensor:
        params = [p for p in self.parameters() if p.requires_grad]
        # sum() has an expanded (stride-0) gradient: adding it allocates nothing per parameter.
        return torch.stack([p.sum().float() for p in params]).sum() * 0.0


FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def mixed_precision_policy(param_dtype: torch.dtype | None) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for ``ResolvedRun.fsdp_param_dtype`` (None: none, FSDP's default).

    ``param_dtype``: each unit's float32 shards are cast and all-gathered in the autocast dtype, so the
    unit computes with bf16/fp16 weights that FSDP frees after the unit (no autocast cast cache of whole
    float32 weights; half the all-gather bytes). ``reduce_dtype=float32``: the unit's gradients, computed
    in the low dtype as under autocast, are reduce-scattered and kept in float32 for the float32 masters.
    ``cast_forward_inputs=False``: autocast alone decides the activations' dtypes, as in one process
    (FSDP's default would round every float input of a unit, timesteps included, to bf16 first).
    """
    if param_dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def cpu_offload_policy(device: torch.device) -> Any:
    """FSDP2's ``CPUOffloadPolicy`` for ``dist.cpu_offload=true`` with the compute device ``device``.

    Host shards are pinned only for a CUDA-like target (:func:`runner.side_streams.cuda_like`): pinned memory
    makes FSDP's host-to-device copies of each unit asynchronous, but pinning needs CUDA's host
    allocator, and a CPU-only torch raises "Cannot access accelerator device" for it (FSDP2 pins by
    default). On a CPU run the compute device is the host itself, so FSDP's "offload" moves nothing and
    ordinary memory loses nothing. (``train.device=cuda_sim`` would pin in its simulation, as park does;
    ``dist`` is refused with it: its simulated card is one process's.)
    """
    from torch.distributed.fsdp import CPUOffloadPolicy

    from runner.side_streams import cuda_like

    return CPUOffloadPolicy(pin_memory=cuda_like(device))


def _unshardable_params(module: nn.Module) -> set[nn.Parameter]:
    """Frozen parameters FSDP cannot split: bitsandbytes' quantized storage (its quantization state
    describes the whole tensor) and float8 storage. They stay whole on every rank. In the planner's
    simulation every parameter is a fake tensor, not an ``nn.Parameter``: there the storage dtype
    alone tells (its quantization simulations store uint8/int8), so a LoRA's plain frozen base is
    planned sharded, as it is sharded in a real run."""
    from runner.compat import is_fake

    out: set[nn.Parameter] = set()
    for p in module.parameters():
        if p.requires_grad:
            continue
        wrapped = type(p) is not nn.Parameter and not is_fake(p)  # bitsandbytes' Params4bit / Int8Params
        if wrapped or not p.is_floating_point() or p.dtype in FLOAT8:
            out.add(p)
    return out


def accelerator_options(run: ResolvedRun) -> dict[str, Any]:
    """What runner/loop.py:make_accelerator adds for this run's distribution: DDP's settings."""
    if not run.dist.active or run.dist.name != "ddp":
        return {}
    from accelerate.utils import DistributedDataParallelKwargs

    # broadcast_buffers off: DDP's forward here is the zero-valued sync pass, and frozen buffers
    # never change; gradient_as_bucket_view: the gradients live in DDP's buckets, not twice.
    return {"kwargs_handlers": [DistributedDataParallelKwargs(
        broadcast_buffers=False, gradient_as_bucket_view=True, bucket_cap_mb=max(1, int(round(run.dist.bucket_mb))))]}
