"""RunContext: what plugins see and change during one run.

The same object serves managed mode (the runner fills it and owns the loop) and hosted mode
(a user's loop calls :meth:`RunContext.prepare`, the way ``accelerate.Accelerator.prepare``
works, and keeps its own loop; see runner/hosted.py).

What plugins know about each other goes through typed fields, never string keys:

* ``run`` -- the :class:`~runner.resolved.ResolvedRun` (device, precision, dtypes, budget), decided
  once before anything is built;
* ``facts`` -- :class:`RunFacts`, what the plugins did (parked, dropped, streamed, quantized,
  checkpointed modules; cached encode parts; pinned host bytes), which the planner, the loop and
  the other plugins read;
* ``hooks`` -- the :class:`~runner.module_changes.ModuleHooks` registry of every module change, undone
  in one place by :meth:`RunContext.teardown`, which the runner calls in a ``finally``.
"""
from __future__ import annotations

import logging
from collections.abc import Collection
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from runner.errors import UserError
from runner.module_changes import ModuleHooks
from runner.resolved import ResolvedRun
from runner.trainer import ModelSet

log = logging.getLogger("runner")

@dataclass
class Claim:
    module: str
    action: str  # "drop" | "park" | "stream" | "quantize" | "checkpoint"
    owner: str  # plugin key, e.g. "offload/park"


@dataclass
class Transfer:
    """Host<->device copies one plugin makes in one optimizer step, for the planner's step-time model.

    Recorded by the plugin (in ``on_step_end``, for the step that just ended); the planner reads it
    (runner/plan/speed.py). ``overlapped``: the copies run on a side stream ahead of use, so they
    hide behind compute while they are shorter; otherwise they add their time.
    """

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    overlapped: bool = False
    window_bytes: int = 0  # bytes loaded before compute can start (a stream's first window)
    host_step_elements: int = 0  # trained elements on the device whose optimizer step runs on the host CPU


@dataclass
class RunFacts:
    """What the plugins did, as the planner, the loop and the other plugins need to know it."""

    claims: list[Claim] = field(default_factory=list)
    placed: set[str] = field(default_factory=set)  # modules a plugin placed itself; the runner moves the rest
    parked: set[str] = field(default_factory=set)  # frozen modules kept on the host, on the device per call
    dropped: set[str] = field(default_factory=set)  # modules freed because every output they compute is cached
    cached_parts: set[str] = field(default_factory=set)  # encode parts read from a cache, not computed
    encode_replaced: bool = False  # a plugin replaced the trainer's encode step (cache reads)
    encode_on_device: bool = True  # False when nothing is encoded during training (every part cached)
    streamed: set[str] = field(default_factory=set)
    quantized: dict[str, int] = field(default_factory=dict)  # module -> quantized layers
    checkpointed: dict[str, int] = field(default_factory=dict)  # module -> checkpointed blocks
    compiled: dict[str, int] = field(default_factory=dict)  # train.compile: module -> compiled blocks
    pinned_host_bytes: int = 0  # page-locked host bytes (or that would be, on the target GPU)
    transfers: dict[str, Transfer] = field(default_factory=dict)  # plugin key -> its copies in the last step
    # An encoder cache's entries as a plugin counted them before its pre-pass: part -> (cached, needed);
    # empty when it was not read (the planner's ``mode=plan``: a cold cache is assumed).
    cache_entries: dict[str, tuple[int, int]] = field(default_factory=dict)

    def claimed(self, action: str) -> set[str]:
        return {c.module for c in self.claims if c.action == action}


class Schedule(Protocol):
    """What the context needs of runner.plugin.PluginSchedule: the plugins and, per phase, their calls in order."""

    plugins: list[Any]

    def run(self, phase: str, ctx: RunContext, *args: Any) -> None: ...


