"""The command line's composition and checks: every job of a sweep composed and checked before any runs.

The entry point composes once itself (cheap: ~0.1 s) with :func:`runner.compose.compose_config`
(friendly composition errors), and only then hands over to ``hydra.main`` for the real run,
``--help``, ``--cfg`` and ``-m``. The checks of a composed config live in runner/checks.py;
:func:`precheck` runs them on every job of a sweep.
"""
from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep
from hydra.errors import OverrideParseException
from omegaconf import DictConfig

from runner.compose import _unparsable, compose_config  # noqa: F401  (compose_config: its public path here too)
from runner.checks import check_config, check_run, typed_overrides

MAX_SWEEP_CHECKS = 64


def expand_sweeps(overrides: Sequence[str]) -> list[list[str]]:
    """Every combination a ``-m`` sweep would run (capped), as plain override lists."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    choices = []
    for o in parsed:
        key = o.get_key_element()
        if o.is_sweep_override() and isinstance(o.value(), IntervalSweep):  # an Optuna range: both ends are checked
            ends = (o.value().start, o.value().end)
            choices.append([f"{key}={int(v) if float(v).is_integer() else v}" for v in ends])
        elif o.is_sweep_override():
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    return [list(c) for c in itertools.islice(itertools.product(*choices), MAX_SWEEP_CHECKS)]


def hydra_args() -> tuple[Any, list[str]]:
    """The command line as Hydra will read it (overrides, -m, --help ...), parsed ahead of Hydra so
    that bad overrides get a friendly message first. Hydra's own parser: one compat point."""
    from hydra._internal.utils import get_args_parser  # Hydra has no public parser

    return get_args_parser().parse_known_args(sys.argv[1:])


def precheck(overrides: Sequence[str], multirun: bool, run_checks: bool = True) -> list[DictConfig]:
    """Compose (each sweep combination when ``multirun``) and validate; raise UserError.

    Every combination passes :func:`check_config` (no torch) before the first :func:`check_run`
    (torch), so a config error in any job of a sweep answers at once. ``run_checks=False`` stops
    after the first stage (``mode=plugins``). Returns the composed configs."""
    try:
        combos = expand_sweeps(overrides) if multirun else [list(overrides)]
    except OverrideParseException as e:
        raise _unparsable(e, overrides) from None
    configs = [compose_config(combo) for combo in combos]
    for cfg in configs:
        check_config(cfg)
    if run_checks:
        for cfg, combo in zip(configs, combos):
            with typed_overrides(combo):  # what the user typed, before Hydra records it (a preset's budget yields)
                check_run(cfg)
    return configs
