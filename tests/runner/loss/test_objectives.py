"""``loss.*`` (runner/loss/objectives.py): each option against a small reference computation done here.

The references are written out in the tests (alphas_cumprod from the betas, the DDPM noising
formula, pseudo-Huber, the normal quantile function, SD3's and Flux's shift formulas) or taken
from diffusers' own scheduler and pipeline code, never from runner/loss/objectives.py. Tiny SD1.5 models on
the CPU; the trainers are the built-in ones, so the options are checked where they are applied.
"""
from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch
from accelerate.utils import set_seed

from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.cli.listing import format_plugin_list
from runner.checks import validate
from runner.errors import UserError
from runner.loss.objectives import (
    LossConfig,
    ddpm_noise,
    diffusion_loss,
    elementwise_loss,
    min_snr_weights,
    shift_timesteps,
)
from runner.resolved import resolve
from runner.trainer import slice_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def trainer(*overrides: str):
    cfg = compose_config([*overrides, "train.device=cpu"])
    validate(cfg)
    return build_trainer(cfg, resolve(cfg))


@pytest.fixture(scope="module")
def sd15():
    """A tiny SD1.5 trainer and its models (shared: only the loss options differ between tests)."""
    tr = trainer("trainer=sd15")
    set_seed(0)
    models = prepare_models(tr.build_models("cpu"), tr.cfg.model, resolve(tr.cfg))
    return tr, models


def sd_alphas_cumprod() -> torch.Tensor:
    """SD's scaled-linear schedule by hand, in float64: betas linear in sqrt, then the cumulative product."""
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, dim=0)


def by_hand(tr, models, batch, noise):
    """(prediction, epsilon target, timesteps) of a DDPM step, noised by the formula
    ``x_t = sqrt(a_t) x0 + sqrt(1 - a_t) noise`` rather than by the scheduler."""
    x0 = batch["latents"].float()
    t = tr.timesteps(batch["sample_seed"], "cpu")
    a = sd_alphas_cumprod()[t].float().view(-1, 1, 1, 1)
    noisy = a.sqrt() * x0 + (1 - a).sqrt() * noise
    with torch.no_grad():
        pred = tr.predict(models, noisy, t, batch)
    return pred.float(), noise, t


# ---- DDPM -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_min_snr_weights_follow_the_formula_for_epsilon_and_v(sd15, prediction):
    plain, models = sd15
    weighted = trainer("trainer=sd15", f"trainer.prediction_type={prediction}", "loss.min_snr_gamma=5")
    same = trainer("trainer=sd15", f"trainer.prediction_type={prediction}")
    batch = plain.example_batch(12, "cpu")
    t = same.timesteps(batch["sample_seed"], "cpu")
    a = sd_alphas_cumprod()[t]
    snr = a / (1 - a)
    want = torch.minimum(snr, torch.full_like(snr, 5.0)) / (snr if prediction == "epsilon" else snr + 1)
    assert (want < 0.999).any() and (snr > 5).any() and (snr < 5).any()  # both sides of gamma are exercised
    got = min_snr_weights(same.scheduler(torch.device("cpu")).alphas_cumprod, t, 5.0, prediction)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
    # In the trainer: the batch's loss is the mean of each sample's plain loss times its weight.
    with torch.no_grad():
        per_sample = torch.stack([same.loss(models, slice_batch(batch, i, i + 1)) for i in range(12)]).double()
        loss = weighted.loss(models, batch).double()
    assert loss.item() == pytest.approx((want * per_sample).mean().item(), rel=1e-5)
    assert loss.item() != pytest.approx(per_sample.mean().item(), rel=1e-3)


