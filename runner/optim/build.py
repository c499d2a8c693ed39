"""Optimizers: the ``optimizer`` config group, the factory, and what their state costs.

Optimizer state is the largest memory item of a full fine-tune after the weights: AdamW keeps
two moments per parameter, 8 B/param in float32 (SDXL's U-Net: 2.6 B params -> 21 GB). The
options, one dataclass schema each in Hydra's ConfigStore group ``optimizer``
(``optimizer=adamw8bit optimizer.lr=1e-5``; the schemas are in runner/optim/config.py, without torch):

========================  ==============================================  ===========================
option                    state per parameter tensor of n elements         notes
========================  ==============================================  ===========================
``adamw``                 2 x n in the parameter's dtype + a 4 B step      torch, ``fused=True`` on a
                          (float32 scalar on the host; on the card with    card, else ``foreach=False``
                          ``fused``)                                       (no multi-tensor temporaries)
``adamw8bit``             2 x n bytes (uint8) + 2 float32 absmax per        bitsandbytes, blockwise
                          256-block + two 1 KiB quantile maps per          8-bit states; tensors under
                          optimizer; 8 B/param under ``min_8bit_size``     ``min_8bit_size`` stay 32-bit
``paged_adamw8bit``       as ``adamw8bit``, in CUDA unified memory for      needs CUDA (validated)
                          tensors of >= 1e5 elements
``adafactor``             matrices: (rows + cols) x 4 B (factored second    transformers, no first moment
                          moment); vectors: 4n; + a 4 B RMS per tensor      by default
``prodigy``               4 x n in the parameter's dtype (two moments,     prodigyopt; ``lr`` multiplies
                          ``s`` and the initial weights ``p0``)            its own step size (1.0)
``adamw_schedulefree``    2 x n in the parameter's dtype (``z`` and the     schedulefree, ``foreach=False``;
                          second moment)                                   train/eval modes (modes.py)
``lion``                  4n (one float32 moment)                          bitsandbytes Lion32bit
``lion8bit``              n bytes + a float32 absmax per 256-block + one    bitsandbytes Lion8bit; 4n
                          1 KiB quantile map per optimizer                 under ``min_8bit_size``
``came``                  Adafactor's factored moment twice (squared        came-pytorch; upcasts bf16
                          gradient, instability) + a float32 first         gradients like Adafactor
                          moment (4n) + the RMS, a 0-dim tensor of the
                          parameter's dtype
========================  ==============================================  ===========================

Whether an optimizer updates each parameter from its own gradient and state alone (its spec's
``couples_parameters`` is None) decides what may step it piecewise: fused backward (one parameter at a
time), ``offload.optimizer.step_on_host=false`` (one chunk at a time) and torchao's offload (one
optimizer per parameter). Prodigy's step size ``d`` is estimated from sums over *all* parameters
and schedule-free AdamW counts and weights each step once for all of them, so those three are
refused for both, before anything is built (:func:`validate_optimizer`, runner/optim/fused.py).
``offload=optimizer`` with ``step_on_host=true`` (its default) steps the whole optimizer at once on
the host and takes all of them.

Prodigy (runner/optim/coupled.py) is used through a subclass that keeps the initial weights ``p0`` of every parameter as a
tensor of its size: prodigyopt keeps a 0-dim zero instead when a parameter is all zeros at its first
step (LoRA's B matrices, freshly initialised norm biases), which the planner, working on fake
tensors, cannot see. The arithmetic is the same (``0 - x`` either way; tests/runner/optim/test_optimizers.py
compares the weights with prodigyopt's bit for bit); the cost is those parameters' size once more.

Adafactor runs with ``relative_step=False`` and ``scale_parameter=False`` (kohya/OneTrainer's choice for
diffusion): ``optimizer.lr`` is the step size and ``train.lr_scheduler`` schedules it (a relative step
needs ``lr=None``, which torch's schedulers cannot scale). ``beta1=None`` (no first moment) keeps it small.

Paged optimizers keep their large state tensors in CUDA unified memory, which the driver pages
to host RAM when the device runs short (cheap when everything fits). On the CPU bitsandbytes
falls back to the non-paged optimizer with a warning; validation refuses that combination
instead, so that a preset asking for paging never silently runs without it.

The planner cannot run the bitsandbytes kernels on fake tensors (nor Prodigy's sums, read with
``.item()``), and needs the state's bytes without the arithmetic: :func:`build_optimizer` with
``simulate=True`` returns a :class:`SimulatedOptimizer` that allocates exactly the tensors the real
optimizer would (from :func:`state_layout`, the layouts of runner/optim/layouts.py, checked against the real optimizers byte for byte in
tests/runner/optim/test_optimizers.py) and updates nothing. :func:`simulate_state_bytes` gives the same
figure without allocating.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from runner.side_streams import cuda_like
from runner.compat import DTensor, dtensor_local
from runner.errors import UserError, valid_list
from runner.optim.config import (  # noqa: F401  (the schemas: re-exported)
    AdafactorConfig,
    AdamW8bitConfig,
    AdamWConfig,
    AdamWScheduleFreeConfig,
    CAMEConfig,
    Lion8bitConfig,
    LionConfig,
    PagedAdamW8bitConfig,
    ProdigyConfig,
    check_optimizer_config,
    store_optimizer_schemas,
)
from runner.optim.coupled import PRODIGY_COUPLES, SCHEDULEFREE_COUPLES, build_prodigy, build_schedulefree
from runner.optim.eight_bit import without_per_parameter_sync
from runner.optim.layouts import (  # noqa: F401  (StateTensor and the bitsandbytes sizes: re-exported)
    BNB_BLOCKSIZE,
    PAGED_MIN_NUMEL,
    StateTensor,
    _adafactor_layout,
    _adamw8bit_layout,
    _adamw_layout,
    _came_layout,
    _lion_layout,
    _prodigy_layout,
    _schedulefree_layout,
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

    # Train and eval modes (optimizer=adamw_schedulefree; runner/optim/modes.py asks only optimizers that have them).
    def eval(self, keep_train_point: bool = False) -> None:
        if keep_train_point:
            self.inner.eval(keep_train_point=True)
        else:
            self.inner.eval()
        self.weights_changed()

    def train(self) -> None:
        self.inner.train()
        self.weights_changed()

    def weights_changed(self) -> None:
        """The inner optimizer changed its parameters outside a step: a wrapper stepping copies updates them."""

    def weights_loaded(self) -> None:
        """The trained parameters were given new values (a resume): a wrapper stepping copies takes them."""

# ---- builders -----------------------------------------------------------------------------------
def _build_adamw(cfg: Any, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # a card: torch's fused multi-tensor kernel, in place; the host: foreach=False (foreach's temporaries span all params)
    on_card = bool(params) and all(cuda_like(p.device) and p.is_floating_point() for p in params)
    kind: dict[str, bool] = {"fused": True} if on_card else {"foreach": False}
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                             **kind)


def _build_adamw8bit(cfg: Any, params: list[torch.nn.Parameter], paged: bool = False) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    # not paged: bitsandbytes' update without its host sync after every parameter (runner/optim/eight_bit.py)
    cls = bnb.optim.PagedAdamW8bit if paged else without_per_parameter_sync(bnb.optim.AdamW8bit)
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


def _build_lion(cfg: Any, params: list[torch.nn.Parameter], eight_bit: bool = False) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    if eight_bit:  # bitsandbytes' update without its host sync after every parameter (runner/optim/eight_bit.py)
        lion8 = without_per_parameter_sync(bnb.optim.Lion8bit)
        return lion8(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                     min_8bit_size=int(cfg.min_8bit_size))
    lion32 = without_per_parameter_sync(bnb.optim.Lion32bit)
    return lion32(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


def _build_came(cfg: Any, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    from came_pytorch.CAME import CAME

    return CAME(params, lr=cfg.lr, eps=tuple(cfg.eps), clip_threshold=cfg.clip_threshold, betas=tuple(cfg.betas),
                weight_decay=cfg.weight_decay)


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    config: type
    build: Callable[[Any, list[torch.nn.Parameter]], torch.optim.Optimizer]
    layout: Callable[[Any, torch.Tensor], list[StateTensor]]
    needs_cuda: bool = False
    package: str = ""  # the import name of the package it needs (a missing one is refused at validation)
    pip: str = ""  # its name on PyPI
    # None: each parameter's update reads only its own gradient and state, so the optimizer may step one
    # parameter or one chunk at a time. Otherwise why not (for the messages refusing fused backward, ...).
    couples_parameters: str | None = None
    modes: bool = False  # train()/eval() move the weights between the training and the evaluated point


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
        OptimizerSpec("adafactor", AdafactorConfig, _build_adafactor, _adafactor_layout, package="transformers",
                      pip="transformers"),
        OptimizerSpec("prodigy", ProdigyConfig, build_prodigy, _prodigy_layout, package="prodigyopt", pip="prodigyopt",
                      couples_parameters=PRODIGY_COUPLES),
        OptimizerSpec("adamw_schedulefree", AdamWScheduleFreeConfig, build_schedulefree, _schedulefree_layout,
                      package="schedulefree", pip="schedulefree", modes=True, couples_parameters=SCHEDULEFREE_COUPLES),
        OptimizerSpec("lion", LionConfig, _build_lion, _lion_layout),
        OptimizerSpec("lion8bit", Lion8bitConfig, lambda cfg, params: _build_lion(cfg, params, eight_bit=True),
                      lambda cfg, p: _lion_layout(cfg, p, eight_bit=True)),
        OptimizerSpec("came", CAMEConfig, _build_came, _came_layout, package="came_pytorch", pip="came-pytorch"),
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
        self.couples_parameters = _spec(cfg).couples_parameters  # as the real one's (torchao is not chosen for it)
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
PRODIGY_LOW_LR = 0.1  # below: almost always an AdamW learning rate carried over to Prodigy's multiplier


def validate_optimizer(cfg: Any, run: Any) -> None:
    """Name, schema and requirements of ``cfg.optimizer`` for the resolved ``run``, and what the
    chosen optimizer cannot be combined with; each failure names the key and the fix."""
    check_optimizer_config(cfg.optimizer)  # name, schema, betas: runner/optim/config.py
    spec = _spec(cfg.optimizer)
    if spec.package and importlib.util.find_spec(spec.package) is None:
        raise UserError(
            f"optimizer={spec.name} needs the Python package {spec.pip}, which is not installed in this environment "
            f"({sys.executable}). Install it with `pip install {spec.pip}` (the runner's own setup, `make setup`, "
            "installs it), or choose another optimizer.")
    if spec.needs_cuda and run.simulated_card:
        raise UserError(
            f"optimizer={spec.name} cannot run on train.device=cuda_sim: its state lives in CUDA unified memory, "
            "which bitsandbytes pages through the CUDA driver, and a simulated card has no driver. Use "
            "optimizer=adamw8bit on the simulated card (the same update and state size, not paged), or a real GPU.")
    if spec.needs_cuda and not run.on_cuda:
        where = "train.device=cpu" if str(cfg.train.device) == "cpu" else "train.device=auto and no CUDA device is available"
        raise UserError(
            f"optimizer={spec.name} needs CUDA: its state lives in CUDA unified memory, paged to host RAM when the "
            f"device runs short, and on the CPU bitsandbytes falls back to the non-paged optimizer with only a warning. This run "
            f"trains on the CPU ({where}). Use optimizer=adamw8bit (the same update and state size, not paged)."
        )
    if spec.couples_parameters is not None:
        _refuse_piecewise_steps(cfg, spec)
    if spec.modes and cfg.get("ema") is not None and bool(cfg.ema.get("enabled", False)):
        raise UserError(
            f"optimizer={spec.name} with ema.enabled=true: schedule-free's evaluated weights (the ones samples, "
            "checkpoints and the export use) are already an average of the iterates, and the EMA would average the "
            "other sequence, the points it takes gradients at, which are not what it evaluates. Use ema.enabled=false "
            "with it, or an optimizer with a schedule (optimizer=adamw) for an EMA.")
    if spec.name == "prodigy" and float(cfg.optimizer.lr) < PRODIGY_LOW_LR:
        log.warning(
            "optimizer=prodigy with optimizer.lr=%g: Prodigy's lr is not a learning rate but a multiplier of the step "
            "size d it estimates itself (the metrics' prodigy_d column); its authors use 1.0, the default. With %g "
            "every step is %g times smaller than Prodigy's estimate. If this is an AdamW learning rate carried over, "
            "drop optimizer.lr (to scale Prodigy's steps, tune optimizer.d_coef, e.g. 0.5-2).",
            float(cfg.optimizer.lr), float(cfg.optimizer.lr), 1 / float(cfg.optimizer.lr))


def _refuse_piecewise_steps(cfg: Any, spec: OptimizerSpec) -> None:
    """An optimizer whose update couples the parameters cannot be stepped a part at a time."""
    offload = cfg.get("offload") or {}
    node = offload.get("optimizer") if hasattr(offload, "get") else None
    if node is None:
        return
    if not bool(node.get("step_on_host", True)):
        raise UserError(
            f"optimizer={spec.name} with offload=optimizer and offload.optimizer.step_on_host=false: that mode steps "
            f"the optimizer one chunk of parameters (offload.optimizer.chunk_mb) at a time, and {spec.couples_parameters}, "
            "so each chunk would count as a step of its own. Use offload.optimizer.step_on_host=true (the default: "
            "the whole step runs on the host at once), or an optimizer that updates each parameter on its own "
            "(adamw, adamw8bit, adafactor, lion, lion8bit, came).")
    if str(node.get("implementation", "auto")) == "torchao":
        raise UserError(
            f"optimizer={spec.name} with offload.optimizer.implementation=torchao: torchao's CPUOffloadOptimizer "
            f"builds one optimizer per parameter, and {spec.couples_parameters}. Use "
            "offload.optimizer.implementation=builtin (or auto, which picks it for this optimizer).")