@dataclass
class RunContext:
    run: ResolvedRun
    schedule: Schedule
    cfg: Any = None  # the composed config: for the loop and the trainer; plugins read only their own node
    output_dir: Path | None = None
    overrides: list[str] | None = None  # the command line that composed cfg (saved with checkpoints); None: unknown
    models: ModelSet | None = None
    trainer: Any = None
    optimizer: torch.optim.Optimizer | None = None
    accelerator: Any = None
    facts: RunFacts = field(default_factory=RunFacts)
    hooks: ModuleHooks = field(default_factory=ModuleHooks)
    # Context managers plugins want entered around every forward+backward (e.g. saved-tensor hooks).
    step_contexts: list[Callable[[], Any]] = field(default_factory=list)
    # Lines for the run report and plan.json ("optimizer state bytes": 1234): shown, never read back.
    notes: dict[str, Any] = field(default_factory=dict)
    # The same plugins built for the simulated run, which the preflight plans (runner/session.py:open_run).
    plan_schedule: Schedule | None = None
    # The features' objects, each a no-op unless its settings switch it on. The session injects them
    # (runner/parts.py:make_context, or ``**idle_parts(run)`` for a context built by hand), so this
    # module imports no feature.
    sampler: Any = field(kw_only=True)  # sample.every: runner.sampling.build_sampler
    # The run's experiment tracker, runner.output.trackers.Tracking: ``ctx.tracking.log_images(step, {name: image})``.
    tracking: Any = field(kw_only=True)
    # data.random_flip, per visit (runner.data.flip.VisitFlip): the loop applies it, the encoder cache keys both.
    flip: Any = field(kw_only=True)
    ema: Any = field(kw_only=True)  # ema.enabled: runner.ema.average.EMA (after a resume), else NoEMA
    validation: Any = field(kw_only=True)  # val.*: runner.val.holdout.build_validation
    # dist=ddp|fsdp across processes (runner.distributed.runtime.Distribution); a no-op one for one process.
    dist: Any = field(kw_only=True)
    # train.compile (runner.compile.regional.RegionalCompile); NoCompile in the planner, which plans the eager step.
    compiler: Any = field(kw_only=True)
    # train.device=cuda_sim: the simulated card (runner/memory/cuda_sim.py), entered with the plugins'
    # placement and left at teardown; a no-op object on a real device.
    card: Any = field(kw_only=True)
    # Inside the planner: runs one batch of each named encode part with the encoders as a plugin left
    # them (``(parts, batch_size, on_host)``; ``on_host``: the encoders and the batch stay on the host), so a
    # plugin's encoding pre-pass in setup (park's cache fill) is planned, bytes and time; None in a real run.
    simulated_encode: Callable[[list[str], int, bool], None] | None = None
    # Inside the planner's preflight: runs a function outside the simulation (real tensors), for a plugin
    # that reads its cache folder to plan only the pre-pass this run does; None for ``mode=plan``, which
    # reads no data and assumes a cold cache.
    simulated_read: Callable[[Callable[[], Any]], Any] | None = None
    _torn_down: bool = False

    # The resolved run's devices, under the names plugins have always used.
    @property
    def device(self) -> torch.device:
        return self.run.device

    @property
    def host(self) -> torch.device:
        return self.run.host

    @property
    def simulate(self) -> bool:
        return self.run.simulate

    def run_phase(self, phase: str, *args: Any) -> None:
        self.schedule.run(phase, self, *args)

    # ---- typed facts ---------------------------------------------------------------------------
    def claim(self, module: str, action: str, owner: str) -> None:
        """Record that plugin ``owner`` will do ``action`` to ``module``; refuse a pair that either plugin
        declares a conflict (:attr:`Plugin.conflicts`)."""
        plugins = {p.key: p for p in self.schedule.plugins}
        for other in self.facts.claims:
            if other.module != module or other.owner == owner:
                continue
            mine, theirs = plugins.get(owner), plugins.get(other.owner)
            why = ((mine.conflict(action, other.action) if mine is not None else None)
                   or (theirs.conflict(other.action, action) if theirs is not None else None))
            if why is not None:
                raise UserError(
                    f"{owner.replace('/', '=')} and {other.owner.replace('/', '=')} both claim '{module}' "
                    f"({action} and {other.action}): {why}. Remove one of them, or point one elsewhere "
                    "with its .modules setting."
                )
        self.facts.claims.append(Claim(module, action, owner))

    def note_pinned_bytes(self, nbytes: int) -> None:
        """Host bytes page-locked by this run (or that would be, on the target GPU)."""
        self.facts.pinned_host_bytes += int(nbytes)

    def encoder_signature(self, modules: Collection[str] | None = None) -> dict[str, Any]:
        """Every plugin's settings that change what the frozen modules ``modules`` compute (cache
        keys; None: any module). A plugin that leaves those modules alone is not part of the key,
        so switching a preset's quantization of the denoiser does not re-encode every caption."""
        planned = self.run.run_device_type or self.run.target  # the planner: the type the run will have
        sig: dict[str, Any] = {"device_type": planned if self.simulate else self.device.type,
                               "autocast": self.run.precision}
        for p in self.schedule.plugins:
            s = p.encoder_signature(None if modules is None else frozenset(modules))
            if s:
                sig[p.key] = s
        return sig

    # ---- setup --------------------------------------------------------------------------------
    def apply_model_transforms(self) -> None:
        """The setup phases before placement: claims, ``transform_models`` (quantization), the rest of the
        weights read; what ``mode=cache`` runs before a plugin fills its cache (the keys name the transforms)."""
        if not self.card.active:
            self.card.__enter__()  # cuda_sim: every storage from here on is placed on the card or the host
        self.run_phase("claim_modules")
        self.run_phase("transform_models")
        self._read_unread()

    def apply_setup_phases(self) -> None:
        """Claims, then the model phases on ``self.models``; modules no plugin (nor the trainer's optional
        ``place_models(ctx)``) placed go to the device."""
        self.apply_model_transforms()
        self.run_phase("place_models")
        place = getattr(self.trainer, "place_models", None)  # a trainer that keeps a trained module on the host
        if callable(place):  # (Wan 2.2 A14B's parked expert, runner/families/wan/experts.py) adds it to facts.placed
            place(self)
        self.dist.defer_placement(self)  # dist=fsdp: the trained module reaches the device unit by unit, sharded
        for name, m in self.models.items():
            if name not in self.facts.placed:
                m.to(self.device)
        self.compiler.apply(self)  # before wrap_execution: checkpointing then recomputes the compiled forward
        self.run_phase("wrap_execution")

    def _read_unread(self) -> None:
        """What of a module built on meta (``ModelSet.unread``) no plugin read as it replaced its layers
        (runner/meta_weights.py): read now, before anything is placed."""
        from runner.meta_weights import read_unread

        for name in read_unread(self.models):
            log.info("%s: its remaining weights (not quantized) read from its files", name)

    def step_context(self) -> ExitStack:
        """Enter every plugin's per-step context (a no-op stack when none asked for one)."""
        stack = ExitStack()
        for make in self.step_contexts:
            stack.enter_context(make())
        return stack

    def teardown(self) -> None:
        """Every plugin's teardown phase, then every recorded module change undone. Idempotent."""
        if self._torn_down:
            return
        self._torn_down = True
        try:
            self.run_phase("teardown")
        finally:
            try:
                self.hooks.remove_all()
            finally:
                if self.card.active:
                    self.card.__exit__(None, None, None)
