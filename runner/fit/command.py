"""What ``mode=fit`` prints and writes, and ``train.auto_fit``.

* the table: the base, the top candidates (settings, peak, s/step, planned or estimated) and why
  each one that is not chosen loses (slower, over budget, refused), plus what a ``fit.allow``
  entry would open;
* ``conf/preset/fit.yaml`` in the run directory: a preset with every setting the winner needs,
  usable from any command line with ``hydra.searchpath=[file://<dir>/conf] +preset=fit`` (or
  Hydra's ``--config-dir <dir>/conf``), and the same as one line of overrides;
* ``fit.json``: every candidate with its estimate (and plan, when confirmed).
"""
from __future__ import annotations

import json
import logging
import shlex
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from runner import registry
from runner.compose import compose_config
from runner.errors import UserError
from runner.fit.picture import draw_fit
from runner.fit.search import Candidate, FitResult, fitted_overrides, search
from runner.plan.result import format_size
from runner.plan.target import GiB
from runner.plugin import KINDS

log = logging.getLogger("runner")

FIT_JSON = "fit.json"
PRESET_NAME = "fit"
TRAIN_KEYS = ("batch_size", "grad_accum", "mixed_precision", "cpu_autocast", "max_grad_norm")


class NothingFits(UserError):
    """No configuration fits the budget: exit status 3, like a plan over budget; in a sweep the job's status is
    ``does_not_fit`` (nothing ran) and the message names the smallest plan."""

    exit_code = 3
    status = "does_not_fit"


def _status(c: Candidate, result: FitResult) -> str:
    if c is result.winner:
        return "chosen"
    if c.error:
        return f"refused: {c.error[:90]}"
    over = c.required_bytes - result.limit
    how = "planned" if c.confirmed else "estimated"
    if over > 0:
        return f"over the budget by {format_size(over)} ({how})"
    if c.host_bytes > result.host_limit:
        return (f"needs {format_size(c.host_bytes)} of host RAM while training, more than fit.host_ram_gb "
                f"({format_size(result.host_limit)}) ({how})")
    if result.winner is not None:
        if c.seconds < result.winner.seconds and not c.confirmed:
            return "estimated about as fast; not planned (fit.confirm plans spent, or within 5 %)"
        return f"slower by {c.seconds - result.winner.seconds:.3g} s/step ({how})"
    return how


def format_result(result: FitResult, top: int = 5) -> str:
    batch = result.batch
    lines = [f"fit: budget {format_size(result.budget_bytes)}"
             + (f" less {format_size(result.headroom_bytes)} headroom" if result.headroom_bytes else "")
             + f", host RAM {format_size(result.host_limit)}"
             + f", step time on {result.device}; {len(result.candidates)} candidates, {result.plans} full plans, "
             f"{result.seconds:.0f} s" + (f"; allowed to change the math: {', '.join(result.allow)}" if result.allow else
                                          "; only settings that keep the result the same (fit.allow=[...] for more)"),
             ""]
    b = result.base
    lines.append(f"  your settings: {b.knobs.describe(batch)}")
    lines.append(f"    peak {format_size(b.required_bytes)} ({'planned' if b.confirmed else 'estimated'}), "
                 f"{b.seconds:.3g} s/step: " + ("fits" if b.required_bytes <= result.limit else
                                                 f"over the budget by {format_size(b.required_bytes - result.limit)}"))
    lines.append("")
    shown = _shown(result, top)
    lines.append(f"  {'#':>2}  {'peak':>10}  {'s/step':>7}  verdict / settings")
    for i, c in enumerate(shown, 1):
        mark = "*" if c.confirmed else " "
        lines.append(f"  {i:>2}  {format_size(c.required_bytes):>9}{mark}  {c.seconds:>7.3g}  {_status(c, result)}")
        lines.append(f"  {'':>2}  {'':>10}  {'':>7}  {c.knobs.describe(batch)}")
    lines.append("  (* confirmed by a full plan; other figures are estimates from the planned breakdowns)")
    for name, c in result.not_allowed:
        lines.append(f"  with fit.allow=[{name}]: {c.knobs.describe(batch)} would fit at an estimated "
                     f"{format_size(c.required_bytes)}, {c.seconds:.3g} s/step")
    lines.append("")
    if result.winner is not None:
        w = result.winner
        changes = w.knobs.changes(result.base.knobs)
        lines.append(f"chosen: {w.knobs.describe(batch)}: peak {format_size(w.required_bytes)} (planned), "
                     f"{w.seconds:.3g} s/step on {result.device}")
        lines.append("  changed: " + ("; ".join(changes) if changes else "nothing: your settings are the fastest that fit"))
    else:
        c = result.closest
        lines.append(f"NOTHING FITS budget {format_size(result.limit)}."
                     + (f" Closest: {c.knobs.describe(batch)} at {format_size(c.required_bytes)} "
                        f"({'planned' if c.confirmed else 'estimated'}), {format_size(c.required_bytes - result.limit)} "
                        "over the budget." if c is not None else ""))
    return "\n".join(lines)


