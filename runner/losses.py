"""``loss.*``: the loss and noise options of a diffusion objective, and public helpers that apply them.

The built-in family bases (runner/trainers/ddpm.py, runner/trainers/flow.py) read these options;
a user's trainer uses the same helpers (``loss_config(cfg)`` and the functions below) to get the
same options with the same meaning. Every random draw comes from the per-sample seeds
(:func:`runner.trainer.per_sample_rand` / :func:`~runner.trainer.per_sample_randn`), so a loss
with any option is the same however a batch is split (gradient accumulation, OOM recovery) and
on resume.

The options, and the formulas used (the README's "Recipe options" table gives the peers' names):

* ``loss.type`` = ``mse`` (default) | ``huber`` | ``l1``: the per-element loss of ``d = pred - target``.
  ``huber`` is the pseudo-Huber loss kohya sd-scripts uses, ``2c (sqrt(d^2 + c^2) - c)`` with
  ``c = loss.huber_c``: about ``d^2`` (MSE) for ``|d| << c`` and ``2c |d|`` (L1, robust to
  outliers) for ``|d| >> c``; smooth everywhere, unlike torch's piecewise ``huber_loss``.
* ``loss.noise_offset`` (DDPM, epsilon and v): the noise gets ``offset * n`` added, ``n ~ N(0, 1)``
  drawn once per sample and latent channel (constant over the image), as kohya's
  ``--noise_offset`` does. Lets a model learn very dark/bright images.
* ``loss.min_snr_gamma`` (DDPM): each sample's loss is weighted by Min-SNR-gamma (Hang et al.
  2023): with ``snr = a / (1 - a)``, ``a = alphas_cumprod[t]``, the weight is
  ``min(snr, gamma) / snr`` for epsilon prediction and ``min(snr, gamma) / (snr + 1)`` for
  v-prediction (the v target's own SNR weighting is ``snr + 1``).
* ``loss.timestep_sampling`` (flow matching): ``uniform`` t ~ U(0, 1), or ``logit_normal``
  t = sigmoid(m + s z), z ~ N(0, 1) (SD3's default, with ``loss.logit_mean`` m and
  ``loss.logit_std`` s). z is the normal quantile of the sample's uniform draw, so t stays a
  function of the seed alone.
* ``loss.timestep_shift`` (flow matching), applied to the sampled t, which is also the noise
  level (x_t = (1 - t) x0 + t noise):

  - ``fixed``: ``t' = s t / (1 + (s - 1) t)`` with ``s = loss.shift`` (SD3/SD3.5 train and sample with 3.0);
  - ``resolution``: Flux's shift from the image's sequence length L (latent tokens after
    patchifying: 4096 at 1024 px for Flux and SD3), ``mu = base + (max - base) (L - 256) / (4096 - 256)``
    (``loss.base_shift`` 0.5, ``loss.max_shift`` 1.15), ``t' = e^mu / (e^mu + 1/t - 1)``, which is
    the ``fixed`` formula with ``s = e^mu``: 1.65 at 256 tokens (512 px), 3.16 at 4096 (1024 px);
  - ``none``: t as sampled.

A trainer's defaults for the two flow options (``None`` here) are its family's: logit-normal for
both flow families; no shift for Flux (as diffusers' Flux scripts train), ``fixed`` 3.0 for SD3.5
(its scheduler's shift, as diffusers' SD3 scripts train). An option that does not apply to a
trainer's objective (noise offset on a flow-matching trainer, a timestep shift on a DDPM one) is
refused when the trainer is built, naming the key.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch
import torch.nn.functional as F

from runner.errors import UserError, valid_list

LOSS_TYPES = ("mse", "huber", "l1")
TIMESTEP_SAMPLINGS = ("uniform", "logit_normal")
TIMESTEP_SHIFTS = ("none", "fixed", "resolution")
# Flux's scheduler: mu runs linearly from base_shift at 256 tokens to max_shift at 4096.
BASE_SEQ_LEN, MAX_SEQ_LEN = 256, 4096
# Salt of the noise-offset draw (runner.trainers.base.salted): independent of the noise, the VAE
# sample (1) and the timestep (2) of the same sample.
NOISE_OFFSET_SALT = 3

DDPM = "ddpm"
FLOW = "flow_matching"


@dataclass
class LossConfig:
    """``loss.*`` (runner/losses.py has the formulas). Defaults keep each trainer's plain loss."""

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
    registered = _registered_trainer(cfg)
    if registered is not None:  # a built-in or entry-point trainer: its objective is known without building it
        name, cls = registered
        if getattr(cls, "objective", None):
            check_objective(c, cls.objective, f"trainer={name}")


def _registered_trainer(cfg: Any) -> tuple[str, type] | None:
    """(name, class) of the run's trainer when it is a registered one (imported already; a user's
    ``trainer._target_`` is not imported here, its own constructor checks the options)."""
    from hydra.utils import get_class

    from runner import registry

    target = cfg.trainer.get("_target_") if hasattr(cfg, "trainer") and cfg.trainer is not None else None
    for name, entry in registry.trainers().items():
        if entry.target == target:
            return name, get_class(target)
    return None


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
            f"runner/losses.py lists which options each objective takes."
        )


