"""Park's check that the modules a cache fill needs were loaded in this process.

With several processes on one node, runner/distributed/loading.py builds the modules whose outputs park
caches (:meth:`Park.frees_after_cache_fill`) without weights (parameters on ``meta``) on every rank but
0: rank 0 fills the cache first (accelerate's ``main_process_first``) and the others read its entries
and drop those modules unused. A rank that still finds entries missing then (its cache folder is not
rank 0's) cannot encode them: it stops with what to change, instead of running a module without
weights.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from runner.errors import UserError
from runner.trainer import ModelSet

if TYPE_CHECKING:
    from runner.plugins.park.cache import CachePlan


def not_loaded(module: nn.Module) -> bool:
    """Built without weights (parameters on ``meta``): a process that was not meant to call it."""
    return any(p.device.type == "meta" for p in module.parameters())


def require_loaded(models: ModelSet, specs: dict[str, Any], plan: CachePlan, root: Any, setting: str) -> None:
    """Entries to encode, but a module that computes them was not loaded in this process. Several
    processes on one node: only rank 0 loads the modules whose outputs are cached (runner/distributed/loading.py)
    and fills the cache first; another rank that still finds entries missing does not see rank 0's folder."""
    parts = {p for p, views in plan.missing.items() if views} | {p for p, t in plan.missing_captions.items() if t}
    absent = sorted({m for p in parts for m in specs[p].modules if m in models and not_loaded(models[m])})
    if absent:
        raise UserError(
            f"{setting}: {plan.missing_count()} encoder cache entries are missing in {root} after rank 0 filled it, "
            f"and this process did not load {', '.join(absent)} (with several processes on one node only rank 0 "
            "loads the modules whose outputs are cached, and the others read its entries). Every process must see "
            f"the same folder: set {setting} to a path all of them read, not one per process.")