def _shown(result: FitResult, top: int) -> list[Candidate]:
    """The winner, the fastest others (confirmed first among equals), and what was planned."""
    ordered = sorted(result.candidates, key=lambda c: (c.seconds, c.required_bytes))
    fitting = [c for c in ordered if c.fits(result.limit, result.host_limit)]
    over = [c for c in ordered if not c.fits(result.limit, result.host_limit)]
    shown: list[Candidate] = []
    for c in ([result.winner] if result.winner else []) + [c for c in ordered if c.confirmed] + fitting[:top] + over[:2]:
        if c is not None and c not in shown:
            shown.append(c)
    if result.closest is not None and result.closest not in shown:
        shown.insert(0, result.closest)
    return sorted(shown[: top + 4], key=lambda c: (c is not result.winner, c.seconds))


# ---- the preset ------------------------------------------------------------------------------------
def _trainer_choice(cfg: Any) -> str:
    target = str(cfg.trainer.get("_target_"))
    for name, entry in registry.trainers().items():
        if entry.target == target:
            return name
    return "custom"


def preset_text(cfg: Any, result: FitResult, cand: Candidate, command: str) -> str:
    """A preset file (``# @package _global_``) with everything the chosen configuration sets."""
    chosen: dict[str, list[str]] = {kind: [] for kind in KINDS}
    for kind, name, _ in registry.selected(cfg):
        chosen[kind].append(name)
    defaults: list[Any] = [{"override /trainer": _trainer_choice(cfg)}, {"override /optimizer": str(cfg.optimizer.name)}]
    defaults += [{f"override /{kind}": names} for kind, names in chosen.items()]
    body: dict[str, Any] = {"defaults": defaults, "preset": PRESET_NAME}
    if _trainer_choice(cfg) == "custom":
        body["trainer"] = OmegaConf.to_container(cfg.trainer, resolve=True)
    body["budget_gb"] = cfg.budget_gb
    body["device"] = {k: v for k, v in OmegaConf.to_container(cfg.device, resolve=True).items() if v is not None}
    body["model"] = OmegaConf.to_container(cfg.model, resolve=True)
    body["data"] = {"resolution": int(cfg.data.resolution)}
    body["train"] = {k: OmegaConf.to_container(cfg.train, resolve=True)[k] for k in TRAIN_KEYS}
    body["optimizer"] = {k: v for k, v in OmegaConf.to_container(cfg.optimizer, resolve=True).items() if k != "name"}
    for kind, names in chosen.items():
        if names:
            body[kind] = {n: OmegaConf.to_container(cfg[kind][n], resolve=True) for n in names}
    if not body["device"]:
        del body["device"]
    w = cand
    header = [
        "# @package _global_",
        f"# Written by mode=fit on {time.strftime('%Y-%m-%d %H:%M')}: the fastest settings it found that fit "
        f"{format_size(result.limit)}, with the step time predicted on {result.device}.",
        f"# Planned peak {format_size(w.required_bytes)}, predicted {w.seconds:.3g} s/step.",
        f"# Base: python -m runner {shlex.join(result.user_overrides)}".rstrip(),
        f"# Changed: {'; '.join(w.knobs.changes(result.base.knobs)) or 'nothing'}",
        f"# The same as a command line: {command}",
        "# Use it from the config dir holding preset/fit.yaml: python -m runner hydra.searchpath=[file://<dir>] "
        "+preset=fit, or --config-dir <dir>",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False, default_flow_style=None)


def write_outputs(result: FitResult, out: Path) -> dict[str, Any]:
    """fit.json always; the preset and commands when something fits."""
    out.mkdir(parents=True, exist_ok=True)
    record = {"budget_bytes": result.budget_bytes, "headroom_bytes": result.headroom_bytes,
              "host_limit_bytes": result.host_limit, "device": result.device,
              "plans": result.plans, "seconds": round(result.seconds, 2), "allow": result.allow,
              "base": _row(result.base, result), "winner": _row(result.winner, result) if result.winner else None,
              "closest": _row(result.closest, result) if result.closest else None,
              "candidates": [_row(c, result) for c in result.candidates]}
    paths: dict[str, Any] = {"json": out / FIT_JSON}
    if result.winner is not None:
        conf = (out / "conf").resolve()
        preset = conf / "preset" / f"{PRESET_NAME}.yaml"
        preset.parent.mkdir(parents=True, exist_ok=True)
        command = "python -m runner " + shlex.join(result.winner.overrides)
        cfg = compose_config(result.winner.overrides)
        preset.write_text(preset_text(cfg, result, result.winner, command))
        rest = [o for o in result.user_overrides if not _captured(o)]
        preset_command = "python -m runner " + shlex.join([f"hydra.searchpath=[file://{conf}]", f"+preset={PRESET_NAME}", *rest])
        paths.update(preset=preset, conf=conf, command=command, preset_command=preset_command)
        record.update(preset=str(preset), command=command, preset_command=preset_command)
    paths["json"].write_text(json.dumps(record, indent=1, default=str) + "\n")
    paths["png"] = draw_fit(record, out)
    return paths


