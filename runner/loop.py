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
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffusers.optimization import get_scheduler

from runner.context import RunContext
from runner.data import BatchOrder, collate, describe_dataset, describe_sample, visit_samples
from runner.errors import Interrupted, ResumableStop
from runner.export.checkpoint import EXPORT_DIR, INFO_FILE
from runner.guards.nonfinite import NonFiniteGuard, NonFiniteStop, grad_norm
from runner.guards.weights import WeightGuard, WeightsBlewUp
from runner.guards.oom import MicroBatchRecovery, OutOfMemoryGiveUp
from runner.loss.config import describe_prior
from runner.memory.cuda_sim import HostCounts
from runner.memory.profile import NullProfiler, build_profiler
from runner.memory.stats import MemoryMonitor
from runner.optim.fused import fusion_of
from runner.optim.modes import to_evaluation_point, to_training_point
from runner.output.progress import build_progress
from runner.output.report import MetricsWriter, NullMetrics, drop_metrics_after
from runner.output.trackers import start_tracking
from runner.session import attach_ema, attach_optimizer
from runner.state.checkpoint import TrainState, find_checkpoint, remove_leftovers
from runner.state.resume import saved_config_text
from runner.sweep.watch import build_watch
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
        self._notes: list[str] = []
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread (e.g. inside some test runners)
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        # No logging here: the signal can land while the main thread is inside a log handler's
        # write, and a second write to the same stream from the handler raises "reentrant call".
        # The loop logs what was noted (announce) after the step and after a save.
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            self.signum = signum
            self._notes.append(f"{name} received: finishing this step, saving a checkpoint and stopping "
                               "(again: stop at once)")
            return
        if self._saving and self.count == 2:
            self._notes.append(f"{name} received again: a checkpoint is being written; stopping right after it "
                               "(a third signal forces the exit and discards that checkpoint)")
            return
        kept = (f"The newest complete checkpoint is {self.last_saved} (train.resume={self.last_saved})."
                if self.last_saved is not None else "No checkpoint was saved in this run.")
        raise Interrupted(signum, f"Stopped at once by a repeated {name}; the step in progress is lost. {kept}")

    def announce(self) -> None:
        """Log what the signal handler noted since the last call (outside the handler: see _handle)."""
        while self._notes:
            log.warning("%s", self._notes.pop(0))

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A block (a checkpoint save) that a second signal does not cut short."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False

    def __exit__(self, *exc: Any) -> None:
        self.announce()
        for s, h in self._old.items():
            signal.signal(s, h)


@dataclass
class TrainResult:
    steps_done: int
    losses: list[float] = field(default_factory=list)
    interrupted_by: int | None = None
    checkpoint: Path | None = None
    seconds_per_step: float = math.nan
    nonfinite_skips: int = 0  # steps whose update was skipped on a non-finite loss or gradient
    stopped_early: str | None = None  # why the sweep stopped this job (Optuna's pruner, sweep.stop_if): runner/sweep/watch.py
    notes: dict[str, Any] = field(default_factory=dict)  # ctx.notes at the end (optimizer state bytes, ...)


