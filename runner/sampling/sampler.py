"""The sampler itself (the package docstring, runner/sampling/__init__.py, says what it does and how it
stays inside the budget): prompts encoded once, images at the start, every ``sample.every`` steps and at
the end."""
from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from runner.errors import UserError
from runner.optim.modes import at_evaluation_point
from runner.sampling.config import SampleConfig, check_sample_config, read_prompts
from runner.sampling.pipelines import family_sampling

if TYPE_CHECKING:
    from runner.context import RunContext

__all__ = ["NoSampler", "SampleConfig", "Sampler", "build_sampler", "check_sample_config", "read_prompts",
           "vae_on_device"]

log = logging.getLogger("runner")

SAMPLES_DIR = "samples"


class NoSampler:
    """``sample.every=0``: the loop's calls do nothing."""

    def maybe_sample(self, step: int) -> None:
        pass


def image_name(index: int, prompt: str) -> str:
    """``00-a-photo-of-a-cat.png``: the prompt's index, then a file-safe slug of its start."""
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:40].rstrip("-")
    return f"{index:02d}-{slug or 'prompt'}.png"


@contextmanager
def on_device_per_call(modules: list[nn.Module], device: torch.device, host: torch.device) -> Iterator[None]:
    """Each module moves to ``device`` for each of its calls and back to ``host`` after it.

    Only one module is then on the device at a time. Plain forward hooks suffice here (text
    encoders are called through ``__call__``). Moving back is a device-to-host copy, a one-off
    cost at start; nothing to do when the device is the host.
    """
    if device.type == host.type:
        yield
        return
    handles = []
    for m in modules:
        handles.append(m.register_forward_pre_hook(lambda mod, args: mod.to(device)))
        handles.append(m.register_forward_hook(lambda mod, args, out: mod.to(host)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for m in modules:  # a call that raised skipped its forward hook
            m.to(host)


@contextmanager
def vae_on_device(vae: nn.Module, ctx: RunContext, track: Callable[[nn.Module], Any] | None = None) -> Iterator[None]:
    """The VAE on the run's device for one decode.

    A no-op when it is there already, or parked (the park plugin moves a parked VAE in per call
    itself); otherwise (on the host: kept by the sampler after ``offload=park`` dropped it) it is
    moved in and back out after the decode. ``track``: the planner's hook to label the copy.
    """
    on_device = next(vae.parameters()).device.type == ctx.device.type
    if on_device or any(ctx.models.modules.get(n) is vae for n in ctx.facts.parked):
        yield
        return
    vae.to(ctx.device)
    if track is not None:
        track(vae)
    try:
        yield
    finally:
        vae.to(ctx.host)


class Sampler:
    """Images from fixed prompts at chosen steps; see the module docstring for the memory policy."""

    def __init__(self, ctx: RunContext, config: Any, prompts: list[str]) -> None:
        self.ctx = ctx
        self.config = config
        self.every = int(config.every)
        self.total_steps = int(ctx.cfg.train.steps)
        self.prompts = prompts
        self.steps = int(config.steps)
        self.seed = int(config.seed)
        self.resolution = int(config.resolution) if config.resolution is not None else int(ctx.cfg.data.resolution)
        self.use_ema = bool(config.get("use_ema", False))
        self.negative_prompt = None if config.negative_prompt is None else str(config.negative_prompt)
        trainer = ctx.trainer
        self.user_sample = getattr(trainer, "sample", None) if callable(getattr(trainer, "sample", None)) else None
        self.family: Any = None if self.user_sample else family_sampling(trainer)
        if self.user_sample is None and self.family is None:
            raise UserError(
                f"sample.every={self.every} asks for samples, but trainer {type(trainer).__name__} has no sample(models, "
                "prompts, *, steps, guidance, seed, resolution, negative_prompt) method, and only the built-in SDXL and "
                "Flux trainers sample without one. Add the method (runner/sampling/__init__.py) or set sample.every=0."
            )
        # Unset: the family's usual scale; a user's sample() gets None and chooses its own.
        default_guidance = self.family.default_guidance if self.family else None
        self.guidance = float(config.guidance) if config.guidance is not None else default_guidance
        self.cond: list[dict[str, torch.Tensor]] = []
        self.negative: dict[str, torch.Tensor] | None = None
        self.kept: dict[str, nn.Module] = {}
        self.done: set[int] = set()
        self.root = Path(ctx.output_dir) / SAMPLES_DIR
        if self.family is not None:
            self._check_family()
            self._encode_prompts()
            if getattr(self.family, "takes_references", False):
                self._encode_references()
            # kept on the host even if offload=park drops them: the VAE, and what else the family decodes with
            self.kept = {name: ctx.models[name] for name in getattr(self.family, "kept_modules", ("vae",))
                         if name in ctx.models}

    # ---- setup -------------------------------------------------------------------------------
    def _check_family(self) -> None:
        fam, name = self.family, type(self.ctx.trainer).__name__
        if self.resolution % fam.factor:
            raise UserError(
                f"sample.resolution={self.resolution} is not usable for {name}: it must be a multiple of {fam.factor} "
                f"(e.g. {max(fam.factor, self.resolution // fam.factor * fam.factor)}); unset, it is data.resolution."
            )
        from runner.sampling.references import check_references

        per_target = getattr(fam, "references_per_prompt", None)  # Wan I2V: one start image, no data.references
        check_references([str(f) for f in self.config.get("references", None) or []], self.prompts,
                         bool(getattr(fam, "takes_references", False)),
                         int(per_target if per_target is not None else getattr(self.ctx.trainer, "references", 0)), name)
        if self.negative_prompt is not None and not fam.negative_prompt:
            raise UserError(
                f"sample.negative_prompt is set, but {name} samples a guidance-distilled model (Flux), which has no "
                "classifier-free guidance to use it; unset sample.negative_prompt (sample.guidance sets the "
                "distilled guidance)."
            )

    @torch.no_grad()
    def _encode_references(self) -> None:
        """An edit family: each prompt's reference latents (runner/sampling/references.py), encoded once
        with the VAE before any plugin can drop it, kept on the host beside the prompt's embeddings."""
        from runner.sampling.references import reference_pixels

        ctx, trainer = self.ctx, self.ctx.trainer
        files = [str(f) for f in self.config.get("references", None) or []]
        # A family may read its own pixels (Wan I2V: a start image at the clip size, or a clip's first frame).
        pixels = getattr(self.family, "reference_pixels", reference_pixels)(trainer, files, len(self.prompts),
                                                                            self.resolution)
        # A family whose text encoder sees the reference (Qwen-Image-Edit) encodes each prompt, and the
        # negative prompt, with its reference here: the text encoders come to the device per call too, as
        # do the modules a family names for its reference (Wan 2.1 I2V's image encoder).
        sees = bool(getattr(self.family, "text_sees_reference", False))
        encoders = [ctx.models[m] for m in trainer.encode_parts()["text"].modules if m in ctx.models] if sees else []
        own = getattr(self.family, "reference_encoders", None)
        encoders += [ctx.models[m] for m in (own(trainer) if callable(own) else ()) if m in ctx.models]
        negative = self.negative_prompt if self.negative_prompt is not None else self.family.default_negative(self.guidance)
        with vae_on_device(ctx.models["vae"], ctx), on_device_per_call(encoders, ctx.device, ctx.host), \
                ctx.accelerator.autocast():
            for prompt, cond, ref in zip(self.prompts, self.cond, pixels):
                kw = {"prompt": prompt, "negative": negative} if sees else {}
                cond.update(self.family.encode_reference(trainer, ctx.models, ref, ctx.device, **kw))

    @torch.no_grad()
    def _encode_prompts(self) -> None:
        """Every prompt's embeddings, on the host, before any plugin can drop the text encoders."""
        ctx, trainer, models = self.ctx, self.ctx.trainer, self.ctx.models
        encoders = [models[m] for m in trainer.encode_parts()["text"].modules if m in models]
        t0 = time.perf_counter()
        with on_device_per_call(encoders, ctx.device, ctx.host), ctx.accelerator.autocast():
            self.cond = [self.family.encode(trainer, models, p, ctx.device) for p in self.prompts]
            negative = self.negative_prompt
            if negative is None:  # the unconditional prompt a guided pipeline would encode itself ("")
                negative = self.family.default_negative(self.guidance)
            if negative is not None:
                self.negative = self.family.encode(trainer, models, negative, ctx.device)
        log.info("sample: %d prompt(s) encoded once and kept on the host (%.1f s); images every %d steps, at the "
                 "start and at the end, in %s", len(self.prompts), time.perf_counter() - t0, self.every, self.root)

    # ---- the loop's side ---------------------------------------------------------------------
    def maybe_sample(self, step: int) -> None:
        """Sample at the first call (the run's start, or the resumed step), every N steps and at the end."""
        due = not self.done or step % self.every == 0 or step == self.total_steps
        if not due or step in self.done:
            return
        if not self.done and "vae" in self.kept and "vae" not in self.ctx.models:
            log.info("sample: a plugin (offload=park) dropped the VAE from training; the sampler keeps it on the "
                     "host for its decodes")
        self.done.add(step)
        try:
            with at_evaluation_point(self.ctx.optimizer):  # schedule-free: its evaluated weights, then back exactly
                self.sample(step)
        except torch.OutOfMemoryError as e:
            log.warning("sample: out of device memory while sampling at step %d (%s); no samples for this step, "
                        "training goes on. Lower sample.resolution, or use tiling=vae for the decode.",
                        step, str(e).splitlines()[0])

    def sample(self, step: int) -> list[Path]:
        """Write ``samples/step-<step>/`` now; training state (grad mode, train flags, RNG) untouched.

        Several processes: with FSDP every rank runs the pipeline (the sharded denoiser's forward
        needs all of them) and rank 0 writes the images; with DDP rank 0 samples alone."""
        dist = self.ctx.run.dist
        if not dist.is_main and not dist.sharded:
            return []
        out = self.root / f"step-{step}"
        if dist.is_main:
            out.mkdir(parents=True, exist_ok=True)
            self._write_settings()
        modules = self.modules()
        flags = [(m, m.training) for module in modules.values() for m in module.modules()]
        devices = [self.ctx.device] if self.ctx.device.type == "cuda" else []
        t0 = time.perf_counter()
        paths = []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad(), self.ctx.accelerator.autocast(), \
                    (self.ctx.ema.applied() if self.use_ema else nullcontext()):  # sample.use_ema: swapped in and back
                for module in modules.values():
                    module.eval()
                images = self._images(modules)
        finally:
            for m, training in flags:
                m.training = training
        if not dist.is_main:
            return []
        for i, (prompt, image) in enumerate(zip(self.prompts, images)):
            path = out / image_name(i, prompt)
            image.save(path)
            paths.append(path)
        # log.tracker: the samples beside the loss curve (a clip by its first frame); a no-op without a tracker
        self.ctx.tracking.log_images(step, {f"sample/{path.stem}": getattr(image, "frames", [image])[0]
                                            for path, image in zip(paths, images)})
        log.info("sample: step %d, %d image(s) in %s (%.1f s)", step, len(paths), out, time.perf_counter() - t0)
        return paths

    def _images(self, modules: dict[str, nn.Module]) -> list[Any]:
        if self.user_sample is not None:
            images = list(self.user_sample(self.ctx.models, list(self.prompts), steps=self.steps, guidance=self.guidance,
                                           seed=self.seed, resolution=self.resolution,
                                           negative_prompt=self.negative_prompt))
            if len(images) != len(self.prompts) or not all(callable(getattr(im, "save", None)) for im in images):
                raise UserError(
                    f"{type(self.ctx.trainer).__name__}.sample returned {len(images)} item(s) for {len(self.prompts)} "
                    "prompt(s); it must return one PIL image per prompt, in order."
                )
            return images
        images = []
        for i, cond in enumerate(self.cond):
            generator = torch.Generator("cpu").manual_seed(self.seed + i)  # the same noise on any device
            images.append(self.family.generate(
                self.ctx.trainer, modules, cond, self.negative, steps=self.steps, guidance=self.guidance,
                resolution=self.resolution, generator=generator, device=self.ctx.device,
                vae_on_device=lambda: vae_on_device(modules["vae"], self.ctx)))
        return images

    def modules(self) -> dict[str, nn.Module]:
        """The run's modules as the plugins left them, plus the VAE kept for sampling if it was dropped."""
        out = dict(self.ctx.models.items())
        for name, module in self.kept.items():
            out.setdefault(name, module)
        return out

    def _write_settings(self) -> None:
        path = self.root / "prompts.json"
        if path.exists():
            return
        settings = {"prompts": self.prompts, "negative_prompt": self.negative_prompt, "steps": self.steps,
                    "guidance": self.guidance, "resolution": self.resolution,
                    "weights": "ema" if self.use_ema else "trained",
                    "seeds": [self.seed + i for i in range(len(self.prompts))],
                    "files": [image_name(i, p) for i, p in enumerate(self.prompts)]}
        path.write_text(json.dumps(settings, indent=2) + "\n")


def build_sampler(ctx: RunContext) -> Sampler | NoSampler:
    """The run's sampler, from ``cfg.sample``; call before ``ctx.apply_setup_phases()`` (see above).

    Needs ``ctx.cfg``, ``ctx.trainer``, ``ctx.models`` (prepared, not yet touched by a plugin),
    ``ctx.accelerator`` and ``ctx.output_dir``.
    """
    c = ctx.cfg.get("sample") if ctx.cfg is not None else None
    if c is None or int(c.every) == 0:
        return NoSampler()
    check_sample_config(ctx.cfg)
    return Sampler(ctx, c, read_prompts(c))