def _captured(override: str) -> bool:
    """Whether fit.yaml sets what this user override sets (then the preset command leaves it out)."""
    key = override.lstrip("+~").split("=", 1)[0]
    head = key.split(".", 1)[0]
    if head in (*KINDS, "preset", "trainer", "optimizer", "model", "budget_gb", "device"):
        return True
    return key in ("data.resolution", *(f"train.{k}" for k in TRAIN_KEYS))


def _row(c: Candidate | None, result: FitResult) -> dict[str, Any] | None:
    if c is None:
        return None
    return {"settings": c.knobs.describe(result.batch),
            "knobs": {k: getattr(c.knobs, k) for k in c.knobs.__dataclass_fields__},
            "overrides": c.overrides, "required_bytes": c.required_bytes, "seconds_per_step": c.seconds,
            "host_bytes": c.host_bytes,
            "confirmed": c.confirmed, "estimate": {"required_bytes": c.estimate.required_bytes,
                                                   "seconds_per_step": c.estimate.seconds, "parts": c.estimate.parts},
            "planned_peak_bytes": c.plan.peak_bytes if c.plan else None, "error": c.error,
            "verdict": _status(c, result)}


# ---- the two entry points ------------------------------------------------------------------------
def command_line(overrides: Sequence[str] | None) -> list[str]:
    """The run's command line, which the search varies; it is unknown outside ``python -m runner``."""
    if overrides is None:
        raise UserError("mode=fit and train.auto_fit vary the run's command line, which is unknown here (a config "
                        "composed in Python). Run them through python -m runner, or call runner.fit.command.fit_command "
                        "with the overrides.")
    return list(overrides)


def fit_command(cfg: Any, overrides: Sequence[str], out: Path) -> FitResult:
    """``mode=fit``: search, print, write; NothingFits (exit 3) when no configuration fits."""
    result = search(cfg, overrides)
    print(format_result(result, int(cfg.fit.top)))
    paths = write_outputs(result, out)
    if result.winner is None:
        c = result.closest
        smallest = (f" The smallest: {c.knobs.describe(int(cfg.train.batch_size))} at {format_size(c.required_bytes)}."
                    if c is not None else "")
        raise NothingFits(f"No configuration fits budget {format_size(result.limit)}.{smallest} See the table above and "
                          f"{paths['json']}. Allow settings that change the math (fit.allow=[...]), lower "
                          "data.resolution or train.batch_size, or use a larger device.")
    picture = f" and {paths['png']}" if paths["png"] else ""
    print(f"\nwrote {paths['preset']}{picture}\nrun it with:\n  {paths['preset_command']}\nor:\n  {paths['command']}")
    return result


def auto_fit(cfg: Any, overrides: Sequence[str], out: Path) -> tuple[Any, list[str]]:
    """``train.auto_fit=true``: the search before training; returns the winner's config and command line."""
    if cfg.train.get("resume"):
        raise UserError("train.auto_fit=true with train.resume: a resumed run keeps the settings it was saved with "
                        "(those auto_fit chose before). Drop train.auto_fit.")
    from runner.distributed.launch import from_rank0

    def searched() -> list[str]:
        result = fit_command(cfg, overrides, out)
        log.info("auto_fit: training with %s (%.3g s/step predicted, peak %.2f GiB planned)",
                 result.winner.knobs.describe(int(cfg.train.batch_size)), result.winner.seconds,
                 result.winner.required_bytes / GiB)
        return [*fitted_overrides(result.winner.overrides), *[o for o in overrides if _keeps(o)], "train.auto_fit=false"]

    # Several processes: rank 0 searches (each plan is one rank's: the launcher's world size), every
    # rank trains with its answer. One process: the search, here.
    chosen = from_rank0(searched)
    return compose_config(chosen), chosen


def _keeps(override: str) -> bool:
    """User overrides auto_fit carries into the run although the search ignored them (mode, outputs)."""
    key = override.lstrip("+~").split("=", 1)[0]
    return key in ("mode", "output_dir") or key.startswith("hydra.")
