"""The run, decided once: device, planned device, precision, dtypes, budget and batch geometry.

Every question of the form "which device / dtype / budget does this run use?" is answered here,
from the composed config, before anything is built. The loop, the planner, every plugin, the
optimizer factory and the tiling code read a :class:`ResolvedRun`; none of them looks at
``train.device``, ``train.mixed_precision``, ``model.dtype`` or ``budget_gb`` again. That is what
makes a CPU run's own preflight and ``mode=plan train.device=cpu`` plan the same bytes: both
resolve through :func:`resolve` with the same answer.

Two devices are distinguished:

* ``device`` -- where tensors really live while this process runs (``cpu``, ``cuda``; ``meta``
  inside the planner, see :meth:`ResolvedRun.simulated`; ``cpu:0`` for ``train.device=cuda_sim``,
  a simulated card in CPU memory: runner/memory/cuda_sim.py);
* ``target`` -- the device type the step is *for* (``cuda`` or ``cpu``): what the planner plans,
  and what precision and dtype policies are decided for. A plan made on a CPU-only machine for a
  GPU has ``device=meta``, ``target=cuda``.

The CPU policy (decided here and nowhere else): bf16/fp16 autocast and bf16 weights are emulated
on CPUs without native bf16 matmuls (the tiny SDXL step went from ~0.1 s to 2.6 s), and without
autocast a bf16 frozen base would meet float32 activations, so a CPU target computes and stores
every weight in float32 unless ``train.cpu_autocast=true``. Presets are written for GPUs and still
run, unchanged, on a laptop, with any trainer.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from runner.side_streams import SIM_DEVICE, is_simulated_cuda
from runner.devices import DeviceSpec, device_spec
from runner.errors import UserError
from runner.world import DistSpec, resolve_distribution

log = logging.getLogger("runner")

GiB = 2**30
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ResolvedRun:
    """What one run does, decided once (see the module docstring). Immutable: derive, never edit."""

    device: torch.device  # where tensors live in this process
    host: torch.device  # where host-resident tensors live (cpu; fake cpu in the planner)
    target: str  # "cuda" | "cpu": the device type the step is for
    precision: str  # "no" | "bf16" | "fp16": the autocast this run really uses
    frozen_dtype: torch.dtype  # model.dtype: frozen modules and a LoRA's frozen base
    train_dtype: torch.dtype  # trained weights: a fully trained module, or the LoRA adapters
    train_mode: str  # "full" | "lora" | "lokr" | "loha" (runner/adapters.py)
    budget_bytes: Optional[int]  # device memory budget (budget_gb), None when unset
    batch_size: int  # samples per optimizer step
    grad_accum: int  # micro-batches per optimizer step
    max_grad_norm: float  # 0 disables clipping
    seed: int
    simulate: bool = False  # True inside the planner: tensors are fake, device is meta
    ema_dtype: Optional[torch.dtype] = None  # ema.enabled: the dtype of the EMA copy (runner/ema/average.py); None: no EMA
    gpu: Optional[DeviceSpec] = None  # device.name / device.spec: the GPU the run is for (runner/devices.py)
    dist: DistSpec = DistSpec()  # dist=none|ddp|fsdp, world size and this rank (runner/distributed/config.py)
    # dist=fsdp with a bf16/fp16 autocast and float32 trained weights: the dtype FSDP2 all-gathers the
    # weights in (MixedPrecisionPolicy param_dtype; gradients reduced in float32). None: FSDP gathers the
    # stored dtype and autocast casts (see fsdp_param_dtype_of).
    fsdp_param_dtype: torch.dtype | None = None
    # The planner's copy of a run about to start (the preflight): the run's own device type, which keys
    # its encoder cache (``cpu`` for cuda_sim's card); "" when the run is only planned.
    run_device_type: str = ""

    @property
    def rank_batch(self) -> int:
        """Samples of each optimizer step's global batch that this rank takes (all of them in one process)."""
        return self.batch_size // self.dist.world_size if self.dist.active else self.batch_size

    @property
    def micro_batch(self) -> int:
        """Samples per forward/backward pass on this rank (OOM recovery may lower it at run time)."""
        return self.rank_batch // self.grad_accum

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        return AUTOCAST_DTYPES.get(self.precision)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in: the autocast dtype, else the frozen weights' dtype."""
        return self.autocast_dtype or self.frozen_dtype

    @property
    def on_cuda(self) -> bool:
        """Whether the step is for CUDA (CUDA-only features: pinned memory, side streams, paging)."""
        return self.target == "cuda"

    @property
    def simulated_card(self) -> bool:
        """``train.device=cuda_sim``: the CUDA step, run with real values on a simulated card in CPU memory."""
        return self.target == "cuda" and is_simulated_cuda(self.device)

    @property
    def budget_gb(self) -> Optional[float]:
        return None if self.budget_bytes is None else self.budget_bytes / GiB

    def simulated(self) -> ResolvedRun:
        """The same run as the planner simulates it: fake tensors on ``meta``, host on fake ``cpu``."""
        own = self.run_device_type or ("" if self.device.type == "meta" else self.device.type)
        return dataclasses.replace(self, device=torch.device("meta"), host=torch.device("cpu"), simulate=True,
                                   run_device_type=own)

    def describe(self, own_batches: bool = False) -> str:
        """One log line: what was decided. ``own_batches``: a hosted loop's batches are its loader's,
        so the line names no batch geometry of the runner's."""
        budget = "no budget" if self.budget_bytes is None else f"budget {self.budget_bytes / GiB:g} GiB"
        if self.gpu is not None:
            budget += f" ({self.gpu.label})"
        autocast = f"{self.precision} autocast" if self.precision != "no" else "no autocast"
        name = lambda d: str(d).replace("torch.", "")  # noqa: E731
        ema = f", EMA in {name(self.ema_dtype)}" if self.ema_dtype is not None else ""
        batch = (f"batch {self.batch_size} as {self.grad_accum} x {self.micro_batch}" if not self.dist.active else
                 f"global batch {self.batch_size}, {self.rank_batch} per rank as {self.grad_accum} x {self.micro_batch}")
        if own_batches:
            batch = "the loop's own batches"
        gathered = (f", weights all-gathered in {name(self.fsdp_param_dtype)} and gradients reduced in float32"
                    if self.fsdp_param_dtype is not None else "")
        return (f"run: on {self.device} for {self.target}, {autocast}, frozen weights {name(self.frozen_dtype)}, "
                f"trained ({self.train_mode}) {name(self.train_dtype)}{ema}, {batch}, {budget}"
                + ("" if not self.dist.active else f"; {self.dist.describe()}{gathered}"))


