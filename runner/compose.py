"""Composing the run config with messages a user can act on (the composer alone, below the checks).

Hydra already rejects a misspelled key or a wrong type when it composes against the structured
schemas, but its message has no suggestion and comes from deep inside Hydra. :func:`compose_config`
turns any composition error into a :class:`UserError` that names the key and the closest valid
one. The planner, ``mode=fit`` and resume compose configs of their own here; the command line's
checks of every job are runner/cli/compose.py's.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from runner import registry
from runner.config import load_all
from runner.errors import UserError, closest, did_you_mean, valid_list
from runner.files import conf_dir
from runner.plugin import KINDS

# Keys that moved when an option became shared: old spelling -> its place now.
MOVED_KEYS = {"trainer.timestep_sampling": "loss.timestep_sampling"}  # Flux's, since the loss-family bases


def compose_config(overrides: Sequence[str] = (), return_hydra_config: bool = False) -> DictConfig:
    """Compose the run config like ``python -m runner`` would, raising UserError on bad input
    (with Hydra's own node under ``hydra`` when ``return_hydra_config``: for ``--help``)."""
    load_all()
    _check_kind_overrides(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            try:
                return compose(config_name="config", overrides=list(overrides), return_hydra_config=return_hydra_config)
            except (ConfigCompositionException, MissingConfigException, OverrideParseException, OmegaConfBaseException,
                    yaml.YAMLError) as e:
                raise _friendly(e, overrides) from None
    finally:
        GlobalHydra.instance().clear()


def _check_kind_overrides(overrides: Sequence[str]) -> None:
    """``offload=[park,stream] +offload=activations``: Hydra applies the list after the addition and
    silently drops it, so refuse the pair and say how to write it."""
    for kind in KINDS:
        chosen = [o for o in overrides if o.split("=", 1)[0] == kind]
        added = [o for o in overrides if o.split("=", 1)[0] == f"+{kind}"]
        if chosen and added:
            names = [n.strip() for o in chosen for n in o.split("=", 1)[1].strip("[]").split(",") if n.strip()]
            names += [o.split("=", 1)[1] for o in added]
            raise UserError(
                f"{' '.join(chosen + added)}: '+{kind}=' adds to the choice of a preset or of the defaults, but "
                f"'{kind}=' on the same command line replaces it. List them all in one: {kind}=[{','.join(names)}]."
            )


def _group_keys(overrides: Sequence[str], path: str, bad_key: str = "") -> list[str]:
    """Valid child keys at ``path`` given the group choices among ``overrides`` (less the bad one).

    Called while compose_config's Hydra context is still initialised.
    """
    choices = [o for o in overrides if "=" in o and "." not in o.split("=", 1)[0]
               and o.split("=", 1)[0].lstrip("+~") != bad_key]
    try:
        cfg = compose(config_name="config", overrides=choices)
    except Exception:
        return []
    node = OmegaConf.select(cfg, path) if path else cfg
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def _choices(overrides: Sequence[str]) -> DictConfig:
    """The group choices among ``overrides`` (``quantization=none``) as a config, for messages."""
    picked = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in overrides
              if "=" in o and "." not in o.split("=", 1)[0] and not o.startswith(("+", "~"))}
    return OmegaConf.create(picked)


def _yaml_error(err: yaml.YAMLError) -> UserError:
    """``file:line:col: problem`` for a config file (a preset) that is not valid YAML."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = ", ".join(str(x) for x in (getattr(err, "context", None), getattr(err, "problem", None)) if x) or str(err)
    where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else "a config file"
    return UserError(f"{where}: {problem}. The file is not valid YAML; fix that line (a preset is a YAML mapping "
                     "of keys to values, starting with '# @package _global_').")


def _unparsable(err: OverrideParseException, overrides: Sequence[str]) -> UserError:
    """Name the override the grammar refused (Hydra's message does not)."""
    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_overrides([o])
        except OverrideParseException:
            return UserError(f"Could not parse the override {o!r}: {str(err).splitlines()[0]}. Quote values with "
                             "brackets, commas or spaces: key='[a,b]' (https://hydra.cc/docs/advanced/override_grammar/basic).")
    return UserError(f"Could not parse the command-line overrides: {str(err).splitlines()[0]}.")


def _plugin_key_error(full_key: str, kind: str, option: str) -> UserError:
    """An unknown ``<kind>.<option>`` key: an unselected plugin's settings, an old single-plugin
    spelling, a misspelt setting, or a misspelt plugin name, each with what would be valid."""
    if option in registry.plugin_names(kind):
        return UserError(
            f"{full_key} configures {kind}={option}, which is not selected. Select it with {kind}={option}, "
            f"add it to a preset's choice with +{kind}={option}, or list several: {kind}=[{option},...]."
        )
    # every setting of this kind's plugins, by its full key: an exact name under the wrong level is an
    # old single-plugin spelling (checkpoint.every_n -> checkpoint.blocks.every_n), a close one a typo
    settings = {f"{kind}.{n}.{f}": f for (k, n), entry in registry.plugin_entries().items() if k == kind
                for f, _, _ in registry.describe_config(entry.config)}
    owners = [key for key, f in settings.items() if f == option]
    if owners:
        return UserError(
            f"Unknown config key '{full_key}': a plugin's settings live under its name. Did you mean "
            + " or ".join(owners) + "?"
        )
    near = closest(option, set(settings.values()), n=1)
    if near and not closest(option, registry.plugin_names(kind), n=1):  # a misspelt setting, not a plugin
        keys = [k for k, f in settings.items() if f == near[0]]
        return UserError(
            f"Unknown config key '{full_key}': '{option}' is neither {'an' if kind[0] in 'aeiou' else 'a'} "
            f"{kind} plugin nor a setting of one. Did you mean {' or '.join(keys)}? (A plugin's settings live "
            f"under its name; the {kind} plugins are {', '.join(registry.plugin_names(kind))}.)")
    return UserError(
        f"Unknown config key '{full_key}': '{option}' is not {'an' if kind[0] in 'aeiou' else 'a'} {kind} plugin. "
        f"Valid names: {valid_list(option, registry.plugin_names(kind))}."
    )


def _friendly(err: Exception, overrides: Sequence[str]) -> UserError:
    if isinstance(err, yaml.YAMLError):
        return _yaml_error(err)
    if isinstance(err, OverrideParseException):
        return _unparsable(err, overrides)
    cause: Any = err
    # Hydra chains some errors implicitly (raised while handling), so follow __context__ too.
    while not isinstance(cause, OmegaConfBaseException) and (cause.__cause__ or cause.__context__) is not None:
        cause = cause.__cause__ or cause.__context__
    if isinstance(err, MissingConfigException) or isinstance(cause, MissingConfigException):
        e = err if isinstance(err, MissingConfigException) else cause
        missing = getattr(e, "missing_cfg_file", "") or ""
        group, _, option = str(missing).rpartition("/")
        options = list(getattr(e, "options", None) or [])
        if group and options:
            what = {"trainer": "trainer", "preset": "preset", "optimizer": "optimizer",
                    "dist": "distribution"}.get(group, f"{group} plugin")
            return UserError(
                f"Unknown {what} '{option}' (from '{group}={option}'). Valid names: {valid_list(option, options)}."
            )
        return UserError(f"Configuration error: {e}")
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and "'DataSetConfig'" in str(cause):
        from runner.data.checks import (
            SET_KEYS,  # a key inside one entry of data.sets=[{...}]
        )

        key = str(getattr(cause, "full_key", "") or "")
        return UserError(f"Unknown key '{key}' in an entry of data.sets.{did_you_mean(key, SET_KEYS)} "
                         f"Valid keys of a set: {', '.join(SET_KEYS)}.")
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        full_key = str(getattr(cause, "full_key", "") or "")
        kind, _, option = full_key.partition(".")
        if kind in KINDS and option and "." not in option:
            return _plugin_key_error(full_key, kind, option)
        if full_key in MOVED_KEYS:
            return UserError(f"{full_key} has moved: it is {MOVED_KEYS[full_key]} now (the same values).")
        parent, _, key = full_key.rpartition(".")
        valid = _group_keys(overrides, parent, full_key)
        hint = did_you_mean(key, valid)
        where = f"'{parent}'" if parent else "the root config"
        listing = f" Valid keys in {where}: {', '.join(sorted(valid))}." if valid else ""
        source = str(err).split(":", 1)[0] if str(err).startswith("In '") else ""
        if source and parent:  # a config file (a preset) sets a key the chosen option does not have
            choice = OmegaConf.select(_choices(overrides), parent)
            return UserError(
                f"Unknown config key '{full_key}': {source[3:].strip(chr(39))} sets it, but {parent}={choice} has no "
                f"such key.{listing} Choose a {parent} option that has it, or copy the preset into "
                "conf/preset/ without that line."
            )
        return UserError(f"Unknown config key '{full_key}'.{hint}{listing}")
    if isinstance(cause, yaml.YAMLError):
        return _yaml_error(cause)
    if isinstance(cause, ValidationError):
        full_key = str(getattr(cause, "full_key", "") or "")
        if full_key == "preset" and "DictConfig" in cause.msg:
            name = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("preset=")), "?")
            return UserError(
                f"Preset '{name}' (preset/{name}.yaml) sets no keys: the file is empty or lacks its first line "
                "'# @package _global_', which makes its keys apply to the whole config. Add that line and the keys "
                "the preset sets, as in conf/preset/sdxl_24gb.yaml.")
        msg = cause.msg.splitlines()[0].rstrip(".")  # OmegaConf appends full_key/reference_type lines
        return UserError(f"Bad value for '{full_key}': {msg}.")
    return UserError(f"Configuration error: {str(err).strip()}")
