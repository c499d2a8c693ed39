"""Registry of plugins (by kind and name) and trainers (by name).

Built-in plugins live in the ``plugins`` package and register themselves with
:func:`register_plugin` when imported. Other packages add plugins through the entry-point group
``runner.plugins`` and trainers through ``runner.trainers``; each entry point names a Plugin
subclass (or a trainer class) or a module that registers on import.

Every registered config dataclass is also stored in Hydra's ConfigStore as option ``name`` of
group ``kind``, placed at ``<kind>.<name>``: ``offload=[park,activations]`` (or ``+offload=activations``
on top of a preset's choice) selects two plugins of one kind, each with its own schema-checked
node (``offload.park.cache_latents=false``). ``offload=none`` (or ``offload=[]``) selects none.

Built-in plugins and trainers are *declared* (:func:`declare_plugin`, :func:`register_trainer`)
with their schema and the path of their class, and the class is imported only when a run builds
it (:func:`get_plugin`, the trainer's ``_target_``). That keeps torch out of ``--help``, ``--version``,
``mode=plugins`` and every config error (runner/plugins/schemas.py, runner/families/__init__.py).
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable

from hydra.core.config_store import ConfigStore

from runner.errors import UserError, valid_list
from runner.plugin import KINDS, Plugin

log = logging.getLogger("runner")

PLUGIN_GROUP = "runner.plugins"
TRAINER_GROUP = "runner.trainers"

@dataclass
class PluginEntry:
    """A plugin the registry knows: its schema and description now, its class when first needed."""

    kind: str
    name: str
    config: type
    description: str
    target: str = ""  # "module:Class"; empty for a class registered directly
    check: Callable[[Any, str], None] | None = None  # node-only checks, callable without torch
    cls: type[Plugin] | None = None

    def load(self) -> type[Plugin]:
        if self.cls is None:
            module, _, attr = self.target.partition(":")
            cls = getattr(importlib.import_module(module), attr)  # its @register_plugin fills self.cls too
            self.cls = cls
        return self.cls


_PLUGINS: dict[tuple[str, str], PluginEntry] = {}


@dataclass
class TrainerEntry:
    name: str
    target: str
    config: type
    description: str
    # data.resolution's default at model.size=full (px), by trainer.variant ("" = any); None: the runner's 1024
    native_resolution: dict[str, int] | None = None
    objective: str | None = None  # runner.loss.config.DDPM | FLOW: loss.* options are checked against it unimported


_TRAINERS: dict[str, TrainerEntry] = {}


def _store_schema(kind: str, name: str, config: type) -> None:
    ConfigStore.instance().store(group=kind, name=name, node=config(name=name), package=f"{kind}.{name}")


def declare_plugin(kind: str, name: str, config: type, target: str, description: str = "",
                   check: Callable[[Any, str], None] | None = None) -> None:
    """Make ``<kind>=<name>`` known without importing its class (``target``, "module:Class").

    The schema is stored for composition now; ``check(node, "<kind>.<name>")`` runs the settings'
    own checks in validation; the class is imported by :func:`get_plugin`."""
    if kind not in KINDS:
        raise ValueError(f"Plugin {target} has kind '{kind}'; valid kinds: {', '.join(KINDS)}")
    entry = _PLUGINS.get((kind, name))
    if entry is not None:  # its module was imported first and registered the class: keep both
        entry.target, entry.check = target, check
        entry.description = entry.description or description
        return
    _PLUGINS[(kind, name)] = PluginEntry(kind, name, config, description or getattr(config, "description", ""),
                                         target, check)
    _store_schema(kind, name, config)


def register_plugin(cls: type[Plugin]) -> type[Plugin]:
    """Class decorator: register ``cls`` under (cls.kind, cls.name) and store its schema.

    For a declared built-in this attaches the class to its entry; its description may live on its
    ``Config`` (``description`` ClassVar) instead of the class."""
    if cls.kind not in KINDS:
        raise ValueError(f"Plugin {cls.__name__} has kind '{cls.kind}'; valid kinds: {', '.join(KINDS)}")
    key = (cls.kind, cls.name)
    if not cls.__dict__.get("description"):
        cls.description = getattr(cls.Config, "description", "") or cls.description
    entry = _PLUGINS.get(key)
    if entry is not None and entry.cls is not None and entry.cls is not cls:
        raise ValueError(f"Plugin {cls.kind}/{cls.name} is registered twice ({entry.cls.__name__}, {cls.__name__})")
    if entry is not None and entry.target and entry.target != f"{cls.__module__}:{cls.__qualname__}":
        raise ValueError(f"Plugin {cls.kind}/{cls.name} is declared as {entry.target}, not {cls.__module__}:{cls.__qualname__}")
    if entry is None:
        _PLUGINS[key] = PluginEntry(cls.kind, cls.name, cls.Config, cls.description,
                                    f"{cls.__module__}:{cls.__qualname__}", cls=cls)
        _store_schema(cls.kind, cls.name, cls.Config)
    else:
        if entry.config is not cls.Config:
            raise ValueError(f"Plugin {cls.kind}/{cls.name}: its Config is not the declared schema {entry.config.__name__}")
        entry.cls = cls
    return cls


def store_empty_options() -> None:
    """``<kind>=none``: no plugin of that kind (the same as ``<kind>=[]``)."""
    cs = ConfigStore.instance()
    for kind in KINDS:
        cs.store(group=kind, name="none", node={}, package=kind)


def register_trainer(name: str, target: str, config: type, description: str = "",
                     native_resolution: dict[str, int] | None = None, objective: str | None = None) -> None:
    """Register a trainer option ``trainer=<name>``; ``config`` must have a ``_target_`` field.

    ``native_resolution``: the resolution the full-size model trains at, by ``trainer.variant``,
    when it is not the runner's 1024 px (``data.resolution``'s default; runner/config/__init__.py)."""
    _TRAINERS[name] = TrainerEntry(name, target, config, description, native_resolution, objective)
    ConfigStore.instance().store(group="trainer", name=name, node=config(_target_=target))




def plugin_names(kind: str) -> list[str]:
    return sorted(n for k, n in _PLUGINS if k == kind)


def get_plugin(kind: str, name: str) -> type[Plugin]:
    """The plugin's class (its module is imported now, the first time)."""
    return plugin_entry(kind, name).load()


