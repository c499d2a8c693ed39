"""``loss.*``: the loss and noise options of a diffusion objective, and public helpers that apply them.

The built-in family bases (runner/families/common/ddpm.py, runner/families/common/flow.py) read these options;
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
    the ``fixed`` formula with ``s = e^mu``: 1.65 at 256 tokens (256 px), 1.88 at 1024 (512 px),
    3.16 at 4096 (1024 px);
  - ``none``: t as sampled.

A trainer's defaults for the two flow options (``None`` here) are its family's: logit-normal for
both flow families; no shift for Flux (as diffusers' Flux scripts train), ``fixed`` 3.0 for SD3.5
(its scheduler's shift, as diffusers' SD3 scripts train). An option that does not apply to a
trainer's objective (noise offset on a flow-matching trainer, a timestep shift on a DDPM one) is
refused when the trainer is built, naming the key.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from runner.loss.config import (  # noqa: F401  (the options live there, without torch; re-exported)
    BASE_SEQ_LEN,
    DDPM,
    FLOW,
    LOSS_TYPES,
    MAX_SEQ_LEN,
    NOISE_OFFSET_SALT,
    ONLY_FOR,
    TIMESTEP_SAMPLINGS,
    TIMESTEP_SHIFTS,
    LossConfig,
    check_objective,
    describe_loss_options,
    loss_config,
    validate_loss,
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
                   weights: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The batch's loss: the mean per-element loss, or with ``weights`` (one per sample) the mean of
    each sample's mean loss times its weight; with ``mask`` (``data.masks``: one weight per element,
    broadcast to ``pred``'s shape) each sample's mean is :func:`masked_mean`'s.

    The default (``mse``, no weights, no mask) is ``F.mse_loss(pred, target)`` itself, so a trainer
    that moves onto these helpers keeps its losses bit for bit.
    """
    if weights is None and mask is None and options.type == "mse":
        return F.mse_loss(pred.float(), target.float(), reduction="mean")
    elem = elementwise_loss(pred, target, options.type, options.huber_c)
    if weights is None and mask is None:
        return elem.mean()
    per_sample = masked_mean(elem, mask) if mask is not None else elem.mean(dim=tuple(range(1, elem.dim())))
    if weights is None:
        return per_sample.mean()
    return (per_sample * weights.to(per_sample.device, per_sample.dtype)).mean()


def masked_mean(elem: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sample's mask-weighted mean loss, ``sum(mask * loss) / sum(mask)`` over all but the batch dim.

    Why per sample, not ``sum`` over the whole batch divided by the batch's mask sum: a step is
    the mean of its samples' losses however it is cut into micro-batches (gradient accumulation, the
    OOM retry) only if each sample's loss is a function of that sample alone; a batch-wide
    denominator would make a sample's weight depend on which others share its micro-batch. It also
    gives every image the same say, whatever the area of its mask. The trade-off: a pixel of a small
    mask weighs more than a pixel of a large one (a 10% mask's pixels count ten times a full
    image's), which is what kohya's and OneTrainer's masked training do too. A sample whose mask is
    zero after the crop contributes 0 (its denominator is clamped), never NaN; the data checks
    already refuse masks that are black everywhere (runner/data/masks.py).
    """
    m = mask.to(elem.device, elem.dtype).expand_as(elem)
    dims = tuple(range(1, elem.dim()))
    return (elem * m).sum(dim=dims) / m.sum(dim=dims).clamp_min(torch.finfo(elem.dtype).tiny)


def prior_weights(batch: dict, options: LossConfig, device: torch.device | str) -> torch.Tensor | None:
    """Per-sample weights of prior preservation: ``loss.prior_weight`` for the samples of a prior (class)
    set (the batch's ``prior`` flags, runner/data/sets.py), 1 for the others; None when the batch has no
    flags (no prior set). DreamBooth adds ``prior_weight x`` the class images' mean loss to the instance
    images' mean; here each sample's loss is multiplied by its weight before the batch mean, which is the
    same up to the batch's split between the two (half and half: exactly half DreamBooth's sum), and
    keeps the loss a mean over samples, so micro-batch splits stay invisible."""
    prior = batch.get("prior")
    if not isinstance(prior, torch.Tensor):
        return None
    flags = prior.to(device=device, dtype=torch.bool).reshape(-1)
    one = torch.ones(flags.shape, device=device, dtype=torch.float32)
    return torch.where(flags, one * float(options.prior_weight), one)


# ---- DDPM: noise offset and Min-SNR ----------------------------------------------------------------
def noise_offset(seeds: torch.Tensor, channels: int, spatial_dims: int, strength: float,
                 device: torch.device | str) -> torch.Tensor:
    """``strength * n`` with ``n ~ N(0, 1)`` per sample and channel, shaped ``(B, C, 1, ...)`` to add to noise."""
    from runner.trainer import per_sample_randn, salted

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