def test_noise_offset_is_one_normal_draw_per_sample_and_channel(sd15):
    tr, models = sd15
    seeds = torch.arange(1000, dtype=torch.int64)
    shape = (4, 8, 8)
    diff = ddpm_noise(seeds, shape, "cpu", LossConfig(noise_offset=0.1)) - ddpm_noise(seeds, shape, "cpu", LossConfig())
    torch.testing.assert_close(diff, diff[..., :1, :1].expand_as(diff), rtol=0, atol=1e-6)  # constant over the image
    per_channel = diff[:, :, 0, 0].flatten()
    assert abs(per_channel.mean().item()) < 0.01 and per_channel.std().item() == pytest.approx(0.1, rel=0.08)
    assert diff[:, 0, 0, 0].std().item() > 0 and not torch.equal(diff[:, 0], diff[:, 1])  # channels differ
    split = ddpm_noise(seeds[500:], shape, "cpu", LossConfig(noise_offset=0.1))
    torch.testing.assert_close(split, ddpm_noise(seeds, shape, "cpu", LossConfig(noise_offset=0.1))[500:], rtol=0, atol=0)
    # In the trainer: the offset noise is both what noises x0 and the epsilon target.
    offset = trainer("trainer=sd15", "loss.noise_offset=0.1")
    batch = tr.example_batch(3, "cpu")
    noise = ddpm_noise(batch["sample_seed"], tuple(batch["latents"].shape[1:]), "cpu", LossConfig(noise_offset=0.1))
    pred, target, _ = by_hand(offset, models, batch, noise)
    with torch.no_grad():
        assert offset.loss(models, batch).item() == pytest.approx(((pred - target) ** 2).mean().item(), rel=1e-5)


@pytest.mark.parametrize("kind", ["huber", "l1"])
def test_loss_types_follow_their_formulas(sd15, kind):
    tr, models = sd15
    other = trainer("trainer=sd15", f"loss.type={kind}", "loss.huber_c=0.3")
    batch = tr.example_batch(3, "cpu")
    noise = ddpm_noise(batch["sample_seed"], tuple(batch["latents"].shape[1:]), "cpu", LossConfig())
    pred, target, _ = by_hand(tr, models, batch, noise)
    d = pred - target
    want = (2 * 0.3 * (torch.sqrt(d**2 + 0.3**2) - 0.3)).mean() if kind == "huber" else d.abs().mean()
    with torch.no_grad():
        assert other.loss(models, batch).item() == pytest.approx(want.item(), rel=1e-5)
        assert tr.loss(models, batch).item() == pytest.approx((d**2).mean().item(), rel=1e-5)  # mse, the default


def test_pseudo_huber_is_mse_for_small_and_l1_for_large_residuals():
    small, large = torch.full((4,), 1e-3), torch.full((4,), 100.0)
    zero = torch.zeros(4)
    huber = elementwise_loss(small, zero, "huber", 0.1)
    torch.testing.assert_close(huber, small**2, rtol=1e-3, atol=0)  # 2c(sqrt(d^2+c^2)-c) = d^2 - d^4/4c^2 + ...
    torch.testing.assert_close(elementwise_loss(large, zero, "huber", 0.1), 2 * 0.1 * large - 2 * 0.1**2, rtol=1e-4, atol=0)
    # The default path is torch's own MSE, bit for bit (what keeps today's losses unchanged).
    a, b = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    assert torch.equal(diffusion_loss(a, b, LossConfig()), torch.nn.functional.mse_loss(a, b))


# ---- flow matching ----------------------------------------------------------------------------------
def test_logit_normal_sampling_has_the_normal_quantiles_in_logit_space():
    tr = trainer("trainer=flux", "loss.logit_mean=0.5", "loss.logit_std=1.5")
    z = torch.logit(tr.timesteps(torch.arange(20000, dtype=torch.int64)).double())
    for q in (0.05, 0.25, 0.5, 0.75, 0.95):  # sampling error of a quantile of 20 000 draws: < 0.02 here
        want = 0.5 + 1.5 * NormalDist().inv_cdf(q)
        assert torch.quantile(z, q).item() == pytest.approx(want, abs=0.08), q
    uniform = trainer("trainer=flux", "loss.timestep_sampling=uniform").timesteps(torch.arange(4000, dtype=torch.int64))
    for q in (0.1, 0.5, 0.9):
        assert torch.quantile(uniform.double(), q).item() == pytest.approx(q, abs=0.03)


