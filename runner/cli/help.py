"""``python -m runner --help``: Hydra's help text, without Hydra's slow path to it.

Hydra builds the "Configuration groups" list by asking its config loader for the options of every
group it can see, its own ``hydra/...`` groups included (about 90 here), and each question
deep-copies the whole ConfigStore: about 3 s on a loaded 2-core machine, most of ``--help``'s
time. The options of the runner's groups are known directly: the structured configs stored in
Hydra's ConfigStore (plugins, trainers, optimizers, ``none``) and the files of ``conf/<group>/``
(presets). This module lists them from there and fills Hydra's own help template
(``hydra.help``: header, footer, template) with them and with the composed config, which is what
Hydra prints; tests/runner/cli/test_cli.py checks the two texts are equal. A template that asks for
anything else (``$FLAGS_HELP``, ``$HYDRA_CONFIG_GROUPS``) is left to Hydra (:func:`format_help`
returns None).
"""
from __future__ import annotations

import string
from collections.abc import Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf, open_dict

from runner.cli.compose import compose_config
from runner.files import conf_dir


def app_config_groups() -> dict[str, list[str]]:
    """Every config group that is not Hydra's own, with its options (ConfigStore and conf/ files)."""
    groups: dict[str, set[str]] = {}
    for name, node in ConfigStore.instance().repo.items():
        if isinstance(node, dict) and name != "hydra":
            groups.setdefault(name, set()).update(k[:-len(".yaml")] for k in node if k.endswith(".yaml"))
    for folder in conf_dir().iterdir():
        if folder.is_dir() and folder.name != "hydra":
            groups.setdefault(folder.name, set()).update(p.stem for p in folder.glob("*.yaml"))
    return {g: sorted(opts) for g, opts in sorted(groups.items()) if opts}


def format_help(overrides: Sequence[str], resolve: bool = False) -> str | None:
    """The text Hydra's ``--help`` prints for ``overrides``, or None when the template needs more.

    Bad overrides raise :class:`runner.errors.UserError` (the friendly message), as a run would."""
    cfg = compose_config(overrides, return_hydra_config=True)  # friendly errors for a bad override
    template = str(cfg.hydra.help.template)  # its header and footer interpolated
    with open_dict(cfg):
        del cfg["hydra"]  # what Hydra prints is the job's config
    if {m.group("named") or m.group("braced") for m in string.Template.pattern.finditer(template)} - {
            "APP_CONFIG_GROUPS", "CONFIG", None}:
        return None
    groups = "".join(f"{g}: {', '.join(opts)}\n" for g, opts in app_config_groups().items())
    return string.Template(template).substitute(APP_CONFIG_GROUPS=groups, CONFIG=OmegaConf.to_yaml(cfg, resolve=resolve))