class Loop:
    """Everything the managed loop holds for one run, built once by :func:`start_loop`; its methods
    are the parts of one step, so :func:`train` reads as the step itself."""

    def __init__(self, ctx: RunContext) -> None:
        cfg, run = ctx.cfg, ctx.run
        self.ctx, self.cfg, self.out = ctx, cfg, ctx.output_dir
        self.dataset = ctx.validation.training_view(ctx.trainer.dataset())  # data.val_fraction: held-out samples never trained
        # what is used, skipped or upscaled, and why; the prior (class) sets' share and loss weight
        log.info("data: %s%s%s", describe_dataset(self.dataset), ctx.flip.describe(), describe_prior(cfg))
        self.order = BatchOrder(self.dataset, run.batch_size, run.seed)  # step -> (indices, seeds): runner/data/order.py
        self.dist = ctx.dist  # one process: a no-op; dist=ddp|fsdp: runner/distributed/runtime.py
        self.unexported: Path | None = None  # a resumed final checkpoint whose export is missing
        attach_optimizer(ctx)  # DDP/FSDP, optimizer, wrap_optimizer, fused backward (runner/session.py)
        self.fused = fusion_of(ctx.optimizer)  # optimizer.fused_backward: steps inside backward; else a no-op view
        self.scheduler = get_scheduler(cfg.train.lr_scheduler, ctx.optimizer, num_warmup_steps=cfg.train.lr_warmup_steps,
                                       num_training_steps=cfg.train.steps)
        self.state, micro, resumed = self._resume(run.micro_batch)
        self.optimizer, self.scheduler = ctx.accelerator.prepare(ctx.optimizer, self.scheduler)
        attach_ema(ctx, resumed)  # ema.enabled only; continues a resumed average (runner/session.py)
        self.params = list(ctx.models.trainable_parameters())
        self.metrics = (MetricsWriter(self.out / "metrics.jsonl", append=bool(cfg.train.resume)) if self.dist.is_main
                        else NullMetrics())
        self.result = TrainResult(steps_done=self.state.step)
        self.recovery = MicroBatchRecovery(ctx, micro, run.rank_batch, self.params,  # OOM: discard the step, halve, retry
                                           unsplittable_because=self.fused.unsplittable_because)
        self.memory = MemoryMonitor(ctx.device, run.budget_gb, ctx.card)  # per-step memory columns and pressure warnings
        self.counts = HostCounts(ctx.card)  # train.device=cuda_sim: the step's host syncs and card ops
        self.profiler = build_profiler(cfg, ctx) if self.dist.is_main else NullProfiler()  # a no-op unless profile.enabled
        self.guard = NonFiniteGuard(cfg.train.on_nonfinite, cfg.train.nonfinite_patience, lr=cfg.optimizer.get("lr"),
                                    scaler_active=ctx.accelerator.scaler is not None, precision=run.precision)
        self.weights = WeightGuard(cfg.train.get("max_weight_growth", 0), self.params, ctx.device,  # blow-ups stop
                                   lr=cfg.optimizer.get("lr"), agree=self.dist.all_agree)
        self.weights.start(resumed, self.state.step)
        self.progress = build_progress(cfg, self.state.step, self.dist.is_main)  # tqdm on a terminal, else a log line
        self.step_times: list[float] = []
        self.tracking = ctx.tracking = start_tracking(ctx.accelerator, cfg)  # a no-op unless log.tracker
        self.watch = build_watch(cfg, self.out, run.dist.world_size)  # a sweep's early stop (runner/sweep/watch.py)
        self.val_loss: float | None = None  # this step's held-out loss, when it was computed

    def _resume(self, micro: int) -> tuple[TrainState, int, Path | None]:
        """The train state to start from: fresh, or ``train.resume``'s checkpoint loaded into the
        models, optimizer and scheduler; the micro-batch size to start with; the checkpoint."""
        ctx, cfg = self.ctx, self.cfg
        state = TrainState(micro_batch_size=micro)
        if self.dist.is_main:
            remove_leftovers(self.out / "checkpoints")  # hidden folders of a save or prune that was killed
        ckpt = None
        if cfg.train.resume:
            ckpt = find_checkpoint(cfg.train.resume)
            state = self.dist.load_checkpoint(ckpt, ctx.models, ctx.optimizer, self.scheduler,
                                              optimizer_name=cfg.optimizer.get("name"))
            loaded = getattr(ctx.optimizer, "weights_loaded", None)  # offload=optimizer: host masters take the weights
            if loaded is not None:
                loaded()
            micro = min(state.micro_batch_size or micro, ctx.run.rank_batch)  # another world size: this rank's share
            log.info("resumed from %s at step %d (%d samples seen)", ckpt, state.step, state.samples_seen)
            self._take_configured_lr(state.step)
            if self.dist.is_main:
                drop_metrics_after(self.out / "metrics.jsonl", state.step)  # one curve: no step twice
            self.order.resume(state.step, state.samples_seen)
            if state.step >= cfg.train.steps and not (ckpt / EXPORT_DIR / INFO_FILE).is_file():
                # Stopped during the final export (a kill, a full disk): nothing is left to train, and
                # the result names this checkpoint so that its export is written now.
                self.unexported = ckpt
        if self.order.describe():
            log.info("%s", self.order.describe())
        return state, micro, ckpt

    def _take_configured_lr(self, step: int) -> None:
        """A resume continues the saved optimizer state and schedule, with this run's ``optimizer.lr``.

        The saved optimizer and scheduler hold the learning rate they were built with, so loading
        them silently kept it: a lower ``optimizer.lr`` after a divergence (what the non-finite
        stop advises) was logged as a change and then not used. Here the schedule's base becomes the
        configured rate and the current rate follows the schedule at the resumed step."""
        lr = float(self.cfg.optimizer.lr)
        groups = self.ctx.optimizer.param_groups
        saved = [float(g.get("initial_lr", g["lr"])) for g in groups]
        if all(math.isclose(s, lr, rel_tol=1e-9) for s in saved):
            return
        factors = getattr(self.scheduler, "lr_lambdas", None)  # LambdaLR: diffusers' schedules
        for i, g in enumerate(groups):
            g["initial_lr"] = lr
            g["lr"] = lr * (factors[i](self.scheduler.last_epoch) if factors else g["lr"] / saved[i])
        self.scheduler.base_lrs = [lr] * len(groups)
        self.scheduler._last_lr = [g["lr"] for g in groups]  # get_last_lr(): the metrics' lr column
        log.info("optimizer.lr=%g (the checkpoint's was %g): the schedule continues from step %d with the new base rate",
                 lr, saved[0], step)

    def closing(self) -> ExitStack:
        """The loop's outputs, closed however it ends."""
        stack = ExitStack()
        for thing in (self.progress, self.metrics, self.profiler, self.tracking):
            stack.enter_context(closing(thing))
        return stack

    def save(self) -> Path:
        self.state.micro_batch_size = self.recovery.micro_batch_size
        ctx, cfg = self.ctx, self.cfg
        to_evaluation_point(ctx.optimizer)  # schedule-free: a checkpoint holds the evaluated weights (runner/optim/modes.py)
        saved = self.dist.save_checkpoint(self.out / "checkpoints", self.state, ctx.models, ctx.optimizer, self.scheduler,
                                         cfg.train.keep_saved, config_text=saved_config_text(cfg, ctx.overrides),
                                         optimizer_name=cfg.optimizer.get("name"), more_files=ctx.ema.write_checkpoint,
                                         more_shards=ctx.ema.shards())  # dist=fsdp: the EMA's shards, in its DCP folder
        self.weights.saved(saved, self.state.step)  # every step up to here passed the weight check
        return saved

    def stop_resumably(self, error: ResumableStop) -> None:
        """Before a stop that loses no completed step: save the last completed step (when there is
        one and fused backward left the weights intact) and name it in ``error``'s message."""
        step = self.state.step
        error.add_checkpoint(self.save() if step and self.fused.intact else None, step,
                             self.fused.unsaved_reason(self.result.checkpoint))

    def passes(self) -> float:
        """This step's forward and backward passes (OOM: retried with smaller micro-batches); its loss."""
        ctx, step = self.ctx, self.state.step
        batch = self.order.batch(step)  # the global batch; this rank's share of it (all of it in one process)
        indices, seeds = self.dist.shard(batch.indices, batch.seeds)
        raw = collate(visit_samples(self.dataset, indices, seeds))
        raw["sample_seed"] = seeds
        raw = ctx.flip.apply(raw)  # data.random_flip: a coin per visit, from sample_seed (runner/data/flip.py)
        try:  # dist.attempts: every rank agrees on each attempt (runner/distributed/agree.py); the global mean loss
            return self.recovery.run(step + 1, self.dist.attempts(lambda m: forward_backward(ctx, raw, m, self.profiler)))
        except OutOfMemoryGiveUp as e:  # already at micro-batch 1: keep the last completed step, stop
            self.stop_resumably(e)
            raise

    def update(self, step_loss: float) -> None:
        """Clip, check for non-finite values and apply the optimizer step (or skip it, or stop)."""
        run, params, step = self.ctx.run, self.params, self.state.step + 1

        def apply() -> None:
            norm = None
            if run.max_grad_norm > 0:
                norm = self.ctx.accelerator.clip_grad_norm_(params, run.max_grad_norm)
            elif self.guard.needs_grad_norm and math.isfinite(step_loss):
                norm = grad_norm(params)
            if self.guard.allow_update(step, step_loss, self.fused.guard_norm(norm)):  # NaN/inf: skip or stop
                self.optimizer.step()

        skipped_before = self.guard.total
        try:
            with self.profiler.phase("optimizer"):
                self.recovery.update(step, apply, self.result.checkpoint)
            self.weights.check(step)  # the update blew the weights up: stop, saving nothing
        except WeightsBlewUp as e:  # applied and not undoable: name the last checkpoint that passed
            sane = self.weights.sane
            e.add_checkpoint(sane[0] if sane else None, sane[1] if sane else 0)
            self.optimizer.zero_grad(set_to_none=True)
            raise
        except NonFiniteStop as e:  # the update was not applied: the weights are the last good step's
            self.stop_resumably(e)
            self.optimizer.zero_grad(set_to_none=True)
            raise
        if self.guard.total > skipped_before:  # a skipped step: name what it trained on, so bad data can be found
            indices = self.order.batch(self.state.step).indices
            log.warning("step %d was skipped; its samples: %s", step,
                        ", ".join(describe_sample(self.dataset, i) for i in indices))
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=self.dist.grads_to_none)
        self.state.step += 1
        self.state.samples_seen += self.ctx.run.batch_size
        self.ctx.ema.update(self.state.step, applied=self.guard.applied and not self.ctx.accelerator.optimizer_step_was_skipped)

    def record(self, step_loss: float, dt: float) -> None:
        """The step's metrics row (loss, lr, time, memory, val_loss), the tracker and the progress line."""
        step = self.state.step
        counts = self.counts.end()  # before the metrics' own work (validation, trackers) is counted
        self.step_times.append(dt)
        mem = self.memory.sample(step)
        row = {"step": step, "loss": step_loss, "lr": self.scheduler.get_last_lr()[0], "s_per_step": dt,
               "samples_seen": self.state.samples_seen, "micro_batch_size": self.recovery.micro_batch_size,
               "oom_retries": self.recovery.retries_this_step, "nonfinite_skips": self.guard.total, **counts, **mem}
        if self.weights.rms is not None:
            row["weight_rms"] = self.weights.rms  # read by the weight check (train.max_weight_growth)
        take = getattr(self.ctx.trainer, "take_loss_parts", None)  # a loss of several terms: each one's column
        if callable(take):
            row.update(take())
        row.update(self.ctx.validation.maybe_evaluate(step))  # val_loss every val.every steps
        self.val_loss = row.get("val_loss")
        row.update(optimizer_columns(self.ctx.optimizer))  # optimizer=prodigy: its step-size estimate
        self.metrics.write(row)
        self.tracking.log_metrics(step, row)
        self.result.losses.append(step_loss)
        self.progress.update(step, step_loss, row["lr"], dt, self.memory.postfix(mem))

    def finish(self) -> TrainResult:
        result = self.result
        if result.checkpoint is None and self.unexported is not None:
            log.info("resume: %s is the final step and has no export (the run stopped while writing it); "
                     "exporting it now", self.unexported)
            result.checkpoint = self.unexported
        result.steps_done = self.state.step
        result.nonfinite_skips = self.guard.total
        result.notes = dict(self.ctx.notes)
        if self.step_times:
            tail = self.step_times[1:] or self.step_times  # the first step includes one-off warm-up
            result.seconds_per_step = sum(tail) / len(tail)
        return result


