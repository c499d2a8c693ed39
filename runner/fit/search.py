"""The search of ``mode=fit`` and ``train.auto_fit``: the fastest settings that fit the budget.

1. Plan the user's configuration (the base) and the same with the opposite checkpointing
   extreme (the anchors: full plans, a few seconds each at full size).
2. Measure the models as the run prepares them, on ``meta`` (runner/fit/estimate.py: Inventory).
3. Enumerate every candidate the space allows (runner/fit/space.py) and estimate its peak and
   step time from the anchors' per-category breakdowns and per-phase costs: microseconds each,
   so every combination is looked at.
4. Take the candidates estimated to fit, fastest first, and confirm them with full plans
   (``fit.confirm`` at most; an anchor that is a candidate is confirmed already) until one
   confirms a fit and no unconfirmed candidate is estimated faster than it.
5. No confirmed fit: the closest configuration (the smallest estimated peak, confirmed by a plan)
   is named with its bytes over the budget.

The result carries every candidate looked at, so the output can say why the others lost.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from runner.parts import build_trainer, prepare_models
from runner.compose import compose_config
from runner.checks import validate
from runner.errors import UserError
from runner.fit.estimate import Anchor, Estimate, Estimator, Inventory, dtype_bytes
from runner.fit.space import Knobs, Space, base_knobs, offload_knobs, overrides_for
from runner.plan.result import Plan
from runner.plan.simulate import plan_step, step_time_target
from runner.plan.target import DEVICE, GiB
from runner.resolved import planned_target, resolve

log = logging.getLogger("runner")

WORTH_CONFIRMING = 0.05  # another plan only for a candidate estimated at least 5 % faster than the confirmed fit

# Overrides of the user's command line that are not part of the configuration being fitted.
NOT_FITTED = ("mode", "output_dir", "fit", "train.auto_fit", "train.resume", "hydra.run", "hydra.sweep")


@dataclass
class Candidate:
    knobs: Knobs
    overrides: list[str]
    estimate: Estimate
    plan: Plan | None = None  # a full plan confirmed it
    error: str | None = None  # composing or planning it failed (a combination the runner refuses)

    @property
    def required_bytes(self) -> int:
        return self.plan.required_bytes if self.plan is not None else self.estimate.required_bytes

    @property
    def seconds(self) -> float:
        if self.plan is not None and self.plan.seconds_per_step is not None:
            return self.plan.seconds_per_step
        return self.estimate.seconds

    @property
    def confirmed(self) -> bool:
        return self.plan is not None

    @property
    def host_bytes(self) -> int:
        """Host RAM during training (offloaded weights, state, activations), at its highest in the step."""
        return self.plan.host_training_bytes if self.plan is not None else int(self.estimate.parts.get("host", 0))

    def fits(self, limit: int, host_limit: int) -> bool:
        # A confirmed plan also needs the caching allocator, capped at the budget, to serve every
        # request (runner/plan/allocator.py): the preflight of the chosen settings checks the same.
        refused = self.plan is not None and bool((self.plan.reserved or {}).get("ooms"))
        return self.error is None and not refused and self.required_bytes <= limit and self.host_bytes <= host_limit


@dataclass
class FitResult:
    batch: int  # train.batch_size (the effective batch every candidate keeps)
    budget_bytes: int
    headroom_bytes: int
    host_limit: int  # host RAM the run may use while training (fit.host_ram_gb)
    device: str
    base: Candidate
    winner: Candidate | None
    candidates: list[Candidate]  # every candidate, fastest estimate first
    closest: Candidate | None  # when nothing fits
    user_overrides: list[str]
    allow: list[str]
    plans: int = 0
    seconds: float = 0.0
    not_allowed: list[tuple[str, Candidate]] = field(default_factory=list)  # faster or fitting with fit.allow=[...]

    @property
    def limit(self) -> int:
        return self.budget_bytes - self.headroom_bytes


def fitted_overrides(overrides: Sequence[str]) -> list[str]:
    """The user's overrides that describe the configuration (not the mode, outputs or the search)."""
    return [o for o in overrides if not any(o.lstrip("+~").split("=", 1)[0] == k
                                             or o.lstrip("+~").startswith(k + ".") for k in NOT_FITTED)]