def test_sd35_defaults_to_sd3s_fixed_shift_and_it_matches_the_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    seeds = torch.arange(64, dtype=torch.int64)
    unshifted = trainer("trainer=sd35", "loss.timestep_shift=none").timesteps(seeds)
    shifted = trainer("trainer=sd35").timesteps(seeds)
    torch.testing.assert_close(shifted, 3 * unshifted / (1 + 2 * unshifted), rtol=1e-6, atol=0)
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)  # SD3.5's scheduler config
    plain = torch.linspace(1, 1000, 1000).flip(0) / 1000
    torch.testing.assert_close(shift_timesteps(plain, 3.0), sched.sigmas[:1000].float(), rtol=1e-5, atol=1e-6)
    assert torch.equal(trainer("trainer=flux").timesteps(seeds), trainer("trainer=flux", "loss.timestep_shift=none")
                       .timesteps(seeds))  # Flux: no shift unless asked


@pytest.mark.parametrize("side", [512, 1024])
def test_resolution_shift_is_fluxs_mu_from_the_sequence_length(side):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    tr = trainer("trainer=flux", "loss.timestep_shift=resolution", f"data.resolution={side}")
    latents = tr.example_latents(1, "meta")
    seq = tr.image_seq_len(latents)
    assert seq == (side // 16) ** 2  # 2x2 tokens of the 8x VAE latents
    seeds = torch.arange(64, dtype=torch.int64)
    plain = trainer("trainer=flux").timesteps(seeds)
    mu = calculate_shift(seq, 256, 4096, 0.5, 1.15)
    want = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True).time_shift(mu, 1.0, plain)
    torch.testing.assert_close(tr.timesteps(seeds, seq), want, rtol=1e-5, atol=1e-6)
    assert (tr.timesteps(seeds, seq) > plain).all()  # more noise at a high resolution


# ---- every option together: per sample, so splits and resume stay exact ----------------------------
@pytest.mark.parametrize("overrides", [
    ["trainer=sd15", "loss.min_snr_gamma=5", "loss.noise_offset=0.1", "loss.type=huber"],
    ["trainer=sd35", "loss.logit_mean=0.3", "loss.timestep_shift=resolution", "loss.type=l1"],
], ids=["ddpm", "flow"])
def test_options_keep_the_loss_a_mean_over_samples(overrides):
    tr = trainer(*overrides)
    set_seed(0)
    models = prepare_models(tr.build_models("cpu"), tr.cfg.model, resolve(tr.cfg))
    batch = tr.example_batch(4, "cpu")
    with torch.no_grad():
        whole = tr.loss(models, batch).item()
        halves = [tr.loss(models, slice_batch(batch, i, i + 2)).item() for i in (0, 2)]
    assert math.isfinite(whole) and whole == pytest.approx(sum(halves) / 2, rel=1e-6)


# ---- where an option does not apply -----------------------------------------------------------------
@pytest.mark.parametrize("overrides, words", [
    (["trainer=flux", "loss.noise_offset=0.1"], ["loss.noise_offset=0.1", "DDPM", "flow-matching"]),
    (["trainer=sd35", "loss.min_snr_gamma=5"], ["loss.min_snr_gamma=5.0", "DDPM"]),
    (["trainer=sdxl", "loss.timestep_shift=fixed"], ["loss.timestep_shift='fixed'", "flow-matching"]),
    (["trainer=sd15", "loss.logit_std=2"], ["loss.logit_std=2.0", "flow-matching"]),
])
def test_an_option_of_the_other_objective_is_refused_naming_the_key(overrides, words):
    with pytest.raises(UserError) as e:
        trainer(*overrides)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_mode_plugins_lists_every_loss_option_with_its_default():
    text = format_plugin_list()
    for line in ("loss.type: str = 'mse'", "loss.huber_c: float = 0.1", "loss.noise_offset: float = 0.0",
                 "loss.min_snr_gamma: float = 0.0", "loss.timestep_sampling: Optional[str] = None",
                 "loss.logit_mean: float = 0.0", "loss.logit_std: float = 1.0",
                 "loss.timestep_shift: Optional[str] = None", "loss.shift: float = 3.0"):
        assert line in text, line