def fsdp_param_dtype_of(dist: DistSpec, precision: str, train_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype FSDP2 all-gathers a sharded module's weights in, decided once (``ResolvedRun.fsdp_param_dtype``).

    Under ``dist=fsdp`` with a bf16/fp16 autocast and float32 trained weights: the autocast dtype, given to
    ``fully_shard`` as ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)`` (runner/distributed/runtime.py).
    Why: without it each unit is gathered in float32 and autocast casts every weight to bf16 and keeps the copy
    in its cast cache until the forward ends (with checkpointed blocks: a bf16 copy of the whole module per
    rank); with it the shards stay float32 masters, each unit arrives in bf16 (half the all-gather traffic),
    is freed after use, and the gradients are reduce-scattered in float32. Autocast still runs for the
    activations (float32 ops such as norms and softmax, inputs of the matmuls); a weight that arrives in the
    autocast dtype is never cast or cached. Trade-off: the unit's matmuls see bf16 weights, as under autocast.
    None otherwise: one process, dist=ddp, no autocast, trained weights already stored in bf16/fp16, or
    ``dist.mixed_precision=false`` (float32 gathers; autocast casts and caches them).
    """
    if dist.name != "fsdp" or not dist.active or not dist.mixed_precision or train_dtype != torch.float32:
        return None
    return AUTOCAST_DTYPES.get(precision)


def running_device(cfg: Any) -> torch.device:
    """The device this process trains on: ``train.device``, with ``auto`` meaning CUDA when present."""
    want = str(cfg.train.device)
    if want == "cuda_sim":
        return SIM_DEVICE
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA device is available. Use train.device=cpu or auto.")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def planned_target(cfg: Any) -> str:
    """The device type ``mode=plan`` plans for: CUDA unless ``train.device=cpu`` (planning for a GPU
    from a machine without one is the planner's point)."""
    return "cpu" if str(cfg.train.device) == "cpu" else "cuda"


def resolve(cfg: Any, *, target: Optional[str] = None, device: Optional[torch.device] = None) -> ResolvedRun:
    """Decide the run from the composed, validated config.

    ``target``/``device`` default to the running device (a training run). ``mode=plan`` passes
    ``target=planned_target(cfg)`` and ``device=meta``. The CPU precision policy of the module
    docstring is applied here, once.
    """
    dist = resolve_distribution(cfg, planning=device is not None and device.type == "meta")
    if device is None:
        device = running_device(cfg)
        if device.type == "cuda" and dist.active:
            device = torch.device("cuda", dist.local_rank)  # one GPU per process: LOCAL_RANK's
    if target is None:
        target = "cuda" if device.type == "cuda" or is_simulated_cuda(device) else "cpu"
    precision = str(cfg.train.mixed_precision)
    model = cfg.model
    train_dtype_name = str(model.get("train_dtype", "float32"))
    cpu_autocast = bool(cfg.train.get("cpu_autocast", False))
    frozen_dtype_name = str(model.get("dtype", "float32"))
    if target == "cpu" and not cpu_autocast:
        if precision != "no" or train_dtype_name != "float32" or frozen_dtype_name != "float32":
            log.info("train.mixed_precision=%s, model.dtype=%s and model.train_dtype=%s apply on CUDA; this CPU "
                     "run computes and stores weights in float32 (train.cpu_autocast=true keeps them on CPU)",
                     precision, frozen_dtype_name, train_dtype_name)
        precision, train_dtype_name, frozen_dtype_name = "no", "float32", "float32"
    budget = cfg.get("budget_gb")
    budget_bytes = None if budget is None else int(float(budget) * GiB)
    gpu = device_spec(cfg.get("device")) if target == "cuda" else None
    if gpu is not None:  # a named card: its usable memory is the default budget, and caps a larger one
        usable = int(gpu.usable_gib * GiB)
        budget_bytes = usable if budget_bytes is None else min(budget_bytes, usable)
    return ResolvedRun(
        device=torch.device(device),
        host=torch.device("cpu"),
        target=target,
        precision=precision,
        frozen_dtype=DTYPES[frozen_dtype_name],
        train_dtype=DTYPES[train_dtype_name],
        train_mode=str(model.get("train", "full")),
        budget_bytes=budget_bytes,
        batch_size=int(cfg.train.batch_size),
        grad_accum=int(cfg.train.grad_accum),
        max_grad_norm=float(cfg.train.max_grad_norm),
        seed=int(cfg.train.seed),
        ema_dtype=resolve_ema_dtype(cfg.get("ema"), DTYPES[train_dtype_name]),
        gpu=gpu,
        dist=dist,
        fsdp_param_dtype=fsdp_param_dtype_of(dist, precision, DTYPES[train_dtype_name]),
    )


def resolve_ema_dtype(ema_cfg: Any, train_dtype: torch.dtype) -> Optional[torch.dtype]:
    """The EMA copy's dtype for a run whose trained weights are ``train_dtype`` (None: no EMA).

    float32 unless ``ema.dtype=bfloat16`` and the trained weights are bfloat16 (a CPU run trains
    float32 weights, so its EMA is float32 too).
    """
    if ema_cfg is None or not ema_cfg.get("enabled", False):
        return None
    if str(ema_cfg.get("dtype", "float32")) == "bfloat16" and train_dtype == torch.bfloat16:
        return torch.bfloat16
    return torch.float32