class _Planner:
    """Composes and plans candidates, counting the plans."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.plans = 0

    def compose(self, overrides: Sequence[str]) -> Any:
        cfg = compose_config([*overrides, "mode=plan"])
        validate(cfg)
        return cfg

    def plan(self, overrides: Sequence[str]) -> Plan:
        cfg = self.compose(overrides)
        self.plans += 1
        t0 = time.perf_counter()
        plan = plan_step(cfg, target=self.target)
        log.info("fit: planned %s in %.1f s: peak %.2f GiB, %.3g s/step", " ".join(overrides[-4:]) or "the base",
                 time.perf_counter() - t0, plan.required_bytes / GiB, plan.seconds_per_step or float("nan"))
        return plan


def _inventory(cfg: Any, target: str) -> Inventory:
    run = resolve(cfg, target=target, device=DEVICE).simulated()
    trainer = build_trainer(cfg, run)
    models = prepare_models(trainer.build_models(DEVICE), cfg.model, run)
    return Inventory.of(models, cfg)


def _cacheable(cfg: Any, target: str) -> bool:
    """Whether the plugin that declares fit's ``park`` knob applies to this run's trainer."""
    from runner import registry

    name = offload_knobs().get("park")
    if name is None:
        return False
    trainer = build_trainer(cfg, resolve(cfg, target=target, device=DEVICE).simulated())
    return registry.get_plugin("offload", name).fit_applies(trainer)


def search(cfg: Any, overrides: Sequence[str]) -> FitResult:
    """Run the search for the composed config ``cfg`` (made from ``overrides``); see the module docstring."""
    started = time.perf_counter()
    c = cfg.fit
    target = planned_target(cfg)
    run = resolve(cfg, target=target, device=DEVICE).simulated()
    if run.budget_bytes is None:
        raise UserError("mode=fit (and train.auto_fit) needs a memory budget: budget_gb=<GiB>, or device.name=<GPU> "
                        "for its usable memory (python -m runner mode=plugins lists the devices in conf/devices.yaml).")
    if float(c.headroom_gb) * GiB >= run.budget_bytes:
        raise UserError(f"fit.headroom_gb={c.headroom_gb} keeps the whole budget free (budget_gb="
                        f"{run.budget_bytes / GiB:.4g}): nothing could fit. Give fit.headroom_gb below the budget, "
                        f"e.g. fit.headroom_gb={min(1.0, run.budget_bytes / GiB / 10):.2g}.")
    user = fitted_overrides(overrides)
    planner = _Planner(target)
    base_plan = planner.plan(user)
    base_cfg = planner.compose(user)
    base = base_knobs(base_cfg)
    anchors = {base.checkpoint: Anchor(base, base_plan)}
    planned: dict[Knobs, Plan] = {base: base_plan}
    headroom = int(float(c.headroom_gb) * GiB)
    limit = run.budget_bytes - headroom
    host_limit = int(float(c.host_ram_gb) * GiB) if c.host_ram_gb is not None else _host_ram()
    for mode in _anchor_modes(base, base_plan.required_bytes <= limit):
        knobs = replace(base, checkpoint=mode, every_n=2)
        plan = planner.plan(overrides_for(knobs, base, base_cfg, user))
        anchors[mode] = Anchor(knobs, plan)
        planned[knobs] = plan
    inventory = _inventory(base_cfg, target)
    timing = step_time_target(run)
    prefetch = int(base_cfg.offload[offload_knobs()["stream_gb"]].prefetch) if base.stream_gb is not None else 1
    estimator = Estimator(anchors, inventory, timing, base, batch=run.batch_size, on_cuda=run.on_cuda,
                          train_dtype_bytes=dtype_bytes(run.train_dtype), frozen_dtype_bytes=dtype_bytes(run.frozen_dtype),
                          prefetch=prefetch)
    allow = frozenset(str(a) for a in c.allow)
    space = Space(base=base, batch=run.batch_size, allow=allow, on_cuda=run.on_cuda, max_grad_norm=run.max_grad_norm,
                  precision=run.precision, trained_gib=inventory.trained_bytes / GiB,
                  streamable=_streamable(base, inventory), cacheable=_cacheable(base_cfg, target),
                  ranks=run.dist.world_size, dist=run.dist.name)
    candidates = []
    for knobs in space.candidates():
        if not estimator.can_estimate(knobs):
            continue  # no planned anchor for its checkpointing (not useful for this budget), or a stream too small
        cand = Candidate(knobs, overrides_for(knobs, base, base_cfg, user), estimator.estimate(knobs))
        cand.plan = planned.get(knobs)
        candidates.append(cand)
    # Fastest first; among equals the fewest changes, then the least memory.
    candidates.sort(key=lambda x: (round(x.seconds, 4), len(x.knobs.changes(base)), x.required_bytes))
    confirmed_budget = int(c.confirm)
    winner: Candidate | None = None
    for cand in candidates:
        if winner is not None and cand.seconds >= winner.seconds * (1 - WORTH_CONFIRMING):
            break  # nothing left is estimated clearly faster than a confirmed fit
        if not cand.fits(limit, host_limit):
            continue
        if not cand.confirmed:
            if confirmed_budget <= 0:
                break
            confirmed_budget -= 1
            try:
                cand.plan = planner.plan(cand.overrides)
            except UserError as e:  # a combination the runner refuses (its message says why)
                cand.error = str(e).splitlines()[0]
                continue
        if cand.fits(limit, host_limit) and (winner is None or cand.seconds < winner.seconds):
            winner = cand
    closest = None
    if winner is None:
        pool = [x for x in candidates if x.error is None]
        closest = min(pool, key=lambda x: x.required_bytes) if pool else None
        if closest is not None and not closest.confirmed:
            try:
                closest.plan = planner.plan(closest.overrides)
            except UserError as e:
                closest.error = str(e).splitlines()[0]
        if closest is not None and closest.fits(limit, host_limit):  # the estimate was pessimistic
            winner, closest = closest, None
    base_cand = next(x for x in candidates if x.knobs == base) if any(x.knobs == base for x in candidates) else \
        Candidate(base, list(user), estimator.estimate(base), plan=base_plan)
    result = FitResult(batch=run.batch_size, budget_bytes=run.budget_bytes, headroom_bytes=headroom, host_limit=host_limit, device=timing.label, base=base_cand,
                       winner=winner, candidates=candidates, closest=closest, user_overrides=list(user),
                       allow=sorted(allow), plans=planner.plans, seconds=time.perf_counter() - started)
    result.not_allowed = _what_allow_would_give(result, space, estimator, base_cfg)
    return result


def _host_ram() -> int:
    """This machine's RAM: where a plan is made is usually where the run trains."""
    import psutil

    return int(psutil.virtual_memory().total)


