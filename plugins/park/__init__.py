"""Park frozen modules on the host and cache what they compute (``offload=park``).

Two savings, for the frozen modules of a run (every module not in ``ModelSet.trained``: the
VAE and text encoders of the built-in trainers):

1. **Parking.** Frozen modules stay on the host; each one is copied to the device only for the
   duration of one of its calls (``forward``, and ``encode``/``decode`` where the module has
   them, which is how trainers call a diffusers VAE) and dropped from the device when the call
   returns. Device memory then holds at most one frozen module at a time (plus the trained
   denoiser), instead of all of them for the whole run. Method wrappers are used rather than
   forward pre/post hooks because ``AutoencoderKL.encode`` does not go through ``forward``, so
   hooks would never fire for the VAE. Every submodule gets a pre/post forward hook too: a trainer
   may call an inner model directly (Z-Image's Qwen3 ``.model`` and Qwen-Image's
   ``.model.language_model``, skipping the LM head), and its weights must be on the device then
   as well (calls nest, so inside the root's call the hooks only count depth). The outermost call
   also aligns devices as accelerate's hooks do (plugins/park/align.py): its tensor inputs go to the
   device, its outputs back to where the caller's inputs were, and ``module.device`` reads the device,
   so code that sends ids to ``next(encoder.parameters()).device`` (the host) works unchanged.

   Moving out is a pointer swap, not a copy: frozen weights never change, so the host tensor
   taken once at park time (pinned on CUDA with ``pin_memory``, so copies in are asynchronous)
   stays valid, and "offloading" is ``param.data = host_copy``, which drops the device copy
   without any device-to-host transfer (diffusers' group offloading does the same). Cost: one
   host-to-device copy of the module per call. On a CPU run device == host, the copy-in returns
   the host tensor itself and the swap is a no-op, but the same code runs. Parameters of a
   type other than ``nn.Parameter`` (bitsandbytes' quantized ``Params4bit``/``Int8Params``
   carry their quantization state with them) are moved with their leaf module's ``Module.to``
   instead, which does copy back on the way out.

2. **Caching** (``cache_latents``, ``cache_text``, both on by default). Before training, a
   batched pre-pass runs the trainer's ``encode_part`` over every sample of the data set and
   stores the results as safetensors under ``cache_dir`` (see :mod:`runner.plugins.park.cache` for the
   layout, the keys and why they are safe to reuse across runs). The pre-pass runs in
   ``place_models``, before the runner moves the denoiser to the device, so its device peak is
   one encoder and its activations. Once every sample of a part is cached, the modules that
   compute only cached parts are **dropped from the ModelSet and freed**: the training loop
   never calls them and the device never holds them. The trainer's ``encode`` is replaced for
   the run by one that reads cached parts from disk, computes the others with the parked
   modules, and calls the trainer's ``finish_encode``, which draws the VAE posterior sample from
   each sample's seed, exactly as the uncached encode does: a cached run's losses equal an
   uncached run's (tests/plugins/park/test_park.py checks this bit for bit). When every part is cached the
   trainer's dataset is replaced too, by one that yields only sample indices, so no image is
   decoded during training.

   Several processes (``dist=ddp|fsdp``): rank 0 plans and fills the cache first while the others
   wait (accelerate's ``main_process_first``); then each other rank verifies the entries it reads
   and finds them complete. Entries are renamed into place, so even a rank on another node filling
   a node-local cache at the same time never reads half an entry. On one node the other ranks
   never call the modules this plugin drops (:meth:`Park.frees_after_cache_fill`), so
   runner/distributed/loading.py builds them there without weights; such a rank that still finds entries
   missing stops with a UserError naming ``cache_dir`` (plugins/park/loaded.py).

   Limitation: the runner builds the models (``trainer.build_models``) before any plugin
   phase, so with a full cache the encoders are still constructed on the host at start-up (on
   rank 0 only, under ``dist`` on one node) and freed here, before placement; they never reach
   the device and are never called.

What it tells the planner, the loop and the other plugins (typed fields of ``ctx.facts``):
``encode_on_device`` (False when every encode part is cached: nothing is encoded during
training), ``cached_parts``, ``encode_replaced``, ``parked`` and ``dropped`` module names; in
``claim_modules`` it claims the modules it will drop or park, so that quantization leaves dropped
modules alone by default and offload=stream refuses to stream a parked one.

A trainer with nothing to cache (no ``encode_parts``) and nothing frozen: one log line, and the
plugin steps aside. With frozen modules but no cacheable encode step, they are only parked.

Under the planner (``ctx.simulate``) no file is read or written: parts that are configured to be
cached are taken as cached, their modules are dropped and the flags are set the same way.

Trade-offs: parking costs one host-to-device copy of each frozen module per call, every step
(SDXL's encoders: about 1.6 GB in bf16 per step, ~0.1 s over PCIe 4); caching removes that and
the encoders' compute, at the price of a pre-pass and disk space (SDXL at 1024 px: ~0.6 MB per
sample in bf16, 1.2 MB in float32).
"""
from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from runner.context import Transfer
from runner.plugin import Plugin
from runner.plugins.park.cache import (
    CachePlan,
    EncoderCache,
    check_writable,
    fill_cache,
    is_image_part,
    plan_cache,
    require_fillable,
    resolve_cache_dir,
)
from runner.plugins.park.encode import CachedEncode, IndexSamples
from runner.plugins.park.loaded import require_loaded
from runner.plugins.park.module import (  # noqa: F401 (public)
    MARK,
    PARK_METHODS,
    ParkedModule,
    _bytes,
    park_in_blocks,
    park_module,
    unpark_module,
)
from runner.plugins.schemas import ParkConfig
from runner.registry import register_plugin
from runner.trainer import ModelSet