def train(ctx: RunContext) -> TrainResult:
    """Run ``cfg.train.steps`` optimizer steps of ``ctx.trainer`` on ``ctx.models``: the loop itself."""
    loop = Loop(ctx)
    steps, save_every, state = ctx.cfg.train.steps, ctx.cfg.train.save_every, loop.state
    with StopRequest() as stop, loop.closing():
        ctx.sampler.maybe_sample(state.step)  # samples at the start (step 0, or the resumed step)
        while state.step < steps:
            t0 = time.perf_counter()
            loop.counts.begin()
            loop.profiler.begin_step(state.step + 1)
            ctx.run_phase("on_step_start", state.step)
            trainer_step_start(ctx, state.step)  # a trainer that switches modules per step (Wan 2.2 A14B's experts)
            to_training_point(ctx.optimizer)  # schedule-free: back from the weights a checkpoint saved
            step_loss = loop.passes()
            loop.update(step_loss)
            ctx.run_phase("on_step_end", state.step)
            dt = time.perf_counter() - t0
            loop.profiler.end_step()  # after dt: writing the profile's files is not step time
            loop.record(step_loss, dt)
            stop.announce()
            stop.signum = loop.dist.agree_stop(stop.signum)  # a signal on any rank stops every rank after this step
            early = loop.watch.check(state.step, loop.val_loss)  # the sweep's pruner (reports val_loss to it first)
            early = loop.result.stopped_early = early if state.step < steps else None  # the last step: finished anyway
            if (save_every and state.step % save_every == 0) or state.step == steps or stop.signum is not None or early:
                with stop.deferred():  # a second Ctrl-C waits for the save; a third forces the exit
                    loop.result.checkpoint = stop.last_saved = loop.save()
                stop.announce()
            ctx.sampler.maybe_sample(state.step)  # every sample.every steps and at the end (runner/sampling/)
            if stop.signum is not None:
                loop.result.interrupted_by = stop.signum
                break
            if early:
                log.info("sweep: %s; the checkpoint of step %d is kept", early, state.step)
                break
        to_evaluation_point(ctx.optimizer)  # schedule-free: the run ends on the weights it saved (and exports)
    return loop.finish()


def trainer_step_start(ctx: RunContext, step: int) -> None:
    """The trainer's optional ``on_step_start(ctx, step)`` (0-based step), after the plugins' and before
    the step's batch: what a trainer changes for a whole optimizer step, every micro-batch alike."""
    hook = getattr(ctx.trainer, "on_step_start", None)
    if callable(hook):
        hook(ctx, step)


def optimizer_columns(optimizer: Any) -> dict[str, float]:
    """Metrics columns of the optimizer's own: Prodigy's step-size estimate ``d`` (its step is ``lr * d``)."""
    groups = getattr(optimizer, "param_groups", None) or [{}]
    d = groups[0].get("d") if "d_coef" in groups[0] else None
    return {"prodigy_d": float(d)} if d is not None else {}


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
        fusion = fusion_of(ctx.optimizer)
        with profiler.phase("backward"):
            if fusion.admits(loss):  # fused backward: a non-finite loss must not reach the weights
                ctx.accelerator.backward(loss * weight)
        # The micro-batch's one host read of a card value: after backward is queued (fused backward read it before)
        total += (float(loss.detach()) if fusion.loss_value is None else fusion.loss_value) * weight
    return total