def _anchor_modes(base: Knobs, base_fits: bool) -> tuple[str, ...]:
    """The checkpointing extremes worth a full plan beside the base.

    Less checkpointing is faster but needs more memory: worth knowing only when the base fits.
    More checkpointing is slower: worth knowing only when the base does not fit.
    """
    if base.checkpoint == "full":
        return ("none",) if base_fits else ()
    if base.checkpoint == "none":
        return () if base_fits else ("full",)
    return ("none", "full")  # every_n: both extremes bracket it


def _streamable(base: Knobs, inv: Inventory) -> bool:
    return inv.blocks > 1 and base.quantization not in ("nf4", "int8")


def _what_allow_would_give(result: FitResult, space: Space, estimator: Estimator, base_cfg: Any) -> list[tuple[str, Candidate]]:
    """For each math-changing setting not allowed: the best candidate it would open, if better (estimated)."""
    from runner.config.fit import ALLOW

    out = []
    best = result.winner
    seen = {c.knobs for c in result.candidates}
    for name in ALLOW:
        if name in space.allow:
            continue
        wider = replace(space, allow=space.allow | {name})
        top = None
        for knobs in wider.candidates():
            if knobs in seen or not estimator.can_estimate(knobs):
                continue
            est = estimator.estimate(knobs)
            if est.required_bytes > result.limit or est.parts.get("host", 0) > result.host_limit:
                continue
            if top is None or est.seconds < top.estimate.seconds:
                top = Candidate(knobs, overrides_for(knobs, space.base, base_cfg, result.user_overrides), est)
        if top is not None and (best is None or top.estimate.seconds < best.seconds * 0.95):
            out.append((name, top))
    return out
