"""The managed training loop, on accelerate.

The runner, not the trainer, decides which samples make up each step. ``BatchOrder``
(runner/data/order.py) gives step k's dataset indices (a seeded order per epoch; one bucket per
batch with aspect-ratio buckets; sets drawn by weight) and every sample a seed from its global
position, so:

* resume is exact: step k always sees the same samples with the same noise;
* a step can be cut into any number of micro-batches (gradient accumulation, and the OOM
  recovery of runner/guards/oom.py, which retries a step with smaller micro-batches) without skipping,
  repeating or re-randomising a sample.

accelerate provides device handling, autocast for mixed precision, fp16 gradient scaling and
clipping; we keep the accumulation loop explicit because micro-batch sizes may change at run
time (and ``accelerator.accumulate`` assumes a fixed count).
"""
from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from diffusers.optimization import get_scheduler

from runner.context import RunContext
from runner.data import BatchOrder, collate, describe_dataset, visit_samples
from runner.data.order import SampleOrder  # noqa: F401  (the one-stream order, importable from here as before)
from runner.dist.runtime import accelerator_options
from runner.ema.average import build_ema
from runner.errors import Interrupted
from runner.guards.nonfinite import NonFiniteGuard, NonFiniteStop, grad_norm
from runner.guards.oom import MicroBatchRecovery, OutOfMemoryGiveUp
from runner.memory.profile import NullProfiler, build_profiler
from runner.memory.stats import MemoryMonitor
from runner.optim.build import build_optimizer
from runner.optim.fused import fuse_into_backward, fusion_of
from runner.output.progress import build_progress
from runner.output.report import (  # noqa: F401  (read_metrics: re-exported)
    MetricsWriter,
    NullMetrics,
    drop_metrics_after,
    read_metrics,
)
from runner.output.trackers import start_tracking
from runner.resolved import ResolvedRun
from runner.state.checkpoint import TrainState, find_checkpoint, remove_leftovers
from runner.state.resume import saved_config_text
from runner.trainer import batch_len, encode, move_batch, slice_batch

log = logging.getLogger("runner")


