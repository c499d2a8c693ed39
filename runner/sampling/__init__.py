"""Samples during training (``sample.every=N``): images at the start, every N steps and at the end.

``python -m runner sample.every=100 sample.prompts='[a photo of a cat, a red car]'`` writes
``samples/step-N/00-a-photo-of-a-cat.png`` ... under the run's output folder, with
``samples/prompts.json`` saying which prompt, seed, steps, guidance and resolution made them.
Image i is drawn from ``sample.seed + i`` at every step, so images of one prompt differ only by
what training changed.

Built once by :func:`build_sampler` (a :class:`NoSampler` when ``sample.every=0``), before the
plugins' setup phases; the loop calls ``maybe_sample(step)`` at the start and after each step.

How sampling stays inside the memory budget of the training run
----------------------------------------------------------------
* **Prompts are encoded once, before any plugin runs**, with the trainer's own
  ``encode_part(models, "text", ...)`` (the conditioning training uses), one prompt at a time;
  each text encoder visits the device only for its own call (forward hooks move it in and back).
  The embeddings stay on the host. Trade-off: ``offload=park`` may then drop the encoders
  (every caption cached), and the samples still have their conditioning, without the encoders
  ever coming back; but the prompts are fixed for the run, and are encoded by the encoders as
  built, before ``quantization`` (if any) changes them.
* **The denoiser** samples where training left it (on the device, streamed, checkpointed), under
  ``no_grad`` and the run's autocast, one prompt at a time (batch 1, or 2 with SDXL's
  classifier-free guidance): its activations are those of a forward without grad, well below a
  training step's, which also holds gradients and saved activations.
* **The VAE** decodes on the device and is brought there only for the decode when it lives on
  the host. When ``offload=park`` drops the VAE (every latent cached), the sampler keeps a
  reference to it, so it stays on the host (its weights, ~160 MB in bf16 for SDXL/Flux, stay in
  host RAM) instead of being freed; it never stays on the device. It is the module object
  ``tiling=vae`` tiled, so the decode is tiled when tiling is on.
* The planner plans this pass too (:mod:`runner.plan.sampling`) and reports its peak beside the
  training step's.

Sampling changes nothing in training: ``no_grad``; every module's train/eval flags restored; the
global RNG states (CPU and CUDA) forked and restored; each image's noise comes from its own
generator. Losses with and without sampling are bit-identical (tests/runner/sampling/test_sampling.py).
An out-of-memory error while sampling is logged and the samples of that step are skipped: a
sample must never cost the training run. ``sample.use_ema=true`` samples with the EMA of the
trained weights (runner/ema/average.py): they are copied into the trained parameters for the pass and
the trained values copied back exactly after it (backed up in host RAM meanwhile).

A user's trainer may implement ``sample(models, prompts, *, steps, guidance, seed, resolution,
negative_prompt)`` returning one PIL image per prompt; it is called with the models as the
plugins left them (with ``offload=park``, its encoders may have been dropped: set
``offload.park.cache_text=false`` to keep them parked instead).

The package imports nothing heavy itself: ``runner.sampling.config`` (the ``sample`` schema and
its checks) is read during validation, before torch is imported. The sampler and its helpers
(:mod:`runner.sampling.sampler`) load on first use of the names below.
"""
from __future__ import annotations

from typing import Any

from runner.sampling.config import SampleConfig, check_sample_config, read_prompts

__all__ = ["NoSampler", "SampleConfig", "Sampler", "build_sampler", "check_sample_config", "read_prompts",
           "vae_on_device"]

_LAZY = ("NoSampler", "Sampler", "build_sampler", "vae_on_device", "image_name", "on_device_per_call", "SAMPLES_DIR")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from runner.sampling import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module 'runner.sampling' has no attribute {name!r}")
