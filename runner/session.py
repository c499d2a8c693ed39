"""Open a run: the one setup of managed mode (``python -m runner``), hosted mode (runner.hosted) and the loop.

Both modes go through the same steps, in this order, on one :class:`~runner.context.RunContext`:

1. :func:`open_run`: the resolved run and the plugins the job's checks built (runner/checks.py:
   one job resolves once and builds each plugin once), the context, the plugins' ``configure_process``
   phase (before anything touches CUDA) and the accelerator;
2. the plan (:func:`plan_run`) and the runner's own changes to the trainer's models
   (:func:`take_models`: dtypes, LoRA). Managed mode plans before it builds the real models, so a run
   over budget builds nothing; hosted mode plans from the loop's prepared modules, which it has already;
3. ``ctx.apply_setup_phases()``: the plugins' model phases (runner/context.py);
4. :func:`attach_optimizer`: distribution wrappers, the optimizer (the configured one or the loop's),
   the plugins' ``wrap_optimizer`` phase, fused backward;
5. :func:`attach_ema`, after a resume has loaded the weights it continues from, and the train/eval modes.

The managed loop (runner/loop.py) adds only what a loop of its own needs (data order, scheduler,
checkpoints, metrics) between 4 and 5; a hosted loop keeps its own.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from runner.parts import build_plugins, make_context, prepare_models
from runner.checks import CheckedRun
from runner.context import RunContext
from runner.distributed.runtime import accelerator_options
from runner.ema.average import build_ema
from runner.errors import UserError
from runner.hostmem import cpu_threads, keep_freed_host_memory
from runner.optim.build import build_optimizer
from runner.optim.fused import fuse_into_backward
from runner.output.trackers import accelerator_kwargs
from runner.plan import preflight
from runner.plugin import Plugin, PluginSchedule
from runner.resolved import ResolvedRun, resolve
from runner.trainer import ModelSet

log = logging.getLogger("runner")

# What the loop may pass as its optimizer: None (the configured one), a factory ``lambda params: ...``
# or an instance (a hosted loop's own).
OptimizerArg = Any | Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None


def open_run(cfg: Any, out: Path, overrides: list[str] | None, checked: CheckedRun | None = None, *,
             hosted: bool = False) -> RunContext:
    """The context of one run, with its plugins built, ``configure_process`` run and the accelerator.

    ``checked``: what the job's checks built (:func:`runner.checks.validate`); None resolves
    and builds here (a caller that validated nothing else). ``hosted``: the loop is the user's, so
    the accelerator gets no ``log.tracker`` settings (managed mode starts the tracker; a hosted loop
    logs its own way) and the run line names no batch geometry (the loop's loader makes its batches)."""
    run = checked.run if checked is not None else resolve(cfg)  # resolve: device, precision, dtypes, budget, once
    log.info("%s", run.describe(own_batches=hosted))
    keep_freed_host_memory(run)  # CPU runs: no page-fault churn between steps
    cpu_threads(run, cfg.train.get("cpu_threads"))  # CPU runs: no OpenMP threads spinning on busy cores
    schedule = PluginSchedule.build(checked.plugins) if checked is not None else build_plugins(cfg, run)
    log.info("plugin order:\n%s", schedule.describe())
    ctx = make_context(cfg, run, schedule, out, overrides)
    if bool(cfg.train.get("preflight", True)):  # what the preflight plans: the run's plugins, for the simulated run
        ctx.plan_schedule = build_plugins(cfg, run.simulated(), check=False)
    ctx.card = simulated_card(cfg, run)  # train.device=cuda_sim: the card the run's steps are placed on
    ctx.run_phase("configure_process")  # before anything touches CUDA
    ctx.accelerator = make_accelerator(run, **({} if hosted else accelerator_kwargs(cfg.log, out)))
    ctx.card.adopt(ctx.accelerator)  # cuda_sim: CUDA's autocast, not the CPU's
    return ctx


def simulated_card(cfg: Any, run: ResolvedRun) -> Any:
    """``train.device=cuda_sim``: a simulated card capped where the plan's fit check caps the allocator
    (the budget less the kernel-workspace margin), with the run's allocator settings; else a no-op."""
    from runner.memory.cuda_sim import NoSimulation, SimulatedCuda
    from runner.plan.allocator import expandable_segments
    from runner.plan.target import CUDA_WORKSPACE_MARGIN_BYTES

    if not run.simulated_card:
        return NoSimulation()
    cap = None if run.budget_bytes is None else run.budget_bytes - CUDA_WORKSPACE_MARGIN_BYTES
    return SimulatedCuda(cap, expandable_segments(cfg), run.precision)


def make_accelerator(run: ResolvedRun, **tracking: Any) -> Accelerator:
    """A fresh Accelerator for this job, with the resolved precision (runner/resolved.py decides it)
    and the tracker's ``log_with``/``project_dir`` (runner/output/trackers.py:accelerator_kwargs).

    accelerate keeps a process-wide singleton state; Hydra's ``-m`` runs jobs one after another
    in the same process, and jobs may differ in mixed precision, so the state is reset first.
    """
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    precision = "no" if run.simulated_card else run.precision  # cuda_sim: CUDA's autocast, emulated (cuda_sim.py)
    return Accelerator(mixed_precision=precision, cpu=run.device.type == "cpu", **accelerator_options(run),
                       **tracking)


def plan_run(ctx: RunContext, planned: Any) -> None:
    """Preflight: the planner simulates one full step of ``planned`` (a trainer, or a hosted loop's
    protocol view) with this run's plugins; over ``budget_gb`` the run stops here (exit 3)."""
    preflight(ctx.cfg, ctx.run, planned, ctx.plan_schedule, ctx.output_dir)


def cache_fillers(ctx: RunContext) -> list[Any]:
    """The run's plugins that keep an encoder cache (they implement ``fill_cache``); ``mode=cache`` refuses a
    run without one before anything is built."""
    fillers = [p for p in ctx.schedule.plugins if type(p).fill_cache is not Plugin.fill_cache]
    if not fillers:
        raise UserError("mode=cache fills the encoder cache, but no plugin of this run keeps one: add offload=park "
                        "(offload=[park,...] beside others), or run mode=train.")
    return fillers


def fill_caches(ctx: RunContext, fillers: list[Any]) -> dict[str, int]:
    """``mode=cache``: each plugin's encoder cache filled for the run ``ctx`` configures (its keys: the
    training run's), after the claims and the model transforms; plugin key -> entries encoded."""
    ctx.apply_model_transforms()
    filled = {p.key: p.fill_cache(ctx) for p in fillers}
    return {k: n for k, n in filled.items() if n is not None}


def take_models(ctx: RunContext, models: ModelSet) -> None:
    """The run's models, with ``model.dtype``/``model.train_dtype`` and ``model.train=lora`` applied."""
    ctx.models = prepare_models(models, ctx.cfg.model, ctx.run)


def attach_optimizer(ctx: RunContext, optimizer: OptimizerArg = None, *, own_optimizer_refused: str | None = None) -> None:
    """``ctx.optimizer`` over the trained parameters as the plugins placed them, wrapped by the plugins.

    DDP/FSDP wrap the trained modules first (their parameters are the optimizer's). ``optimizer``:
    None builds the configured one (``optimizer=...``); a factory is called with the parameters; an
    instance is taken as it is, unless ``own_optimizer_refused`` says why it may not be (a configured
    optimizer would be silently ignored). Then the ``wrap_optimizer`` phase (8-bit, paged, host
    state), then fused backward when ``optimizer.fused_backward``."""
    ctx.dist.prepare_models(ctx)  # DDP or FSDP2 around the trained modules, before the optimizer takes their parameters
    params = list(ctx.models.trainable_parameters())
    if optimizer is None:
        optimizer = build_optimizer(ctx.cfg.optimizer, params, notes=ctx.notes)
    elif isinstance(optimizer, torch.optim.Optimizer):
        if own_optimizer_refused:
            raise UserError(own_optimizer_refused)
        _check_holds_trained(optimizer, params, ctx.cfg.model.get("train"))
    else:
        optimizer = optimizer(params)
    ctx.optimizer = optimizer
    ctx.run_phase("wrap_optimizer")
    ctx.optimizer = fuse_into_backward(ctx.optimizer, ctx.cfg.optimizer, ctx.run, ctx.models.named_trainable_parameters(),
                                       reduce=ctx.dist.gradient_reducer(), agree=ctx.dist.all_agree)


def attach_ema(ctx: RunContext, resumed_from: Path | None = None) -> None:
    """``ctx.ema`` (``ema.enabled``; a no-op object otherwise), continuing a resumed checkpoint's average;
    then every trained module in train mode and every frozen one in eval mode."""
    ctx.ema = build_ema(ctx, resumed_from)
    for name, m in ctx.models.items():
        m.train(name in ctx.models.trained)


def _check_holds_trained(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], train: Any) -> None:
    """Refuse an optimizer instance that does not hold every tensor the run trains.

    A loop builds its optimizer before ``prepare()``; with ``model.train=lora`` the adapters are
    attached in ``prepare()``, and a plugin may replace a trained tensor by its device copy. Such
    an optimizer steps the frozen base and never the trained tensors: the run would end "ok"
    having trained nothing."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [p for p in params if id(p) not in held]
    if not missing:
        return
    why = (f"model.train={train} attached peft adapters in prepare(), after the optimizer was built"
           if str(train) != "full" else "prepare() placed or replaced the trained tensors after it was built")
    raise UserError(
        f"The optimizer the loop passed to prepare() ({type(optimizer).__name__}) does not hold {len(missing)} of the "
        f"{len(params)} tensors this run trains ({why}): they would never be updated. Pass None to use the "
        "configured optimizer (optimizer=..., optimizer.lr=...), or a factory that prepare() calls with the trained "
        "tensors: run.prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-4), loader).")
