"""The planner's view of sampling: the peak of one sampling pass, beside the training step's.

The simulated pass runs after the simulated optimizer step, so that what lives between steps
(weights, optimizer state; gradients are freed) is live during it, as in a run, and consists of

* **one denoiser forward without grad** at ``sample.resolution``: the trainer's own ``loss`` on
  its ``example_batch`` at that resolution under ``no_grad`` (a forward plus a few latent-sized
  tensors), with the pipeline's batch (2 for SDXL with classifier-free guidance, else 1). One
  call and not ``sample.steps`` of them because each denoising step's activations are freed
  before the next one; the loop's own tensors (latents, noise prediction) are latent-sized;
* **one VAE decode** of a latent at that resolution, on the device as the sampler decodes (moved
  in from the host when ``offload=park`` dropped it from training; through park's per-call move
  when parked), tiled when ``tiling=vae`` tiled the module.

Not planned: the prompt encode at start, which runs before the denoiser is on the device, one
text encoder at a time (below the park pre-pass's peak, which the setup phase plans). A user's
own ``trainer.sample`` is planned as the denoiser forward at batch 1 (its code is not known).

The result goes into ``Plan.sampling`` (plan.json) and a line of the table, and the ``sample``
phase joins ``Plan.phases``: the plan's peak and its fit check are the larger of the two, since
a run that fits its training step must not run out of memory while sampling.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from omegaconf import OmegaConf

from runner.sampling import vae_on_device
from runner.sampling.pipelines import family_sampling

PHASE = "sample"


class NoSamplingPlan:
    """``sample.every=0``: nothing to plan."""

    def simulate(self) -> None:
        pass

    def report(self, plan: Any) -> None:
        pass


class SamplingPlan:
    """Create before the simulation's setup (it keeps the VAE, as the sampler does), then
    :meth:`simulate` after the optimizer step and :meth:`report` on the assembled plan."""

    def __init__(self, sim: Any, config: Any) -> None:
        self.sim = sim
        trainer = sim.trainer
        self.family = None if callable(getattr(trainer, "sample", None)) else family_sampling(trainer)
        self.resolution = int(config.resolution) if config.resolution is not None else int(sim.cfg.data.resolution)
        guidance = float(config.guidance) if config.guidance is not None else (
            self.family.default_guidance if self.family else 1.0)
        self.batch = self.family.denoiser_batch(guidance) if self.family else 1
        self.vae = sim.models["vae"] if self.family is not None and "vae" in sim.models else None
        self.between_steps = 0  # device bytes live between steps (weights, optimizer state)
        self.vae_tiled = False  # read during the pass: teardown undoes tiling before the report

    def simulate(self) -> None:
        self.sim.timed(PHASE, self._run)

    def _trainer_at_resolution(self) -> Any:
        """A shallow copy of the (already isolated) trainer whose ``data.resolution`` is the sample's."""
        twin = copy.copy(self.sim.trainer)
        cfg = copy.deepcopy(twin.cfg)
        OmegaConf.update(cfg, "data.resolution", self.resolution, force_add=True)
        OmegaConf.update(cfg, "data.buckets", False, force_add=True)  # samples are square: no bucket, no set size
        OmegaConf.update(cfg, "data.sets", [], force_add=True)
        twin.cfg = cfg
        return twin

    def _run(self) -> None:
        # Imported here: runner.plan imports this module (simulate.py), so a top-level import of
        # runner.plan would be circular when this module is imported first.
        from runner.plan.batch import example_batch, fake_batch, move_batch
        from runner.plan.target import DEVICE, HOST
        from runner.plan.known_values import known_values

        sim = self.sim
        tracker, ctx = sim.tracker, sim.ctx
        trainer = self._trainer_at_resolution()
        tracker.reset_peaks()  # from what lives between steps: the optimizer step's gradients are freed now
        self.between_steps = tracker.current_bytes(DEVICE.type)
        with known_values():  # masks keep their values from the move to the loss (runner/plan/known_values.py)
            batch = move_batch(fake_batch(example_batch(trainer, False, self.batch), HOST), DEVICE)
            tracker.track(batch, "other", module="(batch)")
            with tracker.phase(PHASE, category="activations"), torch.no_grad(), ctx.accelerator.autocast():
                with tracker.phase("denoise", category="activations"):
                    trainer.loss(ctx.models, batch)
                del batch
            if self.vae is not None:
                self._decode()
        sim.recorder.take(PHASE)

    def _decode(self) -> None:
        from runner.plan.target import DEVICE

        vae, tracker = self.vae, self.sim.tracker
        c = vae.config
        shape_of = getattr(self.family, "decode_shape", None)  # video VAEs: (1, C, frames, h, w)
        if callable(shape_of):
            shape = tuple(shape_of(self.sim.trainer, self.resolution))
        else:
            side = self.resolution // 2 ** (len(c.block_out_channels) - 1)
            shape = (1, int(c.latent_channels), side, side)
        dtype = next(vae.parameters()).dtype
        self.vae_tiled = bool(getattr(vae, "use_tiling", False))
        with tracker.phase("decode", category="activations"):
            latents = torch.empty(shape, dtype=dtype, device=DEVICE)
            track = lambda m: tracker.track(m, "weights", module="vae")  # noqa: E731 - the device copy is weights
            with vae_on_device(vae, self.sim.ctx, track=track):
                vae.decode(latents, return_dict=False)

    def report(self, plan: Any) -> None:
        peak = plan.phases.get(PHASE)
        if peak is None:
            return
        train_peak = max((v for k, v in plan.phases.items() if k != PHASE), default=0)
        plan.sampling = {
            "peak_bytes": peak,
            "training_step_peak_bytes": train_peak,
            "between_steps_bytes": self.between_steps,  # of peak_bytes: what lives anyway; the rest is sampling's
            "resolution": self.resolution,
            "denoiser_batch": self.batch,
            "vae_decode": self.vae is not None,
            "vae_tiled": self.vae_tiled,
        }


def plan_sampling(sim: Any) -> SamplingPlan | NoSamplingPlan:
    """The sampling pass of ``sim``'s run (``cfg.sample``), or a no-op when sampling is off."""
    c = sim.cfg.get("sample") if hasattr(sim.cfg, "get") else None
    if c is None or int(c.every) == 0:
        return NoSamplingPlan()
    return SamplingPlan(sim, c)