if TYPE_CHECKING:
    from runner.context import RunContext

log = logging.getLogger("runner")

# ---- caching: the twin function (what reads the cache during training: plugins/park/encode.py) ----
@dataclass
class ParkResult:
    """What :func:`park_and_cache` did, for teardown, the planner and the report."""

    parked: dict[str, ParkedModule] = field(default_factory=dict)
    cached_parts: list[str] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)  # module -> bytes freed
    encoded: int = 0  # entries encoded by the pre-pass
    cache: EncoderCache | None = None
    plan: CachePlan | None = None
    encode: CachedEncode | None = None
    all_parts_cached: bool = False  # every encode part is cached: nothing is encoded during training
    entries: dict[str, tuple[int, int]] = field(default_factory=dict)  # part -> (cached, needed) entries, when counted
    restore: list[Callable[[], None]] = field(default_factory=list)


def parts_to_cache(trainer: Any, cache_latents: bool, cache_text: bool) -> list[str]:
    """The trainer's encode parts selected by the two switches (image parts read pixels)."""
    if not callable(getattr(trainer, "encode_parts", None)):
        return []
    return [p for p, spec in trainer.encode_parts().items() if (cache_latents if is_image_part(spec) else cache_text)]


def count_entries(trainer: Any, parts: list[str], cache_dir: str | None, extra_signature: Any,
                  random_flip: bool) -> dict[str, tuple[int, int]]:
    """Part -> (entries cached and intact, entries the run reads), keyed and verified as the run
    does (:func:`plan_cache`); a cache folder that does not exist yet is read as empty."""
    from runner.data import handover_kept

    cache = EncoderCache(resolve_cache_dir(cache_dir))
    with handover_kept():  # the checked folder stays the run's: read once, not scanned again
        dataset = trainer.dataset()
    plan = plan_cache(trainer, dataset, parts, cache, extra_signature, random_flip)
    counts = {}
    for p in parts:
        needed = len(set(plan.keys[p]) | set(plan.captions.get(p, {}).values()))
        counts[p] = (needed - len(plan.missing[p]) - len(plan.missing_captions.get(p, ())), needed)
    return counts


def prepass_parts(result: ParkResult, trainer: Any, parts: list[str],
                  count_cached: Callable[[Callable[[], Any]], Any] | None, cache_dir: str | None,
                  extra_signature: Any, random_flip: bool) -> list[str]:
    """The parts the planner's pre-pass encodes: all of them (a cold cache assumed), or, in the preflight
    (``count_cached`` runs a function outside the simulation), those with entries missing, counted into
    ``result.entries``."""
    if count_cached is None:
        return parts
    result.entries = count_cached(lambda: count_entries(trainer, parts, cache_dir, extra_signature, random_flip))
    return [p for p in parts if result.entries[p][0] < result.entries[p][1]]


