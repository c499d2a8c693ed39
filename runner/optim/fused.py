"""Fused backward (``optimizer.fused_backward=true``): each parameter steps inside backward.

Why: in a normal step every trained parameter's gradient is alive at once between backward and
the optimizer step; for a full fine-tune that is as many bytes as the trained weights (SDXL's
U-Net in bf16: 4.8 GiB). Here each parameter is updated in its post-accumulate-grad hook, the
moment backward has finished its gradient, and the gradient is freed at once, so at most a few
gradients are ever alive (kohya's ``--fused_backward_pass``, OneTrainer's fused back pass, and
PyTorch's "optimizer in backward" recipe).

How: one optimizer, the one the run configured (``runner/optim/build.py``), stepped one parameter at a
time. In the hook its parameter groups are narrowed to the one parameter (the other groups
emptied) for a normal ``step()``, then restored. AdamW (``foreach=False``), bitsandbytes'
8-bit AdamW and Lion, Adafactor and CAME update each parameter independently of the others, so this gives
exactly the normal step's result (tests/runner/optim/test_fused.py checks the weights bit for bit). We
keep one optimizer rather than one per parameter (the PyTorch recipe) because then the LR
scheduler, ``state_dict`` and checkpoints are the normal optimizer's, unchanged: a checkpoint
resumes with fused backward on or off.

Under several processes: ``dist=ddp`` builds no DDP buckets and averages each gradient in its hook
first (``reduce``); under ``dist=fsdp`` the parameters are FSDP2's sharded DTensors, whose
post-accumulate-grad hooks FSDP2 itself calls after each unit's reduce-scatter (autograd never
accumulates into them), so each rank steps its shard of the already averaged gradient. The clipping
norm and the finite check are then agreed over the ranks (:func:`whole_value`, :func:`all_finite`),
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
non-finite *gradient* is seen in its hook: that parameter is not updated (its gradient dropped),
the others are; the guard counts the step as non-finite (patience and ``stop`` apply), and the
log names the parameters. The check costs one device synchronisation per parameter. If the run
then stops, or runs out of memory in backward, some parameters already hold this step's update:
the weights are neither the last step's nor this one's, so nothing is saved at that moment (the
message names the newest checkpoint to resume from).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from runner.compat import is_fake
from runner.errors import UserError
from runner.optim.build import OPTIMIZERS, ForwardsToInner

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
        self.reduce = reduce  # dist=ddp: averages a gradient over the ranks before it is used (runner/dist/runtime.py)
        # dist: every rank admits a step's backward or none does (its hooks are collectives: DDP's all-reduce,
        # FSDP's reduce-scatter); one process: the identity
        self.agree = agree or (lambda ok: ok)
        self._group_of: dict[int, int] = {}
        self._hooks: list[Any] = []
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self.stepped = 0  # parameters updated in this step's backward
        self.skipped: list[str] = []  # parameters whose gradient was not finite (not updated)
        self.loss_admitted = True
        self.loss_value: float | None = None  # the micro-batch's loss, read before its backward (admits)
        self._warned_late = False
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                self._group_of[id(p)] = gi
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))
        self._simulated = any(is_fake(p) for g in optimizer.param_groups for p in g["params"])

    # -- the step, one parameter at a time ------------------------------------------------------
    def _step_one(self, p: nn.Parameter) -> None:
        groups = self.inner.param_groups
        saved = [g["params"] for g in groups]
        mine = self._group_of[id(p)]
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
        if self.max_grad_norm > 0:  # per-parameter clipping: this parameter's own norm (module docstring)
            norm = torch.nn.utils.clip_grad_norm_([p], self.max_grad_norm)
            finite = self._simulated or math.isfinite(float(whole_value(norm)))
        else:
            finite = self._simulated or all_finite(grad)
        if finite:
            self._step_one(p)  # type: ignore[arg-type]
            self.stepped += 1
        else:
            self.skipped.append(self.names.get(id(p), f"parameter {tuple(p.shape)}"))
        p.grad = None

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
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        self.stepped = 0
        self.skipped = []
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


def all_finite(grad: torch.Tensor) -> bool:
    """Is every element of ``grad`` finite? Under ``dist=fsdp`` ``grad`` is this rank's shard of a
    DTensor (FSDP2 calls the hook after its reduce-scatter): the answer is agreed over the shard
    group with one all-reduce of a flag, not by gathering the gradient, so every rank decides the
    same for the parameter and they step (or skip) it together."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return bool(torch.isfinite(grad).all())
    import torch.distributed as dist

    flag = torch.isfinite(grad.to_local()).all().to(torch.float32).reshape(1)
    for group in grad.device_mesh.get_all_groups():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item() > 0)


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
    the ranks' agreement on a flag (runner/dist/runtime.py ``all_agree``), so that a loss non-finite on
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
