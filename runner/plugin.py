"""Plugin base class, lifecycle phases and declared ordering.

A plugin is one file under ``plugins/`` (or in a third-party package) with:

* a dataclass config, which is also its Hydra schema (group = its kind, option = its name, stored
  at ``<kind>.<name>``: ``offload=[park,activations]`` composes two offload plugins, each with its
  own node, ``offload.park.cache_latents=false``);
* a ``Plugin`` subclass that implements only the phases it needs. It is built with its own config
  node and the :class:`~runner.resolved.ResolvedRun`, never the root config;
* a plain function that does the work without the runner (its "twin"), which the phase calls.

Phases run in this fixed order (see ``PHASES``)::

    configure_process  env vars / allocator settings, before any CUDA initialisation
    claim_modules      say which module the plugin will drop, park, stream, quantize or checkpoint
                       (``ctx.claim``); two incompatible claims on one module stop the run here
    transform_models   quantize, cast, attach adapters: on host or meta, before placement
    place_models       decide where each module lives (device, host, streamed)
    wrap_execution     checkpointing, activation offload, tiling, attention
    wrap_optimizer     8-bit, paged or host-resident optimizer state
    on_step_start / on_step_end / on_oom   step hooks
    teardown

Within one phase, plugins are ordered by their declared ``after``/``before`` constraints
(names are ``"kind"`` or ``"kind/name"``); ties are broken by the fixed ``KINDS`` order, so the
result never depends on import order. The runner logs the final order at start.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from runner.errors import UserError, valid_list

if TYPE_CHECKING:
    from runner.context import RunContext
    from runner.resolved import ResolvedRun

log = logging.getLogger("runner")

KINDS: tuple[str, ...] = ("allocator", "quantization", "offload", "checkpoint", "tiling")
"""Plugin kinds, in the order used to break ties inside a phase."""

SETUP_PHASES: tuple[str, ...] = (
    "configure_process",
    "claim_modules",
    "transform_models",
    "place_models",
    "wrap_execution",
    "wrap_optimizer",
)
STEP_HOOKS: tuple[str, ...] = ("on_step_start", "on_step_end", "on_oom")
PHASES: tuple[str, ...] = SETUP_PHASES + STEP_HOOKS + ("teardown",)


@dataclass
class PluginConfig:
    """Base schema of every plugin config. ``name`` records which implementation was chosen."""

    name: str = "none"
    # The boolean setting (a field of this schema) that serves text embeddings from a cache filled once,
    # so the captions may not change between visits (data.shuffle_tags is refused with it); "": none.
    text_cache_setting: ClassVar[str] = ""
    # The setting (``field=value`` of this schema) that runs the plugin's encoder pre-pass one block of each
    # encoder on the device at a time, which the planner suggests when a plan over budget peaks in that
    # pre-pass (runner/plan/suggest.py); "": none.
    prepass_by_block_setting: ClassVar[str] = ""


class Plugin:
    """Base class. Subclasses set ``kind``, ``name``, ``Config`` and override some phases."""

    kind: ClassVar[str] = ""
    name: ClassVar[str] = ""
    Config: ClassVar[type] = PluginConfig
    description: ClassVar[str] = ""
    after: ClassVar[tuple[str, ...]] = ()
    before: ClassVar[tuple[str, ...]] = ()
    # (this plugin's claim action, another plugin's action on the same module) -> why the two cannot
    # share that module; checked in both plugins' declarations by ``RunContext.claim``.
    conflicts: ClassVar[dict[tuple[str, str], str]] = {}
    # Plugins ("kind" or "kind/name") that must be selected with this one; a run without one stops before step 1.
    requires: ClassVar[tuple[str, ...]] = ()
    # What ``mode=fit`` may switch this plugin on or off as (a field of runner/fit/space.py:Knobs); "": not searched.
    fit_knob: ClassVar[str] = ""
    # What the planner's suggestions for a plan over budget may estimate this plugin saves when it is not
    # selected (runner/plan/suggest.py): "frozen_weights", the frozen modules' weights on the device; "": nothing.
    plan_saving: ClassVar[str] = ""

    def __init__(self, config: Any, run: ResolvedRun) -> None:
        self.config = config
        self.run = run

    @property
    def key(self) -> str:
        return f"{self.kind}/{self.name}"

    # Lifecycle (all optional). ``ctx`` is the RunContext.
    def configure_process(self, ctx: RunContext) -> None: ...
    def claim_modules(self, ctx: RunContext) -> None: ...
    def transform_models(self, ctx: RunContext) -> None: ...
    def place_models(self, ctx: RunContext) -> None: ...
    def wrap_execution(self, ctx: RunContext) -> None: ...
    def wrap_optimizer(self, ctx: RunContext) -> None: ...
    def on_step_start(self, ctx: RunContext, step: int) -> None: ...
    def on_step_end(self, ctx: RunContext, step: int) -> None: ...
    def on_oom(self, ctx: RunContext, step: int, error: BaseException) -> None: ...
    def teardown(self, ctx: RunContext) -> None: ...

    def conflict(self, action: str, other: str) -> str | None:
        """Why this plugin's ``action`` and another plugin's ``other`` may not touch one module; None: they may."""
        return self.conflicts.get((action, other))

    @classmethod
    def fit_applies(cls, trainer: Any) -> bool:
        """Whether ``mode=fit`` may switch this plugin on for ``trainer`` (asked only when :attr:`fit_knob` is set)."""
        return True

    def implements(self, phase: str) -> bool:
        return getattr(type(self), phase) is not getattr(Plugin, phase)

    def validate(self) -> None:
        """Check this plugin's settings against ``self.run``; raise UserError naming the key. What its
        settings decide alone is the registry's node check (``declare_plugin(check=...)``), which runs
        once before this (runner/checks.py:check_config, or runner/parts.py:build_plugins)."""

    def encoder_signature(self, modules: frozenset[str] | None = None) -> dict[str, Any] | None:
        """Settings of this plugin that change what the frozen ``modules`` compute (cache keys);
        None when it changes nothing of theirs. ``modules=None``: any module of the run."""
        return None

    def fill_cache(self, ctx: RunContext) -> int | None:
        """``mode=cache``: fill this plugin's encoder cache for the run ``ctx`` configures (models built, the
        claim and transform phases run) and return the entries encoded; None: this plugin caches nothing."""
        return None

    def frees_after_cache_fill(self, trainer: Any) -> frozenset[str]:
        """Frozen modules of ``trainer`` this plugin frees in its setup phases once every output they
        compute is cached (park's dropped encoders), so no step, held-out pass or plugin calls them
        afterwards; only the cache fill does. With several processes on one node rank 0 fills the
        cache and the others read it, so runner/distributed/loading.py does not load these modules on the
        others at all. Asked before the models are built (from the trainer and this plugin's settings
        only); a wrong answer would leave a rank without a module it calls: answer only for modules
        this plugin itself frees. Default: none."""
        return frozenset()

    def setting(self, field: str) -> str:
        """The command-line spelling of one of this plugin's keys, for messages."""
        return f"{self.kind}.{self.name}.{field}"

    def known_modules(self, models: Any, names: list[str]) -> list[str]:
        """``names`` (this plugin's ``modules`` setting), each checked to be a module the trainer
        builds; a UserError names the key and the valid module names otherwise. A name ending in
        ``?`` is optional: ``text_encoder?`` is taken when the trainer builds a ``text_encoder`` and
        skipped, said in the log, when it does not (a preset that composes with every trainer)."""
        optional = [n[:-1] for n in names if n.endswith("?") and n[:-1]]
        absent = [n for n in optional if n not in models]
        if absent:
            log.info("%s: %s not built by this trainer; skipped (optional, '?')", self.setting("modules"), ", ".join(absent))
        names = [n[:-1] if n.endswith("?") and n[:-1] else n for n in names]
        names = [n for n in names if n not in absent]
        unknown = [n for n in names if n not in models]
        if unknown:
            raise UserError(
                f"{self.setting('modules')} names {', '.join(map(repr, unknown))}, which the trainer does not build. "
                f"Valid names: {valid_list(unknown[0], list(models.modules))}."
            )
        return names

    def __repr__(self) -> str:
        return f"<{self.key}>"


class ClaimsModules(Plugin):
    """A plugin that works on the modules its ``modules`` setting names (the trained modules when
    it is empty) and claims each of them as :attr:`claim_as` (``checkpoint=blocks``,
    ``offload=stream``).

    One implementation so that such plugins choose, check and claim their modules alike: an unknown
    name gets the same message, and two plugins that cannot share a module are stopped in
    ``claim_modules`` before anything is built.
    """

    claim_as: ClassVar[str] = ""

    def targets(self, ctx: RunContext) -> list[str]:
        """The modules this plugin works on: its ``modules`` setting, else every trained module."""
        return self.known_modules(ctx.models, list(self.config.modules) or sorted(ctx.models.trained))

    def claim_modules(self, ctx: RunContext) -> None:
        for name in self.targets(ctx):
            ctx.claim(name, self.claim_as, self.key)

def _matches(ref: str, plugin: Plugin) -> bool:
    return ref == plugin.kind or ref == plugin.key


def order_for_phase(plugins: list[Plugin], phase: str) -> list[Plugin]:
    """Plugins implementing ``phase``, topologically sorted by their after/before declarations.

    A cycle is a configuration error (two plugins that each insist on running first).
    """
    active = [p for p in plugins if p.implements(phase)]
    rank = {p.key: (KINDS.index(p.kind) if p.kind in KINDS else len(KINDS), p.kind, p.name) for p in active}
    edges: dict[str, set[str]] = {p.key: set() for p in active}  # key -> keys that must run first
    for p in active:
        for q in active:
            if p is q:
                continue
            if any(_matches(ref, q) for ref in p.after) or any(_matches(ref, p) for ref in q.before):
                edges[p.key].add(q.key)
    ordered: list[Plugin] = []
    done: set[str] = set()
    remaining = {p.key: p for p in active}
    while remaining:
        ready = sorted((k for k in remaining if edges[k] <= done), key=rank.__getitem__)
        if not ready:
            cycle = ", ".join(sorted(remaining))
            raise UserError(f"Plugins {cycle} declare a circular order in phase '{phase}'; remove one 'after'/'before'.")
        k = ready[0]
        ordered.append(remaining.pop(k))
        done.add(k)
    return ordered


def check_requirements(plugins: list[Plugin]) -> None:
    """Every plugin's declared :attr:`Plugin.requires` is among ``plugins``; else a UserError naming both."""
    for p in plugins:
        for ref in p.requires:
            if not any(_matches(ref, q) for q in plugins if q is not p):
                wanted = ref.replace("/", "=") if "/" in ref else f"{ref}=<name>"
                raise UserError(f"{p.key.replace('/', '=')} needs {wanted} selected too (it declares requires={ref!r}). "
                                f"Add +{wanted}, or drop {p.key.replace('/', '=')}.")


@dataclass
class PluginSchedule:
    """The final per-phase order of a set of plugins, computed once and logged at start."""

    plugins: list[Plugin]
    by_phase: dict[str, list[Plugin]] = field(default_factory=dict)

    @classmethod
    def build(cls, plugins: list[Plugin]) -> PluginSchedule:
        check_requirements(plugins)
        return cls(plugins, {ph: order_for_phase(plugins, ph) for ph in PHASES})

    def describe(self) -> str:
        lines = []
        for ph in PHASES:
            if self.by_phase[ph]:
                lines.append(f"  {ph:<18} " + " -> ".join(p.key for p in self.by_phase[ph]))
        return "\n".join(lines) if lines else "  (no plugin phases)"

    def run(self, phase: str, ctx: RunContext, *args: Any) -> None:
        for p in self.by_phase[phase]:
            getattr(p, phase)(ctx, *args)