def only_cached_modules(trainer: Any, parts: list[str]) -> set[str]:
    """Modules that compute only the cached ``parts`` (no other encode part needs them)."""
    specs = trainer.encode_parts()
    needed_later = {m for p, s in specs.items() if p not in parts for m in s.modules}
    return {m for p in parts for m in specs[p].modules} - needed_later


def droppable_modules(trainer: Any, models: ModelSet, parts: list[str]) -> list[str]:
    """Frozen modules that compute only cached parts: freed once the cache is complete."""
    droppable = sorted(only_cached_modules(trainer, parts) - models.trained)
    return [m for m in droppable if m in models]


def _drop_modules(models: ModelSet, names: list[str], result: ParkResult) -> None:
    for name in names:
        module = models.modules.pop(name)
        parked = result.parked.pop(name, None)
        if parked is not None:
            parked.remove()
        result.dropped[name] = _bytes(t for t in [*module.parameters(), *module.buffers()] if t.device.type != "meta")
        models.blocks.pop(name, None)
        del module, parked
    gc.collect()  # free the weights now, not at the next collection


def park_and_cache(
    trainer: Any,
    models: ModelSet,
    device: torch.device | str,
    *,
    host: torch.device | str = "cpu",
    cache_dir: str | None = None,
    cache_latents: bool = True,
    cache_text: bool = True,
    encode_batch_size: int = 1,
    pin_memory: bool = True,
    extra_signature: dict[str, Any] | Callable[[str], dict[str, Any]] | None = None,
    autocast: Callable[[], Any] | None = None,
    simulate: bool = False,
    cache_setting: str = "offload.park.cache_dir",
    random_flip: bool = False,
    simulated_fill: Callable[[list[str], int, bool], None] | None = None,
    count_cached: Callable[[Callable[[], Any]], Any] | None = None,
    fill: str = "device",
    host_autocast: Callable[[], Any] | None = None,
) -> ParkResult:
    """Park every frozen module of ``models``; fill and use the encoder cache for ``trainer``.

    ``trainer`` may be None (hosted mode): then only parking happens. The trainer's ``encode``
    (and, when every part is cached, its ``dataset``) are replaced by instance attributes;
    ``ParkResult.restore`` undoes that. The cache folder is written only when entries are missing
    or fail verification (then it must be writable, else a UserError naming ``cache_setting``).
    ``random_flip`` (``data.random_flip``): image parts are cached in both orientations and each
    batch reads the one its ``flip`` asks for (runner/data/flip.py). ``count_cached``: see :func:`prepass_parts`.
    ``fill`` (``offload.park.fill``): the pre-pass's encoders parked (``device``), block by block (``stream``)
    or on ``host`` under ``host_autocast`` (``host``), see :func:`_park_for_fill`.
    """
    result = ParkResult()

    def park_frozen() -> None:  # idempotent: park_module returns an existing ParkedModule
        for name, module in models.frozen().items():
            result.parked[name] = park_module(module, device, host, pin_memory)

    parts = parts_to_cache(trainer, cache_latents, cache_text) if trainer is not None else []
    if not parts:
        park_frozen()
        return result
    specs = trainer.encode_parts()
    droppable = droppable_modules(trainer, models, parts)
    result.all_parts_cached = set(parts) == set(specs)
    result.cached_parts = list(parts)
    if simulate:
        todo = prepass_parts(result, trainer, parts, count_cached, cache_dir, extra_signature, random_flip)
        if simulated_fill is not None and todo:  # the pre-pass: encoders parked as below, or on the host
            streamed = _park_for_fill(fill, models, park_frozen, device, host, pin_memory)
            simulated_fill(todo, encode_batch_size, fill == "host")
            _unpark(streamed)
        _drop_modules(models, droppable, result)
        park_frozen()
        return result

    result.cache = cache = EncoderCache(resolve_cache_dir(cache_dir))
    dataset = trainer.dataset()
    plan = plan_cache(trainer, dataset, parts, cache, extra_signature, random_flip)  # verifies every entry it will read
    result.plan = plan
    hits = {p: len(set(plan.keys[p])) - len(plan.missing[p]) for p in parts}
    log.info("park: encoder cache %s: %s", cache.root,
             ", ".join(f"{p} {hits[p]}/{len(set(plan.keys[p]))} entries cached" for p in parts))
    require_fillable(cache, plan, cache_setting)  # before any encoding: a read-only cache with holes stops here
    if plan.bad:
        log.warning("park: encoder cache: %s; re-encoding %s", plan.describe_bad(),
                    "it" if len(plan.bad) == 1 else "them")
    if plan.missing_count():
        require_loaded(models, specs, plan, cache.root, cache_setting)  # a rank built without the encoders
        streamed = _park_for_fill(fill, models, park_frozen, device, host, pin_memory)
        with cache.filling() as waited:  # another run filling the same cache: wait, then encode what it did not
            if waited:
                plan = result.plan = plan_cache(trainer, dataset, parts, cache, extra_signature, random_flip)
            result.encoded = fill_cache(trainer, models, dataset, plan, cache, encode_batch_size,
                                        *((host, host_autocast) if fill == "host" else (device, autocast)))
        _unpark(streamed)
    # A complete cache: the modules that only compute cached parts are freed before they are ever parked.
    _drop_modules(models, droppable, result)
    park_frozen()

    _read_from_cache(trainer, dataset, cache, plan, parts, result)
    return result


