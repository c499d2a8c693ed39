"""One training step, simulated: :func:`simulate_step` (:func:`plan_step` from a config alone).

How a step is simulated
-----------------------
1. The trainer builds its models at the configured size on ``meta`` (``build_models("meta")``),
   and every parameter and buffer becomes a fake tensor on the fake *host* (``cpu``): a real run
   also builds on the host first.
2. Every configured plugin runs through the same :class:`~runner.context.RunContext` phases as
   a real run (``transform_models``, ``place_models``, the move of unplaced modules to the
   device, ``wrap_execution``, ``wrap_optimizer``, the step hooks, ``teardown``) with
   ``ctx.simulate=True``, ``ctx.device=meta`` (the simulated accelerator) and ``ctx.host=cpu``.
   ``configure_process`` is not run: it sets process-wide things (environment, CUDA caps) and
   allocates no tensor.
3. One optimizer step under ``FakeTensorMode``: ``encode`` of a raw batch under ``no_grad``
   (``trainer.example_raw_batch``, when the trainer has it and no plugin made encoding
   unnecessary), ``loss``, backward, gradient clipping, ``optimizer.step()``; with
   ``train.grad_accum > 1`` two micro-batches (every later micro-batch repeats the second
   one's memory). A :class:`~runner.memory.live_bytes.LiveBytesTracker` counts live storage bytes
   per device, phase, category and top-level module. With ``ema.enabled`` the EMA copy is built
   right after the optimizer and updated once after its step (runner/plan/ema.py).
4. Steady state: optimizer state is created by the first step and then lives through every
   later forward and backward, so the state's bytes are added to the forward and backward peaks
   (exact: the state does not change size while they run). The plan's peak is the largest of
   setup, forward+state, backward+state and the optimizer step.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import time
from typing import Any

import torch
from torch import nn

from runner import registry
from runner.parts import build_plugins, build_trainer, idle_parts, prepare_models
from runner.compat import without_dispatch_modes
from runner.context import RunContext
from runner.data import planned_size
from runner.devices import reference_spec
from runner.distributed.loading import load_mode
from runner.guards.nonfinite import grad_norm
from runner.memory.live_bytes import LiveBytesTracker
from runner.memory.live_bytes_views import NO_MODULE
from runner.optim.build import build_optimizer
from runner.optim.fused import FusedBackward, fuse_into_backward
from runner.plan.adapters import lycoris_draws_skipped
from runner.plan.allocator import AllocationLog, plan_reserved
from runner.plan.quantized_reads import leave_unread, load_note
from runner.plan.batch import (
    cached_parts,
    encode_batch,
    encode_part_shapes,
    example_batch,
    fake_batch,
    move_batch,
    start_encode_part_shapes,
)
from runner.plan.calibrate import cpu_target
from runner.plan.comm import rank_comm
from runner.plan.cost import CostCounter
from runner.plan.dist import gathered_params, host_per_node, rank0_only_params, rank_state_bytes
from runner.plan.dist import measure as measure_rank
from runner.plan.ema import plan_ema
from runner.plan.fake import fake_module, simulation_mode, weights_left_uninitialised
from runner.plan.fill_time import fill_time
from runner.plan.prepass import FILL_PHASE, cache_fill_report, simulate_cache_fill
from runner.plan.quick_process import import_model_classes, old_objects_frozen, one_thread
from runner.plan.result import PhasePeak, Plan
from runner.plan.sampling import plan_sampling
from runner.memory.semantics import DeviceSemantics, SimulatedAccelerator
from runner.plan.speed import StepTime, Target, Trained, gpu_target, predict
from runner.plan.steady import by_category, host_in_training, optimizer_state_by_module, steady_peaks
from runner.plan.suggest import suggest
from runner.plan.target import CUDA_WORKSPACE_MARGIN_BYTES, DEVICE, HOST
from runner.plan.timeline import Timeline, chain
from runner.plan.val import plan_validation
from runner.plan.known_values import known_values
from runner.resolved import ResolvedRun, planned_target, resolve

log = logging.getLogger("runner")

OUTSIDE = "(outside modules)"


def _isolated(trainer: Any) -> Any:
    """A deep copy of the trainer for the simulation.

    Trainers keep objects that move their tensors to the device they are used on (diffusers'
    DDPMScheduler stores ``alphas_cumprod`` moved to the batch's device) and plugins may patch
    ``trainer.encode``; simulating on the run's own trainer would leave fake tensors and patches
    in it. The protocol forbids building models in ``__init__``, so a copy is cheap. A trainer
    that cannot be deep-copied is simulated on a shallow copy (its dicts and lists copied) and
    a warning says so.
    """
    try:
        return copy.deepcopy(trainer)
    except Exception as e:  # noqa: BLE001 - any object graph can refuse a deep copy
        log.warning("planner: %s cannot be deep-copied (%s); simulating on a shallow copy, so objects it "
                    "holds may keep fake tensors", type(trainer).__name__, e)
        twin = copy.copy(trainer)
        for k, v in vars(trainer).items():
            if isinstance(v, (dict, list)):
                setattr(twin, k, copy.copy(v))
        return twin


class _Recorder:
    """Per-phase snapshots of the tracker (taken at the end of each phase, then peaks reset)."""

    def __init__(self, tracker: LiveBytesTracker, top_level: set[str]) -> None:
        self.tracker = tracker
        self.top_level = top_level
        self.phases: list[tuple[str, dict[str, Any]]] = []

    def top(self, label: str) -> str:
        head = label.split(".", 1)[0]
        if head in self.top_level:
            return head
        return OUTSIDE if label == NO_MODULE else label

    def take(self, name: str) -> None:
        snap = self.tracker.snapshot()["devices"]
        per_dev = {}
        for dev, d in snap.items():
            by_module: dict[str, dict[str, int]] = {}
            for label, cats in d["peak_by_module"].items():
                agg = by_module.setdefault(self.top(label), {})
                for c, n in cats.items():
                    agg[c] = agg.get(c, 0) + n
            per_dev[dev] = PhasePeak(name, d["peak_phase"], d["peak_bytes"], by_module)
        self.phases.append((name, per_dev))
        self.tracker.reset_peaks()


def plan_step(
    cfg: Any,
    trainer: Any = None,
    schedule: Any = None,
    *,
    run: ResolvedRun | None = None,
    target: str | None = None,
    reads_cache: bool = False,
) -> Plan:
    """Plan ``cfg`` for a caller with no prepared run (fit candidates, benchmarks, tests): ``run`` (default: ``cfg``
    resolved for ``target``, CUDA unless ``train.device=cpu``), ``trainer`` and ``schedule`` (default: built from
    ``cfg`` for the simulated run) are made here when not given, then :func:`simulate_step`."""
    if run is None:
        run = resolve(cfg, target=target or planned_target(cfg), device=DEVICE)
    simulated = run.simulated()
    trainer = trainer if trainer is not None else build_trainer(cfg, simulated)
    schedule = schedule if schedule is not None else build_plugins(cfg, simulated)
    return simulate_step(cfg, run, trainer, schedule, reads_cache=reads_cache)


def simulate_step(cfg: Any, run: ResolvedRun, trainer: Any, schedule: Any, *, reads_cache: bool = False) -> Plan:
    """Simulate one training step of ``run`` with the ``trainer`` and plugin ``schedule`` (built for
    ``run.simulated()``) it is given; nothing real is allocated. ``reads_cache``: plugins may read their encoder
    cache to plan only the pre-pass this run does (the preflight); otherwise a cold cache is assumed."""
    run = run.simulated()
    t0 = time.perf_counter()
    timing = step_time_target(run)  # before one_thread: a CPU is measured with the run's own threads
    calibrated_s = time.perf_counter() - t0
    started = time.perf_counter()
    trainer = _isolated(trainer)
    t0 = time.perf_counter()
    import_model_classes(trainer)  # before the freeze: see the function
    imported_s = time.perf_counter() - t0  # paid by the process once, and by a run for its own build: not the plan's
    with one_thread(), old_objects_frozen():
        sim = _Simulation(cfg, run, trainer, schedule)
        if reads_cache:
            sim.ctx.simulated_read = sim.outside
        with contextlib.closing(sim.part_shapes_job):  # no child left running if the plan fails
            counter = sim.counter = timing.counter()
            counter.counted |= {FILL_PHASE}  # the pre-pass's ops, for its time (runner/plan/fill_time.py)
            timeline = Timeline(sim.tracker)  # memory after every op: plan.png (runner/plan/picture.py)
            sim.tracker.op_observer = chain(counter.observe, timeline.observe)  # and FLOPs, bytes, copies (plan/cost.py)
            sampling = plan_sampling(sim)  # sample.every: keeps the VAE as the sampler does; a no-op when off
            validation = plan_validation(sim)  # data.val_*: only when it can raise the peak (runner/plan/val.py)
            with sim.mode:
                try:
                    with sim.tracker, sim.semantics:
                        sim.timed("setup", sim.setup)
                        for i in range(sim.n_micro):
                            sim.timed("forward+backward", sim.forward_backward, i)
                        sim.timed("optimizer", sim.optimizer_step)
                        sampling.simulate()  # one sampling pass, between steps (runner/plan/sampling.py)
                        validation.simulate()  # one validation pass, between steps
                finally:
                    sim.tracker.detach_module_hooks()
                    sim.ctx.teardown()
    plan = _assemble(sim, time.perf_counter() - started - imported_s)
    plan.step_time = _step_time(sim, counter, timing).to_dict()
    if plan.cache_fill is not None:
        plan.cache_fill["fill"] = fill_time(sim, plan.cache_fill, timing)
    plan.timeline = timeline.to_dict()
    if calibrated_s > 0.05:
        plan.notes["timings_s"]["cpu calibration"] = round(calibrated_s, 2)
    if imported_s > 0.05:
        plan.notes["timings_s"]["model classes import"] = round(imported_s, 2)
    sampling.report(plan)
    validation.report(plan)
    sim.ema.report(plan)
    return plan


def step_time_target(run: ResolvedRun) -> Target:
    """What the plan's s/step is predicted for: this CPU (measured), the named GPU, or the reference card."""
    if run.target == "cpu":
        return cpu_target()
    return gpu_target(run.gpu or reference_spec(), reference=run.gpu is None)


def _step_time(sim: _Simulation, counter: CostCounter, timing: Target) -> StepTime:
    trained = Trained()
    for p in sim.params:
        if not sim.fused and id(p) not in sim.with_grad:  # no gradient, no step (Wan 2.2 A14B's parked expert)
            continue
        n, b = p.numel(), p.numel() * p.element_size()
        if getattr(p, "fake_device", p.device).type == HOST.type and sim.run.target != "cpu":
            trained.host_elements += n
            trained.host_bytes += b
            trained.host_params += 1
        else:
            trained.device_elements += n
            trained.device_bytes += b
            trained.device_params += 1
    return predict(counter, timing, micro_batches=sim.run.grad_accum, simulated_micro=sim.n_micro,
                   transfers=sim.ctx.facts.transfers, optimizer=str(sim.cfg.optimizer.get("name", "adamw")),
                   trained=trained, fused=sim.fused, weight_reads=_weight_reads(sim),
                   comm=rank_comm(sim.run, sim.rank_layout, grad_bytes=trained.device_bytes + trained.host_bytes,
                                  grad_tensors=trained.device_params + trained.host_params, fused=sim.fused))


def _weight_reads(sim: _Simulation) -> int:
    """The loop's weight check (runner/guards/weights.py): one read per step when on and anything is trained."""
    growth = float(sim.cfg.train.get("max_weight_growth", 0) or 0)
    return int(growth > 0 and bool(sim.params))


class _Simulation:
    """The state of one simulated step; each method is one part of the step, in order."""

    def __init__(self, cfg: Any, run: ResolvedRun, trainer: Any, schedule: Any) -> None:
        self.cfg, self.run, self.trainer, self.target = cfg, run, trainer, run.target
        self.precision = run.precision
        self.batch_size = run.batch_size
        self.micro = run.micro_batch
        self.n_micro = min(run.grad_accum, 2)  # later micro-batches repeat the second one
        self.notes: dict[str, Any] = {"timings_s": {}}
        t0 = time.perf_counter()
        # Real meta tensors (shapes only), prepared as a run prepares them (dtypes, LoRA).
        with weights_left_uninitialised():  # no values on meta (runner/plan/fake.py)
            self.models = prepare_models(trainer.build_models(DEVICE), cfg.model, run)
        self.notes["timings_s"]["build"] = round(time.perf_counter() - t0, 2)
        self.semantics = DeviceSemantics(run.target, self.precision)
        self.ctx = RunContext(run=run, schedule=schedule, cfg=cfg, **idle_parts(run))
        self.ctx.trainer = trainer
        self.ctx.accelerator = SimulatedAccelerator(self.semantics, self.precision)
        self.tracker = LiveBytesTracker(count_inputs=False)  # every pre-existing tensor is tracked explicitly
        self.alloc_log = AllocationLog(DEVICE.type)  # device births and deaths, for the allocator's model
        self.tracker.alloc_observer = self.alloc_log
        self.recorder = _Recorder(self.tracker, set(self.models.modules))
        self.owner: dict[int, str] = {}  # id(parameter) -> top-level module
        self.mode = simulation_mode()
        self.params: list[nn.Parameter] = []
        self.with_grad: set[int] = set()  # trained parameters a backward gave a gradient: the optimizer steps them
        self.raw = False
        self.cached: set[str] = set()
        self.state_by_dev: dict[str, dict[str, dict[str, int]]] = {}
        self.host_steady = 0
        self.cache_fill: dict[str, Any] | None = None  # the encoders' pre-pass, when planned (runner/plan/prepass.py)
        self.counter: CostCounter | None = None  # the plan's op counts (plan/cost.py), set by simulate()
        self.ema = plan_ema(self)  # ema.enabled: the copy, counted where it lives (runner/plan/ema.py); else a no-op
        self.fused = False  # optimizer.fused_backward: the optimizer steps inside backward (runner/optim/fused.py)
        self.rank_layout: Any = None
        # Last: the encoders' output shapes, from the models as built, on the second core while
        # setup runs (runner/plan/second_core.py); needed from the first forward (self.part_shapes).
        self.part_shapes_job = start_encode_part_shapes(trainer, self.models, self.micro,
                                                        redo=self._part_shapes_in_place)

    def _part_shapes_in_place(self) -> dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
        """The encoders' output shapes computed here, when the child could not: from freshly built
        models (setup has changed ``self.models``), with the simulation's modes off and no
        autocast, as the child ran it. It raises what the trainer raises."""
        with without_dispatch_modes(), self.semantics.paused():
            with weights_left_uninitialised():
                models = prepare_models(self.trainer.build_models(DEVICE), self.cfg.model, self.run)
            return encode_part_shapes(self.trainer, models, self.micro)

    def outside(self, fn: Any) -> Any:
        """``fn()`` on real tensors, with the simulation's modes off (a plugin reading its cache folder)."""
        with without_dispatch_modes(), self.semantics.paused():
            return fn()

    @property
    def part_shapes(self) -> dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
        """Shapes and dtypes of each cacheable encode part (runner/plan/batch.py)."""
        return self.part_shapes_job.result()

    def timed(self, name: str, fn: Any, *args: Any) -> None:
        t0 = time.perf_counter()
        fn(*args)
        timings = self.notes["timings_s"]
        timings[name] = round(timings.get(name, 0.0) + time.perf_counter() - t0, 2)

    def setup(self) -> None:
        """Models onto the fake host, then the plugins' setup phases and placement, as a run does."""
        tracker, ctx = self.tracker, self.ctx
        memo: dict[int, torch.Tensor] = {}
        load = load_mode(self.trainer, self.run.dist, self.run.train_mode, self.cfg)
        unread = leave_unread(self.models, self.trainer, load, HOST)  # a base read as it is quantized (plan/base_reads.py)
        self.notes.update(load_note(self.trainer, self.cfg, self.run.train_mode, load))  # how that base is loaded
        for name, module in self.models.items():
            fake_module(module, HOST, memo, leave=unread)
            tracker.track([t for t in (*module.parameters(), *module.buffers()) if id(t) not in unread], "weights",
                          module=name)
        memo.clear()  # a module a plugin drops must be freed, as in a real run
        ctx.models = self.models
        rank0_only = rank0_only_params(self.cfg, self.trainer, ctx.schedule.plugins, self.run.dist, self.models)
        ctx.simulated_encode = lambda parts, batch, on_host=False: simulate_cache_fill(self, parts, batch, on_host)
        with tracker.phase("setup", category="weights"):
            ctx.apply_setup_phases()
        ctx.simulated_encode = None
        for name, module in ctx.models.items():  # device copies were born unlabelled
            tracker.track(module, "weights", module=name)
            for p in module.parameters():
                self.owner[id(p)] = name
            tracker.attach_module_hooks(module, depth=1, prefix=name)
        self.recorder.take("setup")
        self.rank_layout = measure_rank(self.run.dist, ctx.models, self.run.fsdp_param_dtype,  # what one rank holds
                                        load, tracker.current_bytes(HOST.type),  # the host after setup (dist.py host_setup)
                                        rank0_only)  # cache-only modules: rank 0's alone
        # dist=fsdp with a MixedPrecisionPolicy: the units' weights arrive in the autocast dtype (runner/plan/dist.py)
        self.semantics.gathered = gathered_params(self.rank_layout, ctx.models)
        self.semantics.uncounted = tracker.uncounted
        self.params = list(ctx.models.trainable_parameters())
        ctx.optimizer = build_optimizer(self.cfg.optimizer, self.params, simulate=True)
        ctx.run_phase("wrap_optimizer")
        self.ema.create()  # where the loop builds it: after the optimizer, on the weights as placed
        ctx.optimizer = fuse_into_backward(ctx.optimizer, self.cfg.optimizer, self.run)
        self.fused = isinstance(ctx.optimizer, FusedBackward)
        if self.fused and self.rank_layout is not None and self.rank_layout.name == "fsdp":
            ctx.optimizer.copy_scope = tracker.uncounted  # a rank's hook copies its shard: bytes left out, ops counted
        if self.fused and self.rank_layout is not None and self.rank_layout.name == "ddp":
            # dist=ddp with fused backward builds no DDP buckets: each gradient is averaged in its hook
            # (runner/distributed/runtime.py), so a rank holds what one process holds.
            self.rank_layout = None
        if self.fused:
            # Steady state of fused backward: the state exists through forward and backward (it
            # is not added afterwards, see _assemble), and each gradient dies in its hook.
            ctx.optimizer.inner.allocate_state()
            _label_optimizer_state(tracker, ctx.optimizer, self.owner)
        trainer = self.trainer
        self.raw = (ctx.facts.encode_on_device
                    and callable(getattr(trainer, "example_raw_batch", None)) and callable(getattr(trainer, "encode", None)))
        self.cached = cached_parts(trainer, ctx) if self.raw else set()
        self.notes["batch"] = ("raw batch (pixels, captions) encoded on the device" if self.raw
                               else "encoded example batch (no encode step on the device)")
        if self.cached:
            self.notes["batch"] += f"; read from the cache: {', '.join(sorted(self.cached))}"
        ctx.run_phase("on_step_start", 0)

    def forward_backward(self, i: int) -> None:
        """One micro-batch, as runner.loop.forward_backward runs it."""
        tracker, ctx, trainer = self.tracker, self.ctx, self.trainer
        suffix = f" #{i + 1}" if self.n_micro > 1 else ""
        if i == 0:
            self.alloc_log.step_started()
        host_batch = fake_batch(example_batch(trainer, self.raw, self.micro), HOST)
        tracker.track(host_batch, "other", module="(batch)")
        with known_values():  # masks keep their values from the move to the loss (runner/plan/known_values.py)
            batch = move_batch(host_batch, DEVICE)
            tracker.track(batch, "other", module="(batch)")
            with tracker.phase("forward"), ctx.step_context(), ctx.accelerator.autocast(), \
                    lycoris_draws_skipped(ctx.models):
                if self.raw:
                    with tracker.phase("encode", category="activations"), torch.no_grad():
                        enc = encode_batch(trainer, ctx.models, batch, self.cached, self.part_shapes)
                else:
                    enc = batch
                loss = trainer.loss(ctx.models, enc)
        self.recorder.take("forward" + suffix)
        # known values also in the backward: an index by a mask the forward saved (Qwen-Image 2.1) reads it
        with tracker.phase("backward"), known_values():
            ctx.accelerator.backward(loss * (self.micro / self.batch_size))
        del loss, enc, batch, host_batch  # the loop holds them until its backward returns
        for p in self.params:
            if p.grad is not None:
                tracker.track(p.grad, "gradients", module=self.owner.get(id(p)))
                self.with_grad.add(id(p))
        self.recorder.take("backward" + suffix)
        if i == self.n_micro - 1:
            self.alloc_log.step_ended()

    def optimizer_step(self) -> None:
        tracker, ctx = self.tracker, self.ctx
        with tracker.phase("optimizer"):
            if self.run.max_grad_norm > 0:
                ctx.accelerator.clip_grad_norm_([p for p in self.params if p.grad is not None], self.run.max_grad_norm)
            elif self.precision != "fp16":  # the non-finite guard's norm (runner/loop.py; fp16's scaler checks instead)
                grad_norm(self.params)
            ctx.optimizer.step()
        _label_optimizer_state(tracker, ctx.optimizer, self.owner)
        self.recorder.take("optimizer")
        self.state_by_dev = {dev: tracker.module_bytes(dev) for dev in tracker.current}
        ctx.optimizer.zero_grad(set_to_none=True)
        self.ema.update()  # one update of the average, after the step, as the loop does
        ctx.run_phase("on_step_end", 1)
        self.host_steady = tracker.current_bytes(HOST.type)


def _label_optimizer_state(tracker: LiveBytesTracker, optimizer: Any, owner: dict[int, str]) -> None:
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict):
        return
    for p, st in state.items():
        tensors = [v for v in (st.values() if isinstance(st, dict) else []) if isinstance(v, torch.Tensor)]
        if tensors:
            tracker.track(tensors, "optimizer_state", module=owner.get(id(p)))


