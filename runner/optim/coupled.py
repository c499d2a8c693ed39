"""Prodigy and schedule-free AdamW: the two optimizers whose update couples the parameters.

Prodigy estimates one step size ``d`` per step from sums over every parameter; schedule-free AdamW
advances one step count and one averaging weight per ``step()`` for all of them. Stepping either a
part at a time (fused backward, ``offload.optimizer.step_on_host=false``, torchao's one optimizer per
parameter) would make each part a step of its own: runner/optim/build.py refuses those combinations
with the reasons below. Both come from their packages through a thin subclass:

* Prodigy keeps ``p0`` at the parameter's size even when the parameter is all zeros at its first
  step (prodigyopt keeps a 0-dim zero then), so the planner knows the state without values;
* schedule-free's ``eval(keep_train_point=True)`` keeps a host copy of the training point that
  ``train()`` restores exactly (runner/optim/modes.py).

The classes are made on first use, so importing the runner does not import either package.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

PRODIGY_COUPLES = ("Prodigy estimates its step size d from sums over all parameters in each step, then updates every "
                   "parameter with it")
SCHEDULEFREE_COUPLES = ("schedule-free AdamW counts each step once for all parameters (its warmup and the weight of each "
                        "step in the average advance per step() call)")


def build_prodigy(cfg: Any, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return _prodigy_class()(
        params, lr=cfg.lr, betas=tuple(cfg.betas), beta3=cfg.beta3, eps=cfg.eps, weight_decay=cfg.weight_decay,
        decouple=bool(cfg.decouple), use_bias_correction=bool(cfg.use_bias_correction),
        safeguard_warmup=bool(cfg.safeguard_warmup), d0=cfg.d0, d_coef=cfg.d_coef, growth_rate=float(cfg.growth_rate),
        slice_p=int(cfg.slice_p),
    )


def build_schedulefree(cfg: Any, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # foreach=False, as for AdamW: the multi-tensor path divides every second moment into a new tensor at once.
    optimizer = _schedulefree_class()(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
        warmup_steps=int(cfg.warmup_steps), r=cfg.r, weight_lr_power=cfg.weight_lr_power, foreach=False,
    )
    optimizer.train()  # it starts in eval mode and refuses to step there
    return optimizer


def _prodigy_class() -> type:
    """prodigyopt's Prodigy with ``p0`` always a tensor of the sliced parameter's size (runner/optim/build.py's docstring)."""
    global _PRODIGY
    if _PRODIGY is None:
        from prodigyopt import Prodigy as Upstream

        class Prodigy(Upstream):
            couples_parameters = PRODIGY_COUPLES

            @torch.no_grad()
            def step(self, closure: Callable[[], Any] | None = None) -> Any:
                loss = None
                if closure is not None:
                    with torch.enable_grad():
                        loss = closure()
                for group in self.param_groups:
                    slice_p, beta1 = group["slice_p"], group["betas"][0]
                    for p in group["params"]:
                        state = self.state[p]
                        if p.grad is None or "step" in state:
                            continue
                        # prodigyopt's own initialisation, but p0 never a 0-dim zero: same update, fixed size
                        state["step"] = 0
                        state["s"] = torch.zeros_like(p.flatten()[::slice_p]).detach()
                        state["p0"] = p.flatten()[::slice_p].detach().clone()
                        if beta1 > 0:
                            state["exp_avg"] = torch.zeros_like(p).detach()
                        state["exp_avg_sq"] = torch.zeros_like(p).detach()
                super().step()
                return loss

        _PRODIGY = Prodigy
    return _PRODIGY


def _schedulefree_class() -> type:
    """schedulefree's AdamWScheduleFree, whose ``eval(keep_train_point=True)`` lets ``train()`` restore the
    training point exactly (runner/optim/modes.py) instead of recomputing it, which rounds."""
    global _SCHEDULEFREE
    if _SCHEDULEFREE is None:
        from schedulefree import AdamWScheduleFree as Upstream

        class AdamWScheduleFree(Upstream):
            couples_parameters = SCHEDULEFREE_COUPLES

            @torch.no_grad()
            def eval(self, keep_train_point: bool = False) -> None:
                training = any(g["train_mode"] for g in self.param_groups)
                if keep_train_point and training:  # a host copy of y (the weights trained at), restored by train()
                    self._train_point = [(p, p.detach().to("cpu", copy=True)) for g in self.param_groups
                                         for p in g["params"] if "z" in self.state[p]]
                super().eval()

            @torch.no_grad()
            def train(self) -> None:
                kept = self.__dict__.pop("_train_point", None)
                if kept is None or all(g["train_mode"] for g in self.param_groups):
                    super().train()
                    return
                for p, y in kept:
                    p.copy_(y)
                for g in self.param_groups:
                    g["train_mode"] = True

        _SCHEDULEFREE = AdamWScheduleFree
    return _SCHEDULEFREE


_PRODIGY: type | None = None
_SCHEDULEFREE: type | None = None
