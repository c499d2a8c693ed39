"""The plan's suggestions re-planned: what each one really saves (one full simulation each)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runner.checks import validate
from runner.compose import compose_config
from runner.plan import Plan, plan_step


def verify_suggestions(overrides: Sequence[str], plan: Plan, top: int = 3) -> list[dict[str, Any]]:
    """Re-plan the ``top`` suggestions of ``plan`` (made from ``overrides``): their measured savings.

    Costs one full simulation each. Returns the suggestions with ``measured_saves_bytes``.
    """
    out = []
    for sug in plan.suggestions[:top]:
        cfg = compose_config([*overrides, sug["override"]])
        validate(cfg)
        again = plan_step(cfg, target=plan.target)
        out.append({**sug, "measured_saves_bytes": plan.peak_bytes - again.peak_bytes, "measured_peak_bytes": again.peak_bytes})
    return out
