"""The ``loss.*`` options, their checks and which objective each belongs to, without torch.

Split from runner/loss/objectives.py (the formulas, which need torch) so that composing a run, ``--help``,
``mode=plugins`` and a config error never import torch (runner/checks.py fast path). A
built-in trainer's objective comes from its registration (runner/families/__init__.py), so an
option of the other objective is refused before any trainer module is imported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Optional

from runner.errors import UserError, valid_list

LOSS_TYPES = ("mse", "huber", "l1")
TIMESTEP_SAMPLINGS = ("uniform", "logit_normal")
TIMESTEP_SHIFTS = ("none", "fixed", "resolution")
# Flux's scheduler: mu runs linearly from base_shift at 256 tokens to max_shift at 4096.
BASE_SEQ_LEN, MAX_SEQ_LEN = 256, 4096
# Salt of the noise-offset draw (runner.trainer.salted): independent of the noise, the VAE
# sample (1) and the timestep (2) of the same sample.
NOISE_OFFSET_SALT = 3

DDPM = "ddpm"
FLOW = "flow_matching"


@dataclass
class LossConfig:
    """``loss.*`` (runner/loss/objectives.py has the formulas). Defaults keep each trainer's plain loss."""

    type: str = "mse"  # mse | huber | l1: per-element loss of prediction - target
    huber_c: float = 0.1  # loss.type=huber: c of pseudo-Huber 2c(sqrt(d^2+c^2)-c): ~d^2 below c, ~2c|d| above
    noise_offset: float = 0.0  # DDPM: add offset * N(0,1) per sample and channel to the noise (0.05-0.1 typical); 0 = off
    min_snr_gamma: float = 0.0  # DDPM: Min-SNR weighting min(snr,gamma)/snr (eps) or /(snr+1) (v); 5 is typical; 0 = off
    timestep_sampling: Optional[str] = None  # flow matching: uniform | logit_normal; None = the trainer's (logit_normal)
    logit_mean: float = 0.0  # flow matching, logit_normal: mean m of t = sigmoid(m + s z)
    logit_std: float = 1.0  # flow matching, logit_normal: std s of t = sigmoid(m + s z)
    timestep_shift: Optional[str] = None  # flow matching: none | fixed | resolution; None = the trainer's (flux none, sd35 fixed)
    shift: float = 3.0  # timestep_shift=fixed: s of t' = s t / (1 + (s-1) t) (SD3's 3.0)
    base_shift: float = 0.5  # timestep_shift=resolution: mu at 256 image tokens (Flux's 0.5)
    max_shift: float = 1.15  # timestep_shift=resolution: mu at 4096 image tokens (Flux's 1.15)
    audio_weight: float = 1.0  # an audio-video trainer (trainer=ltx2): its audio loss x this, added to the video's
    prior_weight: float = 1.0  # samples of a data.sets role: prior set (or data.demo_prior): their loss x this (DreamBooth)


# Which objective each option belongs to; the rest (type, huber_c) apply to every one.
ONLY_FOR: dict[str, str] = {
    "noise_offset": DDPM,
    "min_snr_gamma": DDPM,
    "timestep_sampling": FLOW,
    "logit_mean": FLOW,
    "logit_std": FLOW,
    "timestep_shift": FLOW,
    "shift": FLOW,
    "base_shift": FLOW,
    "max_shift": FLOW,
}


def loss_config(cfg: Any) -> LossConfig:
    """The run's ``loss`` node as a :class:`LossConfig` (defaults where the node or a key is absent)."""
    node = cfg.get("loss") if hasattr(cfg, "get") else None
    if node is None:
        return LossConfig()
    values = {f.name: node.get(f.name, f.default) for f in fields(LossConfig)}
    return LossConfig(**values)


