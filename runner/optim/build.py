"""Optimizers: the ``optimizer`` config group, the factory, and what their state costs.

Optimizer state is the largest memory item of a full fine-tune after the weights: AdamW keeps
two moments per parameter, 8 B/param in float32 (SDXL's U-Net: 2.6 B params -> 21 GB). The
options, one dataclass schema each in Hydra's ConfigStore group ``optimizer``
(``optimizer=adamw8bit optimizer.lr=1e-5``; the schemas are in runner/optim/config.py, without torch):

========================  ==============================================  ===========================
option                    state per parameter tensor of n elements         notes
========================  ==============================================  ===========================
``adamw``                 2 x n in the parameter's dtype + a 4 B step      torch, ``foreach=False``
                          (float32 scalar on the host)                     (no multi-tensor temporaries)
``adamw8bit``             2 x n bytes (uint8) + 2 float32 absmax per        bitsandbytes, blockwise
                          256-block + two 1 KiB quantile maps per          8-bit states; tensors under
                          optimizer; 8 B/param under ``min_8bit_size``     ``min_8bit_size`` stay 32-bit
``paged_adamw8bit``       as ``adamw8bit``, in CUDA unified memory for      needs CUDA (validated)
                          tensors of >= 1e5 elements
``adafactor``             matrices: (rows + cols) x 4 B (factored second    transformers, no first moment
                          moment); vectors: 4n; + a 4 B RMS per tensor      by default
========================  ==============================================  ===========================

Adafactor is configured as kohya/OneTrainer recommend for diffusion fine-tunes:
``relative_step=False`` and ``scale_parameter=False``, so ``optimizer.lr`` is the step size and
``train.lr_scheduler`` schedules it exactly as for the other optimizers. Adafactor's relative
step would replace the runner's schedule, and transformers then requires ``lr=None``, which
torch's LR schedulers cannot scale; so it is not offered. ``beta1=None`` (no first moment) is
what makes Adafactor small; setting it adds an n-element float32 moment.

Paged optimizers keep their large state tensors in CUDA unified memory, which the driver pages
to host RAM when the device runs short (cheap when everything fits). On the CPU bitsandbytes
falls back to the non-paged optimizer with a warning; validation refuses that combination
instead, so that a preset asking for paging never silently runs without it.

The planner cannot run the bitsandbytes kernels on fake tensors, and needs the state's bytes
without the arithmetic: :func:`build_optimizer` with ``simulate=True`` returns a
:class:`SimulatedOptimizer` that allocates exactly the tensors the real optimizer would (from
:func:`state_layout`, checked against the real optimizers byte for byte in
tests/runner/optim/test_optimizers.py) and updates nothing. :func:`simulate_state_bytes` gives the same
figure without allocating.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from runner.compat import DTensor, dtensor_local
from runner.errors import UserError, valid_list
from runner.optim.config import (  # noqa: F401  (the schemas: re-exported)
    AdafactorConfig,
    AdamW8bitConfig,
    AdamWConfig,
    PagedAdamW8bitConfig,
    check_optimizer_config,
    store_optimizer_schemas,  # runner/config/__init__.py used to take it from here
)

log = logging.getLogger("runner")


class ForwardsToInner(torch.optim.Optimizer):
    """An optimizer wrapper (offload=optimizer's host steps, fused backward) whose groups, state and defaults are the inner optimizer's own.

    Schedulers, accelerate and checkpointing read and write these attributes; forwarding them keeps
    one source of truth instead of copies that drift after a load_state_dict.
    """

    inner: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

BNB_BLOCKSIZE = 256  # bitsandbytes' blockwise 8-bit optimizer state block
PAGED_MIN_NUMEL = 100_000  # bitsandbytes pages only state tensors of at least this many elements


# ---- state layout -------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateTensor:
    """One tensor an optimizer keeps for one parameter.

    ``where``: ``"param"`` (the parameter's device), ``"host"`` (CPU, e.g. torch AdamW's step
    counter) or ``"paged"`` (CUDA unified memory). ``shared``: a key when one tensor serves every
    parameter on a device (bitsandbytes' quantile maps), counted once.
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    where: str = "param"
    shared: Optional[str] = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _adamw_layout(cfg: Any, p: torch.Tensor) -> list[StateTensor]:
    shape = tuple(p.shape)
    return [
        StateTensor("step", (), torch.get_default_dtype(), "host"),
        StateTensor("exp_avg", shape, p.dtype),
        StateTensor("exp_avg_sq", shape, p.dtype),
    ]


def _adamw8bit_layout(cfg: Any, p: torch.Tensor, paged: bool = False) -> list[StateTensor]:
    shape, n = tuple(p.shape), p.numel()
    where = "paged" if paged and p.device.type != "cpu" and n >= PAGED_MIN_NUMEL else "param"
    if n < int(cfg.min_8bit_size):
        return [StateTensor("state1", shape, torch.float32, where), StateTensor("state2", shape, torch.float32, where)]
    blocks = math.ceil(n / BNB_BLOCKSIZE)
    return [
        StateTensor("state1", shape, torch.uint8, where),
        StateTensor("qmap1", (256,), torch.float32, shared="dynamic"),
        StateTensor("state2", shape, torch.uint8, where),
        StateTensor("qmap2", (256,), torch.float32, shared="udynamic"),
        StateTensor("absmax1", (blocks,), torch.float32),
        StateTensor("absmax2", (blocks,), torch.float32),
    ]


def _adafactor_layout(cfg: Any, p: torch.Tensor) -> list[StateTensor]:
    shape = tuple(p.shape)
    dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype  # grads are upcast
    out = []
    if cfg.beta1 is not None:
        out.append(StateTensor("exp_avg", shape, dtype))
    if len(shape) >= 2:
        out.append(StateTensor("exp_avg_sq_row", shape[:-1], dtype))
        out.append(StateTensor("exp_avg_sq_col", shape[:-2] + shape[-1:], dtype))
    else:
        out.append(StateTensor("exp_avg_sq", shape, dtype))
    out.append(StateTensor("RMS", (), dtype))
    return out


# ---- builders -----------------------------------------------------------------------------------
def _build_adamw(cfg: Any, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # foreach=False: the multi-tensor path allocates temporaries for all parameters at once.
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False
    )


def _build_adamw8bit(cfg: Any, params: list[torch.nn.Parameter], paged: bool = False) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
    return cls(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
        min_8bit_size=int(cfg.min_8bit_size),
    )


def _build_adafactor(cfg: Any, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(
        params, lr=cfg.lr, eps=tuple(cfg.eps), clip_threshold=cfg.clip_threshold, decay_rate=cfg.decay_rate,
        beta1=cfg.beta1, weight_decay=cfg.weight_decay, scale_parameter=bool(cfg.scale_parameter),
        relative_step=False, warmup_init=False,
    )


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    config: type
    build: Callable[[Any, list[torch.nn.Parameter]], torch.optim.Optimizer]
    layout: Callable[[Any, torch.Tensor], list[StateTensor]]
    needs_cuda: bool = False


OPTIMIZERS: dict[str, OptimizerSpec] = {
    s.name: s
    for s in (
        OptimizerSpec("adamw", AdamWConfig, _build_adamw, _adamw_layout),
        OptimizerSpec("adamw8bit", AdamW8bitConfig, _build_adamw8bit, _adamw8bit_layout),
        OptimizerSpec(
            "paged_adamw8bit", PagedAdamW8bitConfig,
            lambda cfg, params: _build_adamw8bit(cfg, params, paged=True),
            lambda cfg, p: _adamw8bit_layout(cfg, p, paged=True),
            needs_cuda=True,
        ),
        OptimizerSpec("adafactor", AdafactorConfig, _build_adafactor, _adafactor_layout),
    )
}


def _spec(cfg: Any) -> OptimizerSpec:
    name = str(cfg.name)
    if name not in OPTIMIZERS:
        raise UserError(f"optimizer.name={name!r} is not valid. Valid values: {valid_list(name, OPTIMIZERS)}.")
    return OPTIMIZERS[name]


def state_layout(cfg: Any, param: torch.Tensor) -> list[StateTensor]:
    """The state tensors the optimizer ``cfg`` describes keeps for ``param`` (after one step)."""
    return _spec(cfg).layout(cfg, param)


def build_optimizer(
    cfg: Any,
    params: Iterable[torch.nn.Parameter],
    notes: Optional[dict[str, Any]] = None,
    simulate: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` (an ``optimizer`` group node) describes, over ``params``.

    ``notes``: a dict (``ctx.notes``) that receives ``"optimizer state bytes"`` after the first
    step, when the state exists; the run log gets the same line. ``simulate``: for the planner,
    a :class:`SimulatedOptimizer` that allocates the same state and updates nothing.
    """
    params = list(params)
    if not params:
        raise UserError("Nothing to train: the trainer marked no parameter as trainable (check model.train).")
    spec = _spec(cfg)
    if simulate:
        optimizer: torch.optim.Optimizer = SimulatedOptimizer(params, cfg)
    else:
        if spec.needs_cuda and any(p.device.type != "cuda" for p in params):
            raise UserError(
                f"optimizer={spec.name} needs the trained parameters on CUDA (its state lives in CUDA unified "
                f"memory); these are on {params[0].device}. Use optimizer=adamw8bit."
            )
        optimizer = spec.build(cfg, params)
    if notes is not None:
        _report_state_bytes_after_first_step(optimizer, notes, spec.name)
    return optimizer


def _report_state_bytes_after_first_step(optimizer: torch.optim.Optimizer, notes: dict[str, Any], name: str) -> None:
    """A one-shot post-step hook: state exists only after the first step (all four are lazy)."""
    handle: Any = None

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        nbytes = optimizer_state_bytes(opt)
        n_params = sum((dtensor_local(p) if isinstance(p, DTensor) else p).numel()
                       for g in opt.param_groups for p in g["params"])  # this rank's share under dist=fsdp
        notes["optimizer state bytes"] = nbytes
        log.info(
            "optimizer=%s state after the first step: %d bytes (%.2f MiB) for %d parameters (%.3f B/param)",
            name, nbytes, nbytes / 2**20, n_params, nbytes / max(n_params, 1),
        )
        handle.remove()

    handle = optimizer.register_step_post_hook(hook)


# ---- measuring and simulating ----------------------------------------------------------------------
def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                yield dtensor_local(v) if isinstance(v, DTensor) else v  # dist=fsdp: this rank's shard


def optimizer_state_bytes_by_device(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Exact bytes of the optimizer's state tensors per device, each storage counted once."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for t in _state_tensors(optimizer):
        s = t.untyped_storage()
        if s._cdata in seen:
            continue
        seen.add(s._cdata)
        out[str(t.device)] = out.get(str(t.device), 0) + int(s.nbytes())
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Exact bytes of all the optimizer's state tensors (shared ones such as quantile maps once)."""
    return sum(optimizer_state_bytes_by_device(optimizer).values())


def _device_of(spec: StateTensor, p: torch.Tensor) -> str:
    if spec.where == "host":
        return "cpu"
    return "paged" if spec.where == "paged" else str(p.device)


def simulate_state_bytes(cfg: Any, params: Iterable[torch.Tensor]) -> dict[str, int]:
    """Bytes the optimizer ``cfg`` will hold for ``params`` after one step, per device.

    Keys are device strings (``"cuda:0"``, ``"meta"``, ``"cpu"`` for host-side counters) and
    ``"paged"`` for CUDA unified memory (resident on the device until it runs short; not
    counted by ``torch.cuda.memory_allocated``). Works on meta and fake parameters.
    """
    out: dict[str, int] = {}
    shared: set[tuple[str, str]] = set()
    for p in params:
        for spec in state_layout(cfg, p):
            dev = _device_of(spec, p)
            if spec.shared is not None:
                if (spec.shared, dev) in shared:
                    continue
                shared.add((spec.shared, dev))
            out[dev] = out.get(dev, 0) + spec.nbytes
    return out


class SimulatedOptimizer(torch.optim.Optimizer):
    """Allocates exactly the state of the optimizer ``cfg`` names, and never changes a parameter.

    For the planner: on fake parameters the state tensors are fake (allocated in the
    parameters' fake mode), so a live-bytes tracker sees them born in the optimizer step. Host
    counters go to ``host`` (default CPU); paged state to ``paged_device`` (default: the
    parameter's device, where it lives while memory suffices). Per-step temporaries of the real
    update are not simulated; measured with the tracker on CPU (tiny MLP): AdamW holds two
    tensors the size of the largest parameter above its state at the peak (``sqrt`` and the
    division of ``exp_avg_sq``), bitsandbytes' 8-bit update none (fused kernel, on CPU too),
    Adafactor about two float32 copies of the largest parameter (four for bf16 parameters, which
    it upcasts).
    """

    # > 0 while a simulated optimizer creates its state: the first step's allocations, which a
    # steady-state step does not repeat (the planner's step-time counter skips their ops).
    allocating = 0

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        cfg: Any,
        host: torch.device | str = "cpu",
        paged_device: torch.device | str | None = None,
    ) -> None:
        self.cfg = cfg
        self.host = torch.device(host)
        self.paged_device = torch.device(paged_device) if paged_device is not None else None
        self._shared: dict[tuple[str, str], torch.Tensor] = {}
        super().__init__(params, {"lr": float(cfg.lr)})

    @torch.no_grad()
    def allocate_state(self) -> None:
        """Every parameter's state now, as after a first step (fused backward's steady state)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    for spec in state_layout(self.cfg, p):
                        state[spec.key] = self._allocate(spec, p)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = closure() if closure is not None else None
        SimulatedOptimizer.allocating += 1
        try:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        for spec in state_layout(self.cfg, p):
                            state[spec.key] = self._allocate(spec, p)
        finally:
            SimulatedOptimizer.allocating -= 1
        return loss

    def _allocate(self, spec: StateTensor, p: torch.Tensor) -> torch.Tensor:
        if spec.where == "host":
            device = self.host
        elif spec.where == "paged" and self.paged_device is not None:
            device = self.paged_device
        else:
            device = p.device
        key = (spec.shared, str(device)) if spec.shared is not None else None
        if key is not None and key in self._shared:
            return self._shared[key]
        mode = getattr(p, "fake_mode", None)
        with mode if mode is not None else nullcontext():
            t = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        if key is not None:
            self._shared[key] = t
        return t


# ---- validation ----------------------------------------------------------------------------------
def validate_optimizer(cfg: Any, run: Any) -> None:
    """Name, schema and requirements of ``cfg.optimizer`` for the resolved ``run``; each failure
    names the key and the fix."""
    check_optimizer_config(cfg.optimizer)  # name, schema, betas: runner/optim/config.py
    spec = _spec(cfg.optimizer)
    if spec.needs_cuda and not run.on_cuda:
        where = "train.device=cpu" if str(cfg.train.device) == "cpu" else "train.device=auto and no CUDA device is available"
        raise UserError(
            f"optimizer={spec.name} needs CUDA: its state lives in CUDA unified memory, paged to host RAM when the "
            f"device runs short, and on the CPU bitsandbytes falls back to the non-paged optimizer with only a warning. This run "
            f"trains on the CPU ({where}). Use optimizer=adamw8bit (the same update and state size, not paged)."
        )
