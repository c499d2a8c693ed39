"""The masked loss (``data.masks``; runner/loss/objectives.py ``masked_mean``) against sums done by hand,
in the helper and in the built-in trainers (tiny SD1.5 and Flux on the CPU), and end to end on the
command line with the demo set's masks, cached and not.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed

from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.loss.objectives import LossConfig, ddpm_noise, diffusion_loss
from runner.resolved import resolve
from runner.trainer import slice_batch

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_masked_loss_is_each_samples_weighted_mean_then_the_batch_mean():
    pred = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]], [[0.0, 1.0], [1.0, 0.0]]],
                         [[[2.0, 2.0], [2.0, 2.0]], [[1.0, 1.0], [1.0, 1.0]]]])  # [2, 2, 2, 2]
    target = torch.zeros_like(pred)
    mask = torch.tensor([[[[1.0, 0.0], [0.5, 0.0]]], [[[0.0, 0.0], [0.0, 0.25]]]])  # [2, 1, 2, 2]
    # sample 0: channel 0 squares 1, 9 (x0.5); channel 1 squares 0, 1 (x0.5) -> (1 + 4.5 + 0 + 0.5) / (2 * 1.5) = 2
    # sample 1: only the last pixel, squares 4 and 1, weight 0.25 each -> (1 + 0.25) / 0.5 = 2.5
    got = diffusion_loss(pred, target, LossConfig(), mask=mask)
    assert got.item() == pytest.approx((2.0 + 2.5) / 2, rel=1e-6)
    weights = torch.tensor([1.0, 3.0])  # with per-sample weights (Min-SNR): each sample's mean times its weight
    assert diffusion_loss(pred, target, LossConfig(), weights, mask).item() == pytest.approx((2.0 + 7.5) / 2, rel=1e-6)
    l1 = diffusion_loss(pred, target, LossConfig(type="l1"), mask=mask).item()
    assert l1 == pytest.approx(((1 + 1.5 + 0 + 0.5) / 3 + (0.5 + 0.25) / 0.5) / 2, rel=1e-6)
    # an all-ones mask is the plain loss; a sample masked to zero adds 0, never NaN
    assert diffusion_loss(pred, target, LossConfig(), mask=torch.ones(2, 1, 2, 2)).item() == pytest.approx(
        (pred ** 2).mean().item(), rel=1e-6)
    zero = mask.clone()
    zero[1] = 0
    assert diffusion_loss(pred, target, LossConfig(), mask=zero).item() == pytest.approx(2.0 / 2, rel=1e-6)


def build(*overrides: str):
    cfg = compose_config([*overrides, "train.device=cpu", "data.masks=true"])
    validate(cfg)
    tr = build_trainer(cfg, resolve(cfg))
    set_seed(0)
    return tr, prepare_models(tr.build_models("cpu"), tr.cfg.model, resolve(tr.cfg))


def test_sd15_loss_is_the_mask_weighted_mean_by_hand():
    tr, models = build("trainer=sd15")
    batch = tr.with_example_mask(tr.example_batch(3, "cpu"))
    lh, lw = batch["latents"].shape[-2:]
    mask = torch.zeros(3, 1, lh, lw)
    mask[0, :, : lh // 2] = 1.0  # top half
    mask[1, :, :, : lw // 3] = 0.5  # a left strip, half weight
    mask[2] = torch.rand(1, lh, lw, generator=torch.Generator().manual_seed(0))
    batch["loss_mask"] = mask
    noise = ddpm_noise(batch["sample_seed"], tuple(batch["latents"].shape[1:]), "cpu", LossConfig())
    x0 = batch["latents"].float()
    sched = tr.scheduler(torch.device("cpu"))
    t = tr.timesteps(batch["sample_seed"], "cpu")
    with torch.no_grad():
        pred = tr.predict(models, sched.add_noise(x0, noise, t), t, batch).float()
        loss = tr.loss(models, batch).item()
        unmasked = tr.loss(models, {k: v for k, v in batch.items() if k != "loss_mask"}).item()
        halves = [tr.loss(models, slice_batch(batch, i, i + 1)).item() for i in range(3)]
    sq = (pred - noise) ** 2
    m = mask.expand_as(sq)
    want = torch.stack([(sq[b] * m[b]).sum() / m[b].sum() for b in range(3)]).mean().item()
    assert loss == pytest.approx(want, rel=1e-5)
    assert loss != pytest.approx(unmasked, rel=1e-3)  # the mask is applied
    assert loss == pytest.approx(sum(halves) / 3, rel=1e-6)  # per sample: any split gives the same step


def test_flux_packs_the_mask_as_its_target():
    tr, models = build("trainer=flux")
    batch = tr.with_example_mask(tr.example_batch(2, "cpu"))
    ones = dict(batch, loss_mask=torch.ones_like(batch["loss_mask"]))
    plain = {k: v for k, v in batch.items() if k != "loss_mask"}
    with torch.no_grad():
        assert tr.loss(models, ones).item() == pytest.approx(tr.loss(models, plain).item(), rel=1e-6)
        whole = tr.loss(models, batch).item()
        assert whole != pytest.approx(tr.loss(models, plain).item(), rel=1e-4)
        assert whole == pytest.approx(sum(tr.loss(models, slice_batch(batch, i, i + 1)).item() for i in range(2)) / 2,
                                      rel=1e-6)


def run_cli(tmp: Path, *overrides: str) -> list[float]:
    cmd = [sys.executable, "-m", "runner", "model.train=lora", "data.masks=true", "train.steps=3",
           f"output_dir={tmp}", "train.progress=false", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines if '"loss"' in x and json.loads(x).get("step")]


def test_cli_masked_runs_cached_and_not_give_the_same_losses(tmp_path):
    plain = run_cli(tmp_path / "plain", "data.random_flip=true")
    cached = run_cli(tmp_path / "cached", "data.random_flip=true", "offload=park",
                     f"offload.park.cache_dir={tmp_path / 'cache'}")
    assert len(plain) == 3 and cached == plain
    unmasked = run_cli(tmp_path / "unmasked", "data.random_flip=true", "data.masks=false")
    assert unmasked != plain  # the masks change what is trained
    entries = list((tmp_path / "cache" / "latents").rglob("*.safetensors"))
    assert len(entries) == 32  # 16 demo images x 2 orientations, each with its latent mask


# ---- prior preservation: loss.prior_weight on the samples of a prior (class) set ---------------------
@pytest.mark.parametrize("overrides", [["trainer=sd15"], ["trainer=sd15", "loss.min_snr_gamma=5"], ["trainer=flux"]],
                         ids=["ddpm", "ddpm_min_snr", "flow"])
def test_the_prior_weight_multiplies_exactly_the_prior_samples_loss(overrides):
    tr, models = build(*overrides, "data.demo_prior=2", "loss.prior_weight=0.25")
    plain, _ = build(*overrides)  # the same loss options, weight 1 (the models are the same: seed 0)
    batch = tr.with_example_mask(tr.example_batch(3, "cpu"))
    batch["prior"] = torch.tensor([False, True, False])
    unflagged = {k: v for k, v in batch.items() if k != "prior"}
    with torch.no_grad():
        per_sample = [plain.loss(models, slice_batch(unflagged, i, i + 1)).item() for i in range(3)]
        got = tr.loss(models, batch).item()
        assert tr.loss(models, unflagged).item() == pytest.approx(sum(per_sample) / 3, rel=1e-5)  # no flags: weight 1
    assert got == pytest.approx((per_sample[0] + 0.25 * per_sample[1] + per_sample[2]) / 3, rel=1e-5)


@pytest.mark.parametrize("family", ["sdxl", "sd35", "qwen_image"])
def test_every_image_family_encodes_the_mask_onto_its_latent_grid(family):
    tr, models = build(f"trainer={family}", "data.resolution=32")
    raw = tr.example_raw_batch(2, "cpu")
    raw["mask"] = torch.zeros(2, 1, 32, 32)
    raw["mask"][:, :, :, :8] = 1.0  # the left quarter
    with torch.no_grad():
        batch = tr.encode(models, raw)
        lat = batch["latents"]
        assert tuple(batch["loss_mask"].shape) == (2, 1, *lat.shape[-2:])
        side = lat.shape[-1]
        want = torch.zeros(2, 1, *lat.shape[-2:])
        want[..., : side // 4] = 1.0  # area-averaged: whole latent cells
        assert torch.equal(batch["loss_mask"], want)
        ones = tr.loss(models, dict(batch, loss_mask=torch.ones_like(want))).item()
        plain = tr.loss(models, {k: v for k, v in batch.items() if k != "loss_mask"}).item()
        assert ones == pytest.approx(plain, rel=1e-6) and tr.loss(models, batch).item() != pytest.approx(plain, rel=1e-4)