def _run_description(sim: _Simulation) -> dict[str, Any]:
    """What was planned, for the plan's header and its JSON: trainer, sizes, batch, precision,
    plugins, optimizer, dtypes, modules (and the rank, for a distributed plan)."""
    c, trainer, ctx, precision = sim.cfg, sim.trainer, sim.ctx, sim.precision
    chosen: dict[str, list[str]] = {}
    for kind, name, _ in registry.selected(c):
        chosen.setdefault(kind, []).append(name)
    plugins = ", ".join(f"{k}={v[0]}" if len(v) == 1 else f"{k}=[{','.join(v)}]" for k, v in chosen.items())
    (height, width), size_note = planned_size(c.data)  # buckets / per-set resolutions: the largest size
    run = {
        "trainer": type(trainer).__name__,
        "size": str(c.model.size),
        "resolution": int(c.data.resolution),
        "planned_size": [height, width],  # (height, width) of the planned batch
        "planned_size_note": size_note,  # why, when it is not data.resolution square
        "batch_size": sim.run.batch_size,
        "micro_batch_size": sim.micro,
        "micro_batches": sim.run.grad_accum,
        "micro_batches_simulated": sim.n_micro,
        "precision": precision,
        "precision_text": f"{precision} autocast" if precision != "no" else "float32 (no autocast)",
        "plugins": plugins or "none",
        "optimizer": str(c.optimizer.get("name", "?")) + (", fused backward" if sim.fused else ""),
        "trained": ", ".join(sorted(ctx.models.trained)) if ctx.models is not None else "?",
        "model_train": sim.run.train_mode,
        "model_dtype": str(sim.run.frozen_dtype).replace("torch.", ""),
        "train_dtype": str(sim.run.train_dtype).replace("torch.", ""),
        "modules": sorted(ctx.models.modules) if ctx.models is not None else [],
    }
    describe = getattr(trainer, "describe_sample", None)  # optional: a trainer whose sample is not a square image
    if callable(describe):
        run["sample"] = str(describe())
    if sim.run.dist.active:  # the plan is one rank's (runner/plan/dist.py)
        run.update(dist=sim.run.dist.name, world_size=sim.run.dist.world_size, rank_text=sim.run.dist.describe())
    return run


