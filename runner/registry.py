"""Registry of plugins (by kind and name) and trainers (by name).

Built-in plugins live in the ``plugins`` package and register themselves with
:func:`register_plugin` when imported. Other packages add plugins through the entry-point group
``runner.plugins`` and trainers through ``runner.trainers``; each entry point names a Plugin
subclass (or a trainer class) or a module that registers on import.

Every registered config dataclass is also stored in Hydra's ConfigStore as option ``name`` of
group ``kind``, placed at ``<kind>.<name>``: ``offload=[park,activations]`` (or ``+offload=activations``
on top of a preset's choice) selects two plugins of one kind, each with its own schema-checked
node (``offload.park.cache_latents=false``). ``offload=none`` (or ``offload=[]``) selects none.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import MISSING, dataclass, fields
from importlib.metadata import entry_points
from typing import Any

from hydra.core.config_store import ConfigStore

from runner.errors import UserError, valid_list
from runner.plugin import KINDS, Plugin

log = logging.getLogger("runner")

PLUGIN_GROUP = "runner.plugins"
TRAINER_GROUP = "runner.trainers"

_PLUGINS: dict[tuple[str, str], type[Plugin]] = {}


@dataclass
class TrainerEntry:
    name: str
    target: str
    config: type
    description: str


_TRAINERS: dict[str, TrainerEntry] = {}
_LOADED = False


def register_plugin(cls: type[Plugin]) -> type[Plugin]:
    """Class decorator: register ``cls`` under (cls.kind, cls.name) and store its schema."""
    if cls.kind not in KINDS:
        raise ValueError(f"Plugin {cls.__name__} has kind '{cls.kind}'; valid kinds: {', '.join(KINDS)}")
    key = (cls.kind, cls.name)
    if key in _PLUGINS and _PLUGINS[key] is not cls:
        raise ValueError(f"Plugin {cls.kind}/{cls.name} is registered twice ({_PLUGINS[key].__name__}, {cls.__name__})")
    _PLUGINS[key] = cls
    ConfigStore.instance().store(group=cls.kind, name=cls.name, node=cls.Config(name=cls.name),
                                 package=f"{cls.kind}.{cls.name}")
    return cls


def store_empty_options() -> None:
    """``<kind>=none``: no plugin of that kind (the same as ``<kind>=[]``)."""
    cs = ConfigStore.instance()
    for kind in KINDS:
        cs.store(group=kind, name="none", node={}, package=kind)


def register_trainer(name: str, target: str, config: type, description: str = "") -> None:
    """Register a trainer option ``trainer=<name>``; ``config`` must have a ``_target_`` field."""
    _TRAINERS[name] = TrainerEntry(name, target, config, description)
    ConfigStore.instance().store(group="trainer", name=name, node=config(_target_=target))


def load_all() -> None:
    """Import built-in plugins and trainers, then every entry point. Idempotent."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from runner.config import store_schemas

    store_schemas()
    store_empty_options()
    importlib.import_module("runner.plugins")
    importlib.import_module("runner.trainers")
    for group in (PLUGIN_GROUP, TRAINER_GROUP):
        for ep in entry_points(group=group):
            try:
                obj = ep.load()
            except Exception as e:  # a broken third-party package must not hide the others
                log.warning("entry point %s (%s) failed to load: %s", ep.name, ep.value, e)
                continue
            if isinstance(obj, type) and issubclass(obj, Plugin) and (obj.kind, obj.name) not in _PLUGINS:
                register_plugin(obj)
            elif group == TRAINER_GROUP and isinstance(obj, type) and ep.name not in _TRAINERS:
                from runner.config import CustomTrainerConfig

                cfg_cls = getattr(obj, "Config", CustomTrainerConfig)
                register_trainer(ep.name, f"{obj.__module__}.{obj.__qualname__}", cfg_cls, (obj.__doc__ or "").strip())


def plugin_names(kind: str) -> list[str]:
    return sorted(n for k, n in _PLUGINS if k == kind)


def get_plugin(kind: str, name: str) -> type[Plugin]:
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


def trainers() -> dict[str, TrainerEntry]:
    return dict(_TRAINERS)


def all_plugins() -> dict[tuple[str, str], type[Plugin]]:
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


def format_plugin_list() -> str:
    """The text of ``python -m runner mode=plugins``."""
    lines = ["Plugins (select with <kind>=<name> or <kind>=[<name>,<name>], add one to a preset's with",
             "+<kind>=<name>, set parameters with <kind>.<name>.<param>=<value>):", ""]
    current = None
    for (kind, name), cls in all_plugins().items():
        if kind != current:
            lines.append(f"{kind}:")
            current = kind
        lines.append(f"  {name:<12} {cls.description}")
        for fname, ftype, default in describe_config(cls.Config):
            lines.append(f"      {kind}.{name}.{fname}: {ftype} = {default!r}")
    from runner.dist import describe_options

    lines += ["", *describe_options()]
    lines += ["", "Trainers (select with trainer=<name>, or trainer._target_=module.Class):"]
    for name, entry in sorted(_TRAINERS.items()):
        lines.append(f"  {name:<12} {entry.description}")
        for fname, ftype, default in describe_config(entry.config):
            lines.append(f"      trainer.{fname}: {ftype} = {default!r}")
    return "\n".join(lines)