def _park_for_fill(fill: str, models: ModelSet, park_frozen: Callable[[], None], device: torch.device | str,
                   host: torch.device | str, pin_memory: bool) -> list[ParkedModule]:
    """The encoders placed for the pre-pass: parked (device: one on the device per call), each one's blocks
    parked apart (stream: those returned, undone after it by :func:`_unpark`), or left on the host (host)."""
    if fill == "device":
        park_frozen()  # the pre-pass runs the encoders parked: one on the device at a time
    if fill != "stream":
        return []
    return [p for m in models.frozen().values() for p in park_in_blocks(m, device, host, pin_memory)]


def _unpark(streamed: list[ParkedModule]) -> None:
    """Undo :func:`_park_for_fill`'s block parking (weights stay on the host; the module is parked whole after)."""
    for parked in streamed:
        parked.remove()


def _read_from_cache(trainer: Any, dataset: Any, cache: EncoderCache, plan: CachePlan, parts: list[str],
                     result: ParkResult) -> None:
    """The trainer's ``encode`` replaced by cache reads (and, with every part cached, its dataset by sample
    indices), each undone by ``result.restore``."""
    encode = CachedEncode(trainer, cache, {p: plan.keys[p] for p in parts}, plan.captions, plan.samples)
    result.encode = encode
    had_encode = trainer.__dict__.get("encode")
    trainer.encode = encode
    result.restore.append(lambda: _restore_attr(trainer, "encode", had_encode))
    if result.all_parts_cached:
        light = IndexSamples(dataset)
        had_dataset = trainer.__dict__.get("dataset")
        trainer.dataset = lambda: light
        result.restore.append(lambda: _restore_attr(trainer, "dataset", had_dataset))


def _restore_attr(obj: Any, name: str, previous: Any) -> None:
    if previous is None:
        obj.__dict__.pop(name, None)
    else:
        setattr(obj, name, previous)


# ---- the plugin ----------------------------------------------------------------------------------
def cacheable(trainer: Any) -> bool:
    """Whether ``trainer`` splits its encode step into cacheable parts (runner/trainer.py)."""
    return trainer is not None and all(
        callable(getattr(trainer, m, None)) for m in ("encode_parts", "encode_part", "finish_encode", "cache_signature"))


