"""Short folder names for a sweep's jobs: ``hydra.sweep.subdir`` is ``${runner_job_dir:...}``.

Hydra's ``override_dirname`` joins every override (``0_+preset=sdxl_24gb,optimizer.lr=0.0001,train.steps=10``);
the folder names only the job number and the swept keys' values (``0_lr=0.0001``). Each job's full overrides
stay in its ``.hydra/overrides.yaml``.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any

MAX_VALUE = 24  # characters of one value kept in a folder name


def swept_keys(argv: Sequence[str]) -> set[str] | None:
    """Keys the command line sweeps (``a=1,2``, ``range(...)``, ``choice(...)``); None when it cannot be parsed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except Exception:  # noqa: BLE001 - a launcher's own argv (submitit): fall back to every override
        return None
    return {o.key_or_group for o in parsed if o.is_sweep_override()}


def _short(value: str) -> str:
    value = re.sub(r"[^\w.=+-]+", "-", value).strip("-")
    return value if len(value) <= MAX_VALUE else value[:MAX_VALUE - 1] + "~"


def job_dir(num: Any, overrides: Sequence[str] | None, params: Any = None) -> str:
    """``<num>_<key>=<value>_...`` for the swept keys among this job's ``overrides`` (the last part of each key);
    ``params``: an Optuna sweep's ``hydra.sweeper.params`` (a preset's search space), swept too."""
    swept = swept_keys(sys.argv[1:])
    if swept is not None and params:
        swept |= {str(k) for k in params}
    parts = []
    for o in overrides or ():
        key, _, value = str(o).partition("=")
        key = key.lstrip("+~")
        if swept is None or key in swept:
            parts.append(_short(f"{key.rsplit('.', 1)[-1]}={value}"))
    return "_".join([str(num), *parts])
