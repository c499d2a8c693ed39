"""Fused backward (``optimizer.fused_backward=true``): each parameter steps inside backward.

Why: in a normal step every trained parameter's gradient is alive at once between backward and
the optimizer step; for a full fine-tune that is as many bytes as the trained weights (SDXL's
U-Net in bf16: 4.8 GiB). Here each parameter is updated in its post-accumulate-grad hook, the
moment backward has finished its gradient, and the gradient is freed at once, so at most a few
gradients are ever alive (kohya's ``--fused_backward_pass``, OneTrainer's fused back pass, and
PyTorch's "optimizer in backward" recipe).

How: one optimizer, the one the run configured (``runner/optim/build.py``), stepped one parameter at a
time through its own one-parameter update: torch's AdamW through its functional ``adamw`` (with the
state its ``step`` sets up), bitsandbytes' 8-bit AdamW and Lion through ``update_one``
(runner/optim/eight_bit.py); any other optimizer through a normal ``step()`` with its parameter groups
narrowed to the one parameter (the other groups emptied), then restored. AdamW,
bitsandbytes' optimizers, Adafactor and CAME update each parameter independently of the others, so this gives
exactly the normal step's result (tests/runner/optim/test_fused.py checks the weights bit for bit). We
keep one optimizer rather than one per parameter (the PyTorch recipe) because then the LR
scheduler, ``state_dict`` and checkpoints are the normal optimizer's, unchanged: a checkpoint
resumes with fused backward on or off.

No host sync per parameter: clipping and the finite check are decided on the card. Clipping is torch's
``clip_grad_norm_`` (an on-card coefficient ``min(1, max_norm / (norm + 1e-6))`` multiplied into the
gradient); the gradient's finite flag (of its norm when clipping) is written into a flag vector on the card;
each update is made, then kept or undone on the card with ``torch.where`` against a copy of that
parameter's weights and state taken just before it (one parameter's copy at a time, freed at once). The
flags are read once, at the end of backward (:meth:`FusedBackward.settle`, when the loop asks
:meth:`FusedBackward.guard_norm`): one host sync per step instead of one per parameter.

Under several processes: ``dist=ddp`` builds no DDP buckets and averages each gradient in its hook
first (``reduce``); under ``dist=fsdp`` the parameters are FSDP2's sharded DTensors, whose
post-accumulate-grad hooks FSDP2 itself calls after each unit's reduce-scatter (autograd never
accumulates into them), so each rank steps its shard of the already averaged gradient. The clipping
norm and the finite flag are then agreed over the ranks on the card (:func:`whole_value`, :func:`finite_flag`),
and a loss non-finite on one rank keeps every rank out of that backward (``agree``), since the hooks
are collectives.

What it cannot do, and what happens instead:

* gradient accumulation (``train.grad_accum > 1``): the update would happen once per
  micro-batch. Refused at validation. For the same reason a step that runs out of memory is not
  split into smaller micro-batches (runner/guards/oom.py): the run stops.
* global-norm clipping: the global norm is known only after the last gradient, when every
  parameter has stepped. With ``train.max_grad_norm > 0`` each parameter's gradient is clipped by
  its *own* norm instead (what kohya's fused pass does); that changes the result whenever
  clipping is active, which the README says, and ``mode=fit`` treats fused backward with
  clipping as a math-changing setting.
* fp16 loss scaling: the GradScaler unscales in ``step()``, after the hooks used scaled
  gradients. Refused (bf16 needs no scaler).
* an optimizer whose update couples the parameters (``optimizer=prodigy``: one step size estimated
  over all of them; ``optimizer=adamw_schedulefree``: one step count and average weight for all of
  them): stepping one parameter at a time would make each a step of its own. Refused at validation.
* ``offload=optimizer`` (the state and the step on the host) and ``offload=stream`` of a full
  fine-tune (streamed blocks' gradients go to the host and step there after backward): refused,
  they are the alternatives to this for the same memory. ``offload=stream`` with LoRA works: the
  adapters stay resident.

Non-finite values (runner/guards/nonfinite.py): the guard can no longer skip an update that already
happened during backward, so the checks move earlier. A non-finite *loss* is seen before
backward, and backward is not run (nothing is updated: the same as the normal skip). A
non-finite *gradient* is flagged in its hook: that parameter's update is undone on the card (weights and
state as before; the optimizer's host-side step counter is put back when the flags are read), the others
are kept; the guard counts the step as non-finite (patience and ``stop`` apply), and the log names the
parameters. If the run then stops, or runs out of memory in backward, some parameters already hold
this step's update: the weights are neither the last step's nor this one's, so nothing is saved at that
moment (the message names the newest checkpoint to resume from).
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.adamw import adamw

from runner.compat import DTensor, adam_init_group, dtensor_local, is_fake, run_step_post_hooks
from runner.errors import UserError
from runner.optim.build import OPTIMIZERS, ForwardsToInner
from runner.optim.eight_bit import NoPerParameterSync

log = logging.getLogger("runner")


class FusedBackward(ForwardsToInner):
    """Wraps ``optimizer``: each parameter steps in its post-accumulate-grad hook, then its grad is freed.

    Not built through ``Optimizer.__init__``: ``param_groups``, ``state`` and ``defaults`` are the
    inner optimizer's (properties below), so the LR scheduler's changes reach it and its
    ``state_dict`` is the inner one's. ``step()`` steps whatever parameters still hold a gradient
    (none, after a normal backward); ``zero_grad`` ends the step's bookkeeping.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float = 0.0,
                 names: dict[int, str] | None = None, reduce: Callable[[torch.Tensor], None] | None = None,
                 agree: Callable[[bool], bool] | None = None) -> None:
        couples = getattr(optimizer, "couples_parameters", None)
        if couples:  # validation refuses this before anything is built (check_fused_backward)
            raise ValueError(f"fused backward steps one parameter at a time, and {couples}")
        self.inner = optimizer
        self.max_grad_norm = float(max_grad_norm)
        self.names = dict(names or {})
        self.reduce = reduce  # dist=ddp: averages a gradient over the ranks before it is used (runner/distributed/runtime.py)
        # dist: every rank admits a step's backward or none does (its hooks are collectives: DDP's all-reduce,
        # FSDP's reduce-scatter); one process: the identity
        self.agree = agree or (lambda ok: ok)
        self._group_of: dict[int, tuple[int, int]] = {}  # id(p) -> (group index, position in the group)
        self._hooks: list[Any] = []
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self.stepped = 0  # parameters updated in this step's backward
        self._skipped: list[str] = []  # parameters whose gradient was not finite (not updated)
        self._pending: list[_Before] = []  # this backward's updates whose finite flag is not read yet
        self._flags: torch.Tensor | None = None  # their flags, on the card (one element per parameter)
        self._direct = False  # a parameter stepped through the optimizer's one-parameter update (not its step())
        self.loss_admitted = True
        self.loss_value: float | None = None  # the micro-batch's loss, read before its backward (admits)
        # where the one-parameter copies are made; the planner's dist=fsdp plan leaves their bytes out (a rank
        # copies its shard, the plan's fake parameter is whole), their ops stay counted
        self.copy_scope: Callable[[], Any] = contextlib.nullcontext
        self._warned_late = False
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                self._group_of[id(p)] = (gi, pi)
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))
        self._simulated = any(is_fake(p) for g in optimizer.param_groups for p in g["params"])

    # -- the step, one parameter at a time ------------------------------------------------------
    def _step_one(self, p: nn.Parameter) -> None:
        """``p``'s update through the optimizer's own update for one parameter where it has one (torch's
        AdamW: its functional ``adamw``; bitsandbytes: ``update_one``), else a whole ``step()`` with the
        parameter groups narrowed to ``p``."""
        gi, pi = self._group_of[id(p)]
        inner = self.inner
        group = inner.param_groups[gi]
        if isinstance(inner, NoPerParameterSync):
            inner.update_one(group, p, gi, pi)
            self._direct = True
        elif type(inner) is torch.optim.AdamW:
            _adamw_one(inner, group, p)
            self._direct = True
        else:
            self._step_narrowed(p, gi)

    def _step_narrowed(self, p: nn.Parameter, mine: int) -> None:
        groups = self.inner.param_groups
        saved = [g["params"] for g in groups]
        try:
            for gi, g in enumerate(groups):
                g["params"] = [p] if gi == mine else []
            self.inner.step()
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            return
        if not self.loss_admitted:  # (backward is normally not run at all then: see admits())
            p.grad = None
            return
        if self.reduce is not None:  # every rank then clips, checks and steps the same averaged gradient
            self.reduce(grad)
        # The planner runs this too, on fake values: its ops and copies are what it prices (only settle's read is skipped)
        if self.max_grad_norm > 0:  # per-parameter clipping by its own norm, on the card (module docstring)
            norm = torch.nn.utils.clip_grad_norm_([p], self.max_grad_norm)
            ok = torch.isfinite(whole_value(norm))
        else:
            ok = finite_flag(grad)
        self._masked_step(p, ok)  # type: ignore[arg-type]
        self.stepped += 1
        p.grad = None

    def _masked_step(self, p: nn.Parameter, ok: torch.Tensor) -> None:
        """``p``'s update, kept where ``ok`` (a flag on the card) and undone on the card where not, so no
        host read decides it; the flag is read once for the whole backward (:meth:`settle`)."""
        if self._flags is not None and len(self._pending) >= self._flags.numel():
            self.settle()  # more updates than parameters without a zero_grad (steps outside the loop)
        state = self.inner.state.get(p) or {}
        with self.copy_scope():
            before = _Before(p, state)
        self._step_one(p)
        before.keep_where(ok, self.inner.state.get(p) or {})
        self._pending.append(before)
        if self._flags is None or self._flags.device != ok.device:
            self._flags = torch.ones(len(self._group_of), dtype=torch.bool, device=ok.device)
        self._flags[len(self._pending) - 1] = ok

    def settle(self) -> None:
        """End of backward: read the parameters' finite flags once (one host sync), and for those whose
        gradient was not finite (their weights and card state already restored) restore the optimizer's
        host-side state (step counters) and name them."""
        pending, self._pending = self._pending, []
        if not pending or self._simulated:  # the planner: fake flags have no values (the read is priced as one sync)
            return
        flags = self._flags[: len(pending)].tolist()  # the step's one read of the card
        for before, ok in zip(pending, flags):
            if not ok:
                before.restore_host_state(self.inner.state)
                self.stepped -= 1
                self._skipped.append(self.names.get(id(before.param), f"parameter {tuple(before.param.shape)}"))

    @property
    def skipped(self) -> list[str]:
        """The parameters whose gradient was not finite in this step (not updated)."""
        self.settle()
        return self._skipped

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """Step the parameters that still hold a gradient (set outside autograd); normally none."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        late = [p for g in self.inner.param_groups for p in g["params"] if p.grad is not None]
        for p in late:
            self._hook(p)
        if late and not self._warned_late:
            # Not silent: these parameters kept their gradients through backward (a hook that never ran, e.g. a
            # wrapper that replaced the parameters after the optimizer was built), so the memory was not freed.
            self._warned_late = True
            log.warning("fused backward: %d parameters still held a gradient after backward and stepped only then "
                        "(their post-accumulate-grad hooks did not run), e.g. %s", len(late),
                        self.names.get(id(late[0]), f"parameter {tuple(late[0].shape)}"))
        if self._direct:  # the inner optimizer's step() never ran: its post-step hooks (the state-bytes note) run now
            self._direct = False
            run_step_post_hooks(self.inner)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.settle()  # a step nobody asked about (a test stepping directly): its non-finite updates stay undone
        self.inner.zero_grad(set_to_none=set_to_none)
        self.stepped = 0
        self._skipped = []
        self.loss_admitted = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("optimizer.fused_backward: add parameter groups before the optimizer is wrapped")

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def __repr__(self) -> str:
        return f"FusedBackward({type(self.inner).__name__}, {len(self._group_of)} parameters)"

    # -- what the loop asks (the same interface as NotFused) ------------------------------------
    def admits(self, loss: torch.Tensor) -> bool:
        """Run backward for ``loss``? Not when it is non-finite: backward would update parameters. The
        loss is read on the host here, before backward (:attr:`loss_value`: the loop's one read of it)."""
        self.loss_value = None if self._simulated else float(loss.detach())
        self.loss_admitted = self._simulated or self.agree(math.isfinite(self.loss_value))
        if not self.loss_admitted:
            log.warning("fused backward: the loss is %s; backward is not run, so no parameter is updated",
                        self.loss_value)
        return self.loss_admitted

    def guard_norm(self, norm: Any) -> Any:
        """What the NaN guard should see as the gradient norm: inf when a parameter was skipped."""
        if self.skipped:
            shown = ", ".join(self.skipped[:3]) + (f" and {len(self.skipped) - 3} more" if len(self.skipped) > 3 else "")
            log.warning("fused backward: %d parameters had non-finite gradients and were not updated (%s); "
                        "%d others were updated during backward", len(self.skipped), shown, self.stepped)
            return math.inf
        return norm

    @property
    def intact(self) -> bool:
        """No parameter holds an update of the step in progress (the weights are the last step's)."""
        return self.stepped == 0

    def unsaved_reason(self, latest: Path | None) -> str | None:
        """Why the weights cannot be saved now (None: they can)."""
        if self.intact:
            return None
        newest = (f" The newest checkpoint is {latest} (train.resume={latest})." if latest is not None
                  else " No checkpoint was saved in this run.")
        return (f"Fused backward had already updated {self.stepped} parameters of this step, so the weights are "
                f"neither the last step's nor this one's and were not saved.{newest}")

    unsplittable_because = ("optimizer.fused_backward=true updates each parameter during backward, so a step cannot "
                            "be split into smaller micro-batches")


class NotFused:
    """The loop's view of a run without fused backward: every question has the normal answer."""

    intact = True
    unsplittable_because: str | None = None
    loss_value: float | None = None  # the loop reads the loss itself, after backward

    def admits(self, loss: torch.Tensor) -> bool:
        return True

    def guard_norm(self, norm: Any) -> Any:
        return norm

    def unsaved_reason(self, latest: Path | None) -> str | None:
        return None


NOT_FUSED = NotFused()


def whole_value(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one plain tensor: a DTensor (``dist=fsdp``: a sharded parameter's gradient norm, which
    clip_grad_norm_ returns still to be reduced over the ranks) gathered, anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def finite_flag(grad: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``grad`` is finite, as a 0-dim bool on the card (no host read). Under
    ``dist=fsdp`` ``grad`` is this rank's shard of a DTensor (FSDP2 calls the hook after its
    reduce-scatter): the flag is agreed over the shard group with one all-reduce, on the card, so every
    rank keeps (or undoes) the parameter's update alike."""
    if not isinstance(grad, DTensor):
        return torch.isfinite(grad).all()
    import torch.distributed as dist

    flag = torch.isfinite(dtensor_local(grad)).all().to(torch.float32).reshape(1)
    for group in grad.device_mesh.get_all_groups():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return flag[0] > 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return dtensor_local(t) if isinstance(t, DTensor) else t


_CONSTANT_STATE = frozenset({"qmap1", "qmap2"})  # bitsandbytes' quantile maps: one per optimizer, never written


class _Before:
    """A parameter's weights and optimizer state before its update in fused backward: copies on the card
    (freed as soon as :meth:`keep_where` has used them), and the state the optimizer keeps on the host
    (step counters), restored only if the flag read at the end of backward says the update was undone."""

    def __init__(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        self.param = p
        self.had_state = bool(state)
        device = _local(p).device
        self.weights: torch.Tensor | None = _local(p).detach().clone()
        self.card: dict[str, torch.Tensor] = {}
        self.host: dict[str, Any] = {}
        for k, v in state.items():
            if not isinstance(v, torch.Tensor):
                self.host[k] = v
            elif k not in _CONSTANT_STATE:
                v = _local(v)
                (self.card if v.device == device else self.host)[k] = v.detach().clone()

    def keep_where(self, ok: torch.Tensor, state: dict[str, Any]) -> None:
        """Where ``ok`` is false, put the weights and the card state back (``torch.where`` on the card)."""
        w = _local(self.param).detach()
        torch.where(ok, w, self.weights, out=w)
        for k, old in self.card.items():
            new = state.get(k)
            if isinstance(new, torch.Tensor) and _local(new).shape == old.shape:
                n = _local(new).detach()
                torch.where(ok, n, old, out=n)
        self.weights, self.card = None, {}

    def restore_host_state(self, states: Any) -> None:
        """The update was undone on the card: the host-side state goes back too (a first step's state goes)."""
        if not self.had_state:
            states.pop(self.param, None)
            return
        st = states[self.param]
        for k, v in self.host.items():
            st[k] = v


def _adamw_one(optimizer: torch.optim.AdamW, group: dict[str, Any], p: torch.Tensor) -> None:
    """torch AdamW's update of ``p`` alone: its state set-up and its functional ``adamw``, as ``step`` calls them."""
    lists: tuple[list, ...] = ([], [], [], [], [], [])
    has_complex = adam_init_group(optimizer, {**group, "params": [p]}, *lists)
    beta1, beta2 = group["betas"]
    adamw(*lists, foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
          fused=group["fused"], grad_scale=None, found_inf=None, has_complex=has_complex, amsgrad=group["amsgrad"],
          beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
          maximize=group["maximize"])


def fusion_of(optimizer: Any) -> FusedBackward | NotFused:
    """The run's fused-backward wrapper, or the no-op view when the optimizer is not one."""
    return optimizer if isinstance(optimizer, FusedBackward) else NOT_FUSED


def fuse_into_backward(optimizer: torch.optim.Optimizer, cfg: Any, run: Any,
                       named: Iterable[tuple[str, nn.Parameter]] = (),
                       reduce: Callable[[torch.Tensor], None] | None = None,
                       agree: Callable[[bool], bool] | None = None) -> torch.optim.Optimizer:
    """``optimizer`` wrapped for fused backward when ``cfg.fused_backward`` (the optimizer node), else itself.

    ``run``: the resolved run (``max_grad_norm``); ``named``: (name, parameter) pairs for messages;
    ``reduce``: the distribution's gradient average (dist=ddp), applied in each hook first; ``agree``:
    the ranks' agreement on a flag (runner/distributed/runtime.py ``all_agree``), so that a loss non-finite on
    one rank keeps every rank out of that backward (its hooks are collectives).
    """
    if not bool(cfg.get("fused_backward", False)):
        return optimizer
    if run.max_grad_norm > 0 and not run.simulate:
        log.info("fused backward: train.max_grad_norm=%g clips each parameter's gradient by its own norm "
                 "(a global norm needs every gradient at once)", run.max_grad_norm)
    return FusedBackward(optimizer, max_grad_norm=run.max_grad_norm, names={id(p): n for n, p in named},
                         reduce=reduce, agree=agree)


def check_fused_backward(cfg: Any, run: Any, selected: Iterable[tuple[str, str]]) -> None:
    """Refuse what fused backward cannot do (module docstring), naming the key and the way out."""
    if not bool(cfg.optimizer.get("fused_backward", False)):
        return
    key = "optimizer.fused_backward=true"
    spec = OPTIMIZERS.get(str(cfg.optimizer.get("name", "")))
    if spec is not None and spec.couples_parameters is not None:
        raise UserError(
            f"{key} with optimizer={spec.name}: fused backward steps one parameter at a time, as backward finishes its "
            f"gradient, and {spec.couples_parameters}, so every parameter would count as a step of its own. Use "
            f"optimizer.fused_backward=false with optimizer={spec.name}, or an optimizer that updates each parameter on "
            "its own (adamw, adamw8bit, adafactor, lion, lion8bit, came).")
    if run.grad_accum > 1:
        raise UserError(
            f"{key} updates each parameter as soon as backward has computed its gradient, so gradients cannot be "
            f"summed over micro-batches: train.grad_accum={run.grad_accum} cannot be combined with it. Use "
            "train.grad_accum=1 (with a train.batch_size that fits), or optimizer.fused_backward=false.")
    if run.precision == "fp16":
        raise UserError(
            f"{key} with train.mixed_precision=fp16: the fp16 gradient scaler unscales gradients in the optimizer "
            "step, after fused backward has already used them scaled. Use train.mixed_precision=bf16 (no scaler).")
    chosen = set(selected)
    if ("offload", "optimizer") in chosen:
        raise UserError(
            f"{key} and offload=optimizer both decide where and when the optimizer steps (offload=optimizer steps "
            "on the host after backward). Choose one: fused backward frees the gradients, offload=optimizer moves "
            "the optimizer state (and, with offload.optimizer.offload_gradients, the gradients) to the host.")
    if ("offload", "stream") in chosen and run.train_mode == "full":
        raise UserError(
            f"{key} with offload=stream and model.train=full: the streamed blocks' gradients are gathered on the "
            "host and those blocks step on the CPU after backward, which fused backward cannot do. Use one of them "
            "(offload=stream already keeps the streamed blocks' gradients off the device), or model.train=lora.")