# ---- the per-element loss -------------------------------------------------------------------------
def elementwise_loss(pred: torch.Tensor, target: torch.Tensor, kind: str = "mse", huber_c: float = 0.1) -> torch.Tensor:
    """The per-element loss of ``pred - target`` (float32): squared, pseudo-Huber or absolute error."""
    d = pred.float() - target.float()
    if kind == "mse":
        return d * d
    if kind == "l1":
        return d.abs()
    if kind == "huber":
        c = float(huber_c)
        return 2 * c * (torch.sqrt(d * d + c * c) - c)
    raise ValueError(f"unknown loss type {kind!r}")


def diffusion_loss(pred: torch.Tensor, target: torch.Tensor, options: LossConfig,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """The batch's loss: the mean per-element loss, or with ``weights`` (one per sample) the mean of
    each sample's mean loss times its weight.

    The default (``mse``, no weights) is ``F.mse_loss(pred, target)`` itself, so a trainer that
    moves onto these helpers keeps its losses bit for bit.
    """
    if weights is None and options.type == "mse":
        return F.mse_loss(pred.float(), target.float(), reduction="mean")
    elem = elementwise_loss(pred, target, options.type, options.huber_c)
    if weights is None:
        return elem.mean()
    per_sample = elem.mean(dim=tuple(range(1, elem.dim())))
    return (per_sample * weights.to(per_sample.device, per_sample.dtype)).mean()


# ---- DDPM: noise offset and Min-SNR ----------------------------------------------------------------
def noise_offset(seeds: torch.Tensor, channels: int, spatial_dims: int, strength: float,
                 device: torch.device | str) -> torch.Tensor:
    """``strength * n`` with ``n ~ N(0, 1)`` per sample and channel, shaped ``(B, C, 1, ...)`` to add to noise."""
    from runner.trainer import per_sample_randn
    from runner.trainers.base import salted

    n = per_sample_randn(salted(seeds, NOISE_OFFSET_SALT), (channels,) + (1,) * spatial_dims, device, torch.float32)
    return float(strength) * n


def ddpm_noise(seeds: torch.Tensor, shape: tuple[int, ...], device: torch.device | str,
               options: LossConfig) -> torch.Tensor:
    """The per-sample noise of a DDPM step (``shape`` without the batch dim), with ``loss.noise_offset``."""
    from runner.trainer import per_sample_randn

    noise = per_sample_randn(seeds, tuple(shape), device, torch.float32)
    if options.noise_offset > 0:
        noise = noise + noise_offset(seeds, shape[0], len(shape) - 1, options.noise_offset, device)
    return noise


def min_snr_weights(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, gamma: float,
                    prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma weight per sample: ``min(snr, gamma) / snr`` (epsilon) or ``/ (snr + 1)`` (v_prediction)."""
    a = alphas_cumprod.to(timesteps.device)[timesteps].float()
    snr = a / (1 - a)
    clipped = torch.clamp(snr, max=float(gamma))
    if prediction_type == "epsilon":
        return clipped / snr
    if prediction_type == "v_prediction":
        return clipped / (snr + 1)
    raise ValueError(f"Min-SNR weighting needs epsilon or v_prediction, not {prediction_type!r}")


# ---- flow matching: timestep sampling and shift ----------------------------------------------------
def flow_timesteps(u: torch.Tensor, sampling: str, logit_mean: float = 0.0, logit_std: float = 1.0) -> torch.Tensor:
    """t in (0, 1) from uniform draws ``u``: ``u`` itself, or logit-normal ``sigmoid(m + s * ndtri(u))``."""
    if sampling == "uniform":
        return u
    if sampling == "logit_normal":
        z = torch.special.ndtri(u.clamp(1e-6, 1 - 1e-6))
        return torch.sigmoid(float(logit_mean) + float(logit_std) * z)
    raise ValueError(f"unknown timestep sampling {sampling!r}")


def resolution_mu(seq_len: int, base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """Flux's ``mu`` for an image of ``seq_len`` latent tokens (linear from 256 to 4096 tokens)."""
    slope = (max_shift - base_shift) / (MAX_SEQ_LEN - BASE_SEQ_LEN)
    return base_shift + slope * (seq_len - BASE_SEQ_LEN)


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """``s t / (1 + (s - 1) t)``: moves t towards 1 (more noise) for ``s > 1``; ``s = 1`` is the identity."""
    s = float(shift)
    return s * t / (1 + (s - 1) * t)


def shifted_flow_timesteps(u: torch.Tensor, options: LossConfig, seq_len: int, default_sampling: str = "logit_normal",
                           default_shift: str = "none") -> torch.Tensor:
    """t per sample for a flow-matching step: sampled (``loss.timestep_sampling``), then shifted
    (``loss.timestep_shift``; ``seq_len``: the image's latent tokens, for ``resolution``)."""
    t = flow_timesteps(u, options.timestep_sampling or default_sampling, options.logit_mean, options.logit_std)
    mode = options.timestep_shift or default_shift
    if mode == "fixed":
        return shift_timesteps(t, options.shift)
    if mode == "resolution":
        return shift_timesteps(t, math.exp(resolution_mu(seq_len, options.base_shift, options.max_shift)))
    return t


def describe_loss_options() -> list[str]:
    """Lines of ``mode=plugins``: every ``loss.*`` key with its default."""
    from runner.registry import describe_config

    lines = ["Loss options (loss.<key>=<value>; runner/losses.py has the formulas):"]
    for name, ftype, default in describe_config(LossConfig):
        owner = ONLY_FOR.get(name)
        scope = {DDPM: "  [DDPM trainers]", FLOW: "  [flow-matching trainers]"}.get(owner or "", "")
        lines.append(f"      loss.{name}: {ftype} = {default!r}{scope}")
    return lines