def plugin_entry(kind: str, name: str) -> PluginEntry:
    """The plugin's schema, description and checks, without importing its class."""
    if kind not in KINDS:
        raise UserError(f"Unknown plugin kind '{kind}'. Valid kinds: {valid_list(kind, KINDS)}.")
    try:
        return _PLUGINS[(kind, name)]
    except KeyError:
        raise UserError(
            f"Unknown {kind} plugin '{name}' (set by '{kind}={name}'). "
            f"Valid names: {valid_list(name, plugin_names(kind))}."
        ) from None


def selected(cfg: Any) -> list[tuple[str, str, Any]]:
    """``(kind, name, config node)`` of every plugin the composed config selects, kinds in KINDS order
    and, within a kind, in the order the config lists them."""
    out = []
    for kind in KINDS:
        node = cfg.get(kind) if hasattr(cfg, "get") else None
        for name, sub in (node or {}).items():
            out.append((kind, str(name), sub))
    return out


def native_resolution(target: str, variant: str) -> int | None:
    """The registered full-size resolution of the trainer ``target`` (its ``_target_``) and
    ``variant``, or None when it registered none."""
    for entry in _TRAINERS.values():
        if entry.target == target and entry.native_resolution:
            table = entry.native_resolution
            return table.get(variant) or table.get("") or next(iter(table.values()))
    return None


def trainers() -> dict[str, TrainerEntry]:
    return dict(_TRAINERS)




def plugin_entries() -> dict[tuple[str, str], PluginEntry]:
    """Every plugin's entry, kinds in KINDS order; nothing is imported."""
    return dict(sorted(_PLUGINS.items(), key=lambda kv: (KINDS.index(kv[0][0]), kv[0][1])))


def describe_config(config_cls: type) -> list[tuple[str, str, Any]]:
    """(field, type, default) of a config dataclass, minus the bookkeeping ``name`` field."""
    out = []
    for f in fields(config_cls):
        if f.name in ("name", "_target_"):
            continue
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = "???"
        tname = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        out.append((f.name, tname, default))
    return out