def _assemble(sim: _Simulation, seconds: float) -> Plan:
    """The plan of a simulated step: the steady-state peaks on the device and the host, the
    breakdown at the device peak, what was planned, and suggestions when it does not fit."""
    cfg, ctx, target = sim.cfg, sim.ctx, sim.target
    notes = dict(sim.notes)
    notes.update({k: v for k, v in ctx.notes.items() if isinstance(v, (int, float, str, bool))})
    state = optimizer_state_by_module(sim)
    best, phases = steady_peaks(sim, state)
    empty = PhasePeak("setup", "setup", 0, {})
    dev_peak, host_peak = best.get(DEVICE.type, empty), best.get(HOST.type, empty)
    where = dev_peak.name if dev_peak.where in (dev_peak.name.split(" ")[0], "(reset)") else f"{dev_peak.name}, in {dev_peak.where}"
    plan = Plan(
        target=target,
        peak_bytes=dev_peak.peak_bytes,
        peak_phase=where,
        margin_bytes=CUDA_WORKSPACE_MARGIN_BYTES if target == "cuda" else 0,
        budget_bytes=sim.run.budget_bytes,
        by_category=by_category(dev_peak),
        by_module={m: {k: v for k, v in cats.items() if v} for m, cats in dev_peak.by_module.items()
                   if any(cats.values())},
        phases=phases,
        host_peak_bytes=host_peak.peak_bytes,
        host_peak_phase=host_peak.name,
        host_steady_bytes=sim.host_steady - sim.ema.host_excess(),  # dist=fsdp: one rank's share of a host EMA
        host_pinned_bytes=ctx.facts.pinned_host_bytes,
        host_training_bytes=max(host_in_training(sim), sim.host_steady) - sim.ema.host_excess(),
        host_ranks=host_per_node(sim.rank_layout, host_peak.peak_bytes),
        optimizer_state_bytes=rank_state_bytes(sim.rank_layout, {dev: sum(v.values()) for dev, v in state.items()}),
        run=_run_description(sim),
        notes=notes,
        seconds=seconds,
    )
    plan.cache_fill = cache_fill_report(sim, max([v for k, v in phases.items() if k != "setup"], default=0))
    if target == "cuda" and not sim.run.dist.active:  # what the caching allocator reserves (runner/plan/allocator.py)
        cap = None if plan.budget_bytes is None else plan.budget_bytes - plan.margin_bytes
        plan.reserved = plan_reserved(sim.alloc_log, cfg, cap).to_dict()
    if not plan.fits:
        plan.suggestions = suggest(plan, cfg)
    return plan