@register_plugin
class Park(Plugin):
    kind = "offload"
    name = "park"
    conflicts = {("park", "park"): "one parking per module"}
    fit_knob = "park"
    plan_saving = "frozen_weights"

    @classmethod
    def fit_applies(cls, trainer: Any) -> bool:
        return cacheable(trainer)  # the search switches park on only where it caches an encode step
    Config = ParkConfig

    def _parts(self, ctx: RunContext) -> list[str]:
        c = self.config
        if not cacheable(ctx.trainer):
            return []
        return parts_to_cache(ctx.trainer, c.cache_latents, c.cache_text)

    def frees_after_cache_fill(self, trainer: Any) -> frozenset[str]:
        """The modules ``place_models`` drops once the cache is complete (:func:`droppable_modules`,
        before the trained ones are known: the caller leaves those out)."""
        c = self.config
        parts = parts_to_cache(trainer, c.cache_latents, c.cache_text) if cacheable(trainer) else []
        return frozenset(only_cached_modules(trainer, parts)) if parts else frozenset()

    def claim_modules(self, ctx: RunContext) -> None:
        parts = self._parts(ctx)
        folder = resolve_cache_dir(self.config.cache_dir)
        if parts and not folder.is_dir():
            # Nothing is cached yet, so everything will be written: refuse an unwritable place in the
            # preflight plan already, before anything real is built. An existing folder is checked
            # only once its entries are verified (place_models): a complete cache may be read-only.
            check_writable(folder, self.setting("cache_dir"))
        dropped = droppable_modules(ctx.trainer, ctx.models, parts) if parts else []
        for name in dropped:
            ctx.claim(name, "drop", self.key)
        for name in ctx.models.frozen():
            if name not in dropped:
                ctx.claim(name, "park", self.key)
        if not parts and not ctx.models.frozen():
            log.info("park: nothing to do: the trainer has no frozen module to park and no cacheable encode step "
                     "(encode_parts, see runner/trainer.py)")
        elif not parts and (self.config.cache_latents or self.config.cache_text) and ctx.trainer is not None:
            log.info("park: %s has no cacheable encode step (encode_parts); frozen modules are parked, nothing is cached",
                     type(ctx.trainer).__name__)

    @staticmethod
    def _signature(ctx: RunContext) -> Callable[[str], dict[str, Any]]:
        """Each part's entries are keyed by the plugin settings that change what *its* modules
        compute: a text embedding by the text encoders' quantization, not by the VAE's tiling."""
        specs = ctx.trainer.encode_parts() if callable(getattr(ctx.trainer, "encode_parts", None)) else {}
        return lambda part: ctx.encoder_signature(specs[part].modules if part in specs else None)

    def place_models(self, ctx: RunContext) -> None:
        c, models, run = self.config, ctx.models, self.run
        parts = self._parts(ctx)
        ctx.facts.placed.update(models.frozen())  # the runner must not move them: they stay on the host
        batch = int(c.encode_batch_size) if c.encode_batch_size else run.micro_batch
        autocast = ctx.accelerator.autocast if ctx.accelerator is not None else None
        # Several processes: rank 0 fills the cache, the others wait, then verify and read the complete entries.
        with ctx.dist.main_process_first():
            result = park_and_cache(
                ctx.trainer if parts else None, models, ctx.device, host=ctx.host, cache_dir=c.cache_dir,
                cache_latents=c.cache_latents, cache_text=c.cache_text, encode_batch_size=batch,
                pin_memory=c.pin_memory, extra_signature=self._signature(ctx), autocast=autocast,
                simulate=ctx.simulate, cache_setting=self.setting("cache_dir"), random_flip=ctx.flip.enabled,
                simulated_fill=ctx.simulated_encode, count_cached=ctx.simulated_read, **self._host_fill(),
            )
        if self.config.fill == "host" and parts and ctx.simulate:
            ctx.notes["cache fill on the host"] = "offload.park.fill=host: the pre-pass holds no device bytes"
        if self.config.fill == "stream" and parts and ctx.simulate:
            ctx.notes["cache fill streamed"] = "offload.park.fill=stream: one encoder block on the device at a time"
        self.result = result
        for name, parked in result.parked.items():
            ctx.hooks.add(models[name], MARK, self.key, handle=parked, undo=parked.remove)
        has_encode = ctx.trainer is not None and callable(getattr(ctx.trainer, "encode", None))
        facts = ctx.facts
        facts.encode_on_device = facts.encode_on_device and has_encode and not result.all_parts_cached
        facts.cached_parts |= set(result.cached_parts)
        facts.encode_replaced = facts.encode_replaced or result.encode is not None
        facts.parked |= set(result.parked)
        facts.dropped |= set(result.dropped)
        facts.cache_entries.update(result.entries)
        if result.parked:
            where = ("the device is the host on this run, so nothing moves" if ctx.device == ctx.host
                     else f"moved to {ctx.device} only for their calls")
            log.info("park: %s kept on %s, %s (%.1f MiB)", ", ".join(sorted(result.parked)), ctx.host, where,
                     sum(p.nbytes for p in result.parked.values()) / 2**20)
            ctx.notes["parked weight bytes"] = sum(p.nbytes for p in result.parked.values())
        if result.dropped:
            log.info("park: dropped %s: every output they compute is cached (%.1f MiB of weights freed)",
                     ", ".join(sorted(result.dropped)), sum(result.dropped.values()) / 2**20)
            ctx.notes["dropped weight bytes"] = sum(result.dropped.values())
        if result.cached_parts and not ctx.simulate:
            ctx.notes["encoder cache"] = f"{result.cache.root} ({result.encoded} entries encoded this run)"

    def _host_fill(self) -> dict[str, Any]:
        """``fill=host``: the pre-pass on the CPU under the run's autocast dtype (none without one)."""
        dtype = self.run.autocast_dtype
        return {"fill": self.config.fill,
                "host_autocast": (lambda: torch.autocast("cpu", dtype=dtype)) if dtype is not None else None}

    def fill_cache(self, ctx: RunContext) -> int | None:
        """``mode=cache``: encode every missing entry with the encoders where ``fill`` puts them (device:
        parked, as a training run's pre-pass; host: on the CPU, under the run's autocast dtype there), keyed
        as the training run keys them (its device type and autocast), then undo everything; the entries
        encoded, or None with nothing to cache."""
        c, run = self.config, self.run
        parts = self._parts(ctx)
        if not parts:
            return None
        on_host = c.fill == "host"
        with ctx.dist.main_process_first():
            result = park_and_cache(
                ctx.trainer, ctx.models, ctx.device, host=ctx.host, cache_dir=c.cache_dir,
                cache_latents=c.cache_latents, cache_text=c.cache_text,
                encode_batch_size=int(c.encode_batch_size) if c.encode_batch_size else run.micro_batch,
                pin_memory=c.pin_memory and not on_host, extra_signature=self._signature(ctx),
                autocast=ctx.accelerator.autocast if ctx.accelerator is not None else None,
                cache_setting=self.setting("cache_dir"), random_flip=ctx.flip.enabled, **self._host_fill())
        for undo in reversed(result.restore):
            undo()
        for parked in result.parked.values():
            parked.remove()
        log.info("park: encoder cache %s filled on the %s: %d entries encoded", result.cache.root,
                 "host" if on_host else f"device ({ctx.device}{', block by block' if c.fill == 'stream' else ''})",
                 result.encoded)
        return result.encoded

    def _loads(self) -> dict[str, int]:
        result: ParkResult | None = getattr(self, "result", None)
        return {n: p.loads for n, p in result.parked.items()} if result is not None else {}

    def on_step_start(self, ctx: RunContext, step: int) -> None:
        self._loads_before = self._loads()

    def on_step_end(self, ctx: RunContext, step: int) -> None:
        """Record this step's copies for the step-time model: parked modules moved in on the compute stream."""
        result: ParkResult | None = getattr(self, "result", None)
        if result is None or not result.parked or ctx.device == ctx.host:
            return
        before = getattr(self, "_loads_before", {})
        moved = sum((p.loads - before.get(n, 0)) * p.nbytes for n, p in result.parked.items())
        ctx.facts.transfers[self.key] = Transfer(h2d_bytes=moved)  # moving out is a pointer swap: no copy

    def teardown(self, ctx: RunContext) -> None:
        result: ParkResult | None = getattr(self, "result", None)
        if result is None:
            return
        for undo in reversed(result.restore):  # the trainer's encode/dataset; the modules via ctx.hooks
            undo()
        self.result = None