class StopRequest:
    """SIGINT/SIGTERM: the first signal asks the loop to save and stop after the current step.

    A second signal stops at once, except while a checkpoint is being written: then it waits for
    the write to finish (a half-written checkpoint would be wasted work, and the runner would
    leave the previous one as the newest), and only a third forces the exit. A forced exit
    raises :class:`Interrupted`, which the job wrapper reports in one line; whatever save was in
    flight stays a hidden temporary folder that the next start removes.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self.last_saved: Path | None = None
        self._saving = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread (e.g. inside some test runners)
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            self.signum = signum
            log.warning("%s received: finishing this step, saving a checkpoint and stopping "
                        "(again: stop at once)", name)
            return
        if self._saving and self.count == 2:
            log.warning("%s received again: a checkpoint is being written; stopping right after it "
                        "(a third signal forces the exit and discards that checkpoint)", name)
            return
        kept = (f"The newest complete checkpoint is {self.last_saved} (train.resume={self.last_saved})."
                if self.last_saved is not None else "No checkpoint was saved in this run.")
        raise Interrupted(signum, f"Stopped at once by a repeated {name}; the step in progress is lost. {kept}")

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A block (a checkpoint save) that a second signal does not cut short."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


@dataclass
class TrainResult:
    steps_done: int
    losses: list[float] = field(default_factory=list)
    interrupted_by: int | None = None
    checkpoint: Path | None = None
    seconds_per_step: float = math.nan
    notes: dict[str, Any] = field(default_factory=dict)  # ctx.notes at the end (optimizer state bytes, ...)


def make_accelerator(run: ResolvedRun, **tracking: Any) -> Accelerator:
    """A fresh Accelerator for this job, with the resolved precision (runner/resolved.py decides it)
    and the tracker's ``log_with``/``project_dir`` (runner/output/trackers.py:accelerator_kwargs).

    accelerate keeps a process-wide singleton state; Hydra's ``-m`` runs jobs one after another
    in the same process, and jobs may differ in mixed precision, so the state is reset first.
    """
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(mixed_precision=run.precision, cpu=run.device.type == "cpu", **accelerator_options(run),
                       **tracking)


def train(ctx: RunContext) -> TrainResult:
    """Run ``cfg.train.steps`` optimizer steps of ``ctx.trainer`` on ``ctx.models``."""
    cfg, models, trainer, run = ctx.cfg, ctx.models, ctx.trainer, ctx.run
    out = ctx.output_dir
    accelerator = ctx.accelerator
    batch_size, micro = run.batch_size, run.micro_batch
    dataset = ctx.validation.training_view(trainer.dataset())  # data.val_fraction: held-out samples never trained
    log.info("data: %s%s", describe_dataset(dataset), ctx.flip.describe())  # what is used, skipped or upscaled, and why
    order = BatchOrder(dataset, batch_size, run.seed)  # step -> (indices, seeds): runner/data/order.py

    dist = ctx.dist  # one process: a no-op; dist=ddp|fsdp: runner/dist/runtime.py
    dist.prepare_models(ctx)  # DDP or FSDP2 around the trained modules, before the optimizer takes their parameters
    ctx.optimizer = build_optimizer(cfg.optimizer, list(models.trainable_parameters()), notes=ctx.notes)
    ctx.run_phase("wrap_optimizer")
    ctx.optimizer = fuse_into_backward(ctx.optimizer, cfg.optimizer, run, models.named_trainable_parameters())
    fused = fusion_of(ctx.optimizer)  # optimizer.fused_backward: steps inside backward (runner/optim/fused.py); else a no-op view
    scheduler = get_scheduler(
        cfg.train.lr_scheduler, ctx.optimizer, num_warmup_steps=cfg.train.lr_warmup_steps, num_training_steps=cfg.train.steps
    )
    state = TrainState(micro_batch_size=micro)
    if dist.is_main:
        remove_leftovers(out / "checkpoints")  # hidden folders of a save or prune that was killed
    if cfg.train.resume:
        ckpt = find_checkpoint(cfg.train.resume)
        state = dist.load_checkpoint(ckpt, models, ctx.optimizer, scheduler, optimizer_name=cfg.optimizer.get("name"))
        micro = min(state.micro_batch_size or micro, run.rank_batch)  # saved by another world size: this rank's share
        log.info("resumed from %s at step %d (%d samples seen)", ckpt, state.step, state.samples_seen)
        if dist.is_main:
            drop_metrics_after(out / "metrics.jsonl", state.step)  # one curve: no step twice
        order.resume(state.step, state.samples_seen)
    if order.describe():
        log.info("%s", order.describe())
    optimizer, scheduler = accelerator.prepare(ctx.optimizer, scheduler)
    ctx.ema = build_ema(ctx, find_checkpoint(cfg.train.resume) if cfg.train.resume else None)  # ema.enabled only
    params = list(models.trainable_parameters())
    for name, m in models.items():
        m.train(name in models.trained)

    metrics = MetricsWriter(out / "metrics.jsonl", append=bool(cfg.train.resume)) if dist.is_main else NullMetrics()
    ckpt_root = out / "checkpoints"
    result = TrainResult(steps_done=state.step)
    recovery = MicroBatchRecovery(ctx, micro, run.rank_batch, params,  # OOM: discard the step, halve, retry
                                  unsplittable_because=fused.unsplittable_because)
    memory = MemoryMonitor(ctx.device, run.budget_gb)  # per-step memory columns and pressure warnings
    profiler = build_profiler(cfg, ctx) if dist.is_main else NullProfiler()  # a no-op unless profile.enabled
    guard = NonFiniteGuard(cfg.train.on_nonfinite, cfg.train.nonfinite_patience, lr=cfg.optimizer.get("lr"),
                           scaler_active=accelerator.scaler is not None, precision=run.precision)
    progress = build_progress(cfg, state.step, dist.is_main)  # tqdm on a terminal, else a log line every log.every steps
    step_times: list[float] = []
    tracking = ctx.tracking = start_tracking(accelerator, cfg)  # a no-op unless log.tracker; samplers log images here

    def update(step_loss: float) -> None:
        norm = None
        if run.max_grad_norm > 0:
            norm = accelerator.clip_grad_norm_(params, run.max_grad_norm)
        elif guard.needs_grad_norm and math.isfinite(step_loss):
            norm = grad_norm(params)
        if guard.allow_update(state.step + 1, step_loss, fused.guard_norm(norm)):  # NaN/inf: skip, or stop (runner/guards/nonfinite.py)
            optimizer.step()

    def save() -> Path:
        state.micro_batch_size = recovery.micro_batch_size
        return dist.save_checkpoint(ckpt_root, state, models, ctx.optimizer, scheduler, cfg.train.keep_saved,
                                    config_text=saved_config_text(cfg, ctx.overrides),
                                    optimizer_name=cfg.optimizer.get("name"), more_files=ctx.ema.write_checkpoint)

    with StopRequest() as stop, closing(progress), closing(metrics), closing(profiler), closing(tracking):
        ctx.sampler.maybe_sample(state.step)  # samples at the start (step 0, or the resumed step)
        while state.step < cfg.train.steps:
            t0 = time.perf_counter()
            profiler.begin_step(state.step + 1)
            ctx.run_phase("on_step_start", state.step)
            batch = order.batch(state.step)  # the global batch; this rank's share of it (all of it in one process)
            indices, seeds = dist.shard(batch.indices, batch.seeds)
            raw = collate(visit_samples(dataset, indices, seeds))
            raw["sample_seed"] = seeds
            raw = ctx.flip.apply(raw)  # data.random_flip: a coin per visit, from sample_seed (runner/data/flip.py)
            try:  # dist.attempts: every rank agrees on each attempt (runner/dist/agree.py); the global mean loss
                step_loss = recovery.run(state.step + 1, dist.attempts(lambda m: forward_backward(ctx, raw, m, profiler)))
            except OutOfMemoryGiveUp as e:  # already at micro-batch 1: keep the last completed step, stop
                e.add_checkpoint(save() if state.step and fused.intact else None, state.step,
                                 fused.unsaved_reason(result.checkpoint))
                raise
            try:
                with profiler.phase("optimizer"):
                    recovery.update(state.step + 1, lambda: update(step_loss), result.checkpoint)
            except NonFiniteStop as e:  # the update was not applied: the weights are the last good step's
                e.add_checkpoint(save() if state.step and fused.intact else None, state.step,
                                 fused.unsaved_reason(result.checkpoint))
                optimizer.zero_grad(set_to_none=True)
                raise
            scheduler.step()
            optimizer.zero_grad(set_to_none=dist.grads_to_none)
            state.step += 1
            state.samples_seen += batch_size
            ctx.ema.update(state.step, applied=guard.applied and not accelerator.optimizer_step_was_skipped)
            ctx.run_phase("on_step_end", state.step)
            dt = time.perf_counter() - t0
            profiler.end_step()  # after dt: writing the profile's files is not step time
            step_times.append(dt)
            mem = memory.sample(state.step)
            row = {"step": state.step, "loss": step_loss, "lr": scheduler.get_last_lr()[0], "s_per_step": dt,
                   "samples_seen": state.samples_seen, "micro_batch_size": recovery.micro_batch_size,
                   "oom_retries": recovery.retries_this_step, "nonfinite_skips": guard.total, **mem}
            row.update(ctx.validation.maybe_evaluate(state.step))  # val_loss every val.every steps
            metrics.write(row)
            tracking.log_metrics(state.step, row)
            result.losses.append(step_loss)
            progress.update(state.step, step_loss, row["lr"], dt, memory.postfix(mem))
            stop.signum = dist.agree_stop(stop.signum)  # a signal on any rank stops every rank after this step
            due = cfg.train.save_every and state.step % cfg.train.save_every == 0
            if due or state.step == cfg.train.steps or stop.signum is not None:
                with stop.deferred():  # a second Ctrl-C waits for the save; a third forces the exit
                    result.checkpoint = stop.last_saved = save()
            ctx.sampler.maybe_sample(state.step)  # every sample.every steps and at the end (runner/sampling/)
            if stop.signum is not None:
                result.interrupted_by = stop.signum
                break
    result.steps_done = state.step
    result.notes = dict(ctx.notes)
    if step_times:
        tail = step_times[1:] or step_times  # the first step includes one-off warm-up
        result.seconds_per_step = sum(tail) / len(tail)
    return result


def forward_backward(ctx: RunContext, raw: dict[str, Any], micro: int, profiler: Any) -> float:
    """Every forward and backward pass of one step, ``micro`` samples at a time; the step's loss.

    Each micro-batch's loss is weighted by its share of the batch, so the accumulated gradient
    and the returned loss are the batch mean for any ``micro`` (the OOM retry relies on this).    """
    batch_size = batch_len(raw)
    total = 0.0
    for lo in range(0, batch_size, micro):
        mb = move_batch(slice_batch(raw, lo, min(lo + micro, batch_size)), ctx.device)
        with profiler.phase("forward"), ctx.step_context(), ctx.accelerator.autocast():
            enc = encode(ctx.trainer, ctx.models, mb)
            loss = ctx.trainer.loss(ctx.models, enc)
        weight = batch_len(mb) / batch_size
        with profiler.phase("backward"):
            if fusion_of(ctx.optimizer).admits(loss):  # fused backward: a non-finite loss must not reach the weights
                ctx.accelerator.backward(loss * weight)
        total += float(loss.detach()) * weight
    return total