def validate_loss(cfg: Any) -> None:
    """Values the schema cannot check, before anything is built; each error names the key."""
    c = loss_config(cfg)
    _choice("loss.type", c.type, LOSS_TYPES)
    if c.timestep_sampling is not None:
        _choice("loss.timestep_sampling", c.timestep_sampling, TIMESTEP_SAMPLINGS)
    if c.timestep_shift is not None:
        _choice("loss.timestep_shift", c.timestep_shift, TIMESTEP_SHIFTS)
    _number("loss.huber_c", c.huber_c, "> 0", c.huber_c > 0, "e.g. 0.1")
    _number("loss.noise_offset", c.noise_offset, ">= 0", c.noise_offset >= 0, "e.g. 0.05; 0 turns it off")
    _number("loss.min_snr_gamma", c.min_snr_gamma, ">= 0", c.min_snr_gamma >= 0, "e.g. 5; 0 turns it off")
    _number("loss.logit_std", c.logit_std, "> 0", c.logit_std > 0, "e.g. 1.0")
    _number("loss.logit_mean", c.logit_mean, "finite", math.isfinite(c.logit_mean), "e.g. 0.0")
    _number("loss.shift", c.shift, "> 0", c.shift > 0, "e.g. 3.0; 1.0 shifts nothing")
    for key, value in (("loss.base_shift", c.base_shift), ("loss.max_shift", c.max_shift)):
        _number(key, value, "finite", math.isfinite(value), "Flux uses 0.5 and 1.15")
    _number("loss.prior_weight", c.prior_weight, "> 0", math.isfinite(c.prior_weight) and c.prior_weight > 0,
            "DreamBooth's 1.0")
    _number("loss.audio_weight", c.audio_weight, "> 0", _finite_positive(c.audio_weight),
            "1.0 weighs audio and video alike; data.audio=false trains video only")
    if c.prior_weight != 1.0 and not has_prior_set(cfg):
        raise UserError(
            f"loss.prior_weight={c.prior_weight!r} weighs the samples of a prior (class) set, and this run has none. "
            "Give a regularization set with role: prior in data.sets (e.g. data.sets='[{path: /data/dog}, {path: "
            "/data/dogs_class, role: prior}]'), or data.demo_prior=N beside the demo set, or leave loss.prior_weight "
            "at 1.0.")


def _finite_positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def has_prior_set(cfg: Any) -> bool:
    """Whether the run's data has a prior (class) set: a ``data.sets`` entry with ``role: prior`` or ``data.demo_prior``."""
    data = cfg.get("data") if hasattr(cfg, "get") else None
    if data is None or not hasattr(data, "get"):
        return False
    sets = data.get("sets") or []
    return bool(data.get("demo_prior") or 0) or any((s.get("role") if hasattr(s, "get") else None) == "prior"
                                                    for s in sets)


def _choice(key: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise UserError(f"{key}={value!r} is not valid. Valid values: {valid_list(str(value), valid)}.")


def _number(key: str, value: float, bound: str, ok: bool, example: str) -> None:
    if not ok:
        raise UserError(f"{key}={value!r} is not valid: it must be a number {bound} ({example}).")


def check_objective(options: LossConfig, objective: str, trainer: str) -> None:
    """Refuse options set away from their default that ``objective`` (``ddpm`` | ``flow_matching``) does not use."""
    defaults = LossConfig()
    wrong = [name for name, owner in ONLY_FOR.items()
             if owner != objective and getattr(options, name) != getattr(defaults, name)]
    if wrong:
        keys = ", ".join(f"loss.{n}={getattr(options, n)!r}" for n in wrong)
        what = "DDPM (epsilon / v-prediction)" if objective == DDPM else "flow-matching"
        other = "flow-matching" if objective == DDPM else "DDPM (epsilon / v-prediction)"
        raise UserError(
            f"{keys}: {'this option applies' if len(wrong) == 1 else 'these options apply'} to {other} trainers, "
            f"and {trainer} trains with a {what} loss. Remove {'it' if len(wrong) == 1 else 'them'}; "
            f"runner/loss/objectives.py lists which options each objective takes."
        )


def describe_prior(cfg: Any) -> str:
    """The data line's note of the prior sets' loss weight ("" without a prior set)."""
    if not has_prior_set(cfg):
        return ""
    return f"; the prior sets' loss x {loss_config(cfg).prior_weight:g} (loss.prior_weight)"


def describe_loss_options() -> list[str]:
    """Lines of ``mode=plugins``: every ``loss.*`` key with its default."""
    from runner.registry import describe_config

    lines = ["Loss options (loss.<key>=<value>; runner/loss/objectives.py has the formulas):"]
    for name, ftype, default in describe_config(LossConfig):
        owner = ONLY_FOR.get(name)
        scope = {DDPM: "  [DDPM trainers]", FLOW: "  [flow-matching trainers]"}.get(owner or "", "")
        lines.append(f"      loss.{name}: {ftype} = {default!r}{scope}")
    return lines
