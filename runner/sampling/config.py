"""``sample.*``: the settings of samples during training, and their checks.

Kept apart from the sampler so that ``runner/config/__init__.py`` (the root schema) imports a plain
dataclass, not torch or diffusers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from runner.errors import UserError


@dataclass
class SampleConfig:
    """``sample.every=N``: images from fixed prompts at the start, every N steps and at the end.

    ``every=0`` (the default) turns sampling off: the runner then uses a no-op sampler.
    """

    every: int = 0  # optimizer steps between samples; 0 = no samples at all
    prompts: list[str] = field(default_factory=list)  # the prompts (or prompts_file, not both)
    prompts_file: Optional[str] = None  # a text file, one prompt a line; blank lines and '#' lines skipped
    negative_prompt: Optional[str] = None  # SDXL only (Flux is guidance-distilled)
    steps: int = 20  # denoising steps per image
    guidance: Optional[float] = None  # SDXL: classifier-free guidance (default 5.0); Flux: distilled guidance (3.5)
    seed: int = 0  # image i is drawn from seed + i, the same at every step, so images compare across steps
    resolution: Optional[int] = None  # px, square; default: data.resolution
    references: list[str] = field(default_factory=list)  # edit families: one reference image per prompt; [] = training sample i's
    use_ema: bool = False  # sample with the EMA weights (needs ema.enabled; swapped in for the pass and back exactly)


def read_prompts(c: Any) -> list[str]:
    """The prompts of ``sample.prompts`` or the lines of ``sample.prompts_file``."""
    if c.prompts_file is None:
        return [str(p) for p in c.prompts]
    path = Path(str(c.prompts_file)).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(
            f"sample.prompts_file={str(c.prompts_file)!r} cannot be read ({type(e).__name__}: {e}). Give a UTF-8 "
            "text file with one prompt a line, or list the prompts in sample.prompts=[...]."
        ) from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def check_sample_config(cfg: Any) -> None:
    """Values of ``sample.*`` that the schema cannot check; a UserError naming the key.

    Reads the prompts file, so that a missing file stops the run before any model is built.
    """
    c = cfg.get("sample")
    if c is None:
        return
    if int(c.every) < 0:
        raise UserError(f"sample.every={c.every} is not valid: give the number of optimizer steps between "
                        "samples (e.g. 100), or 0 for no samples.")
    if int(c.every) == 0:
        return
    ema = cfg.get("ema")
    if c.get("use_ema", False) and (ema is None or not ema.enabled):
        raise UserError("sample.use_ema=true samples with the EMA of the trained weights, but ema.enabled=false: set "
                        "ema.enabled=true (runner/ema/average.py), or sample.use_ema=false to sample the trained weights.")
    if c.prompts and c.prompts_file is not None:
        raise UserError("sample.prompts and sample.prompts_file are both set: give the prompts one way, "
                        "a list (sample.prompts=['a cat','a dog']) or a file with one prompt a line.")
    if not read_prompts(c):
        where = (f"sample.prompts_file={str(c.prompts_file)!r} has no prompt line" if c.prompts_file is not None
                 else "sample.prompts is empty")
        raise UserError(f"sample.every={c.every} asks for samples, but {where}. Give at least one prompt, "
                        "e.g. sample.prompts='[a photo of a cat]', or set sample.every=0.")
    if int(c.steps) < 1:
        raise UserError(f"sample.steps={c.steps} is not valid: give the number of denoising steps, at least 1 (e.g. 20).")
    if c.guidance is not None and float(c.guidance) < 0:
        raise UserError(f"sample.guidance={c.guidance} is not valid: give a scale >= 0 (e.g. 5.0 for SDXL, 3.5 for "
                        "Flux), or leave it unset for the family's default.")
    if c.resolution is not None and int(c.resolution) <= 0:
        raise UserError(f"sample.resolution={c.resolution} is not valid: give a side in pixels (e.g. 1024), or leave "
                        "it unset to sample at data.resolution.")


def check_sample_multiple(c: Any, multiple: int, family: str) -> None:
    """``sample.resolution`` must be a multiple of the family's pixel multiple (VAE factor x latent packing),
    checked before the plan draws a sample at it."""
    if c is None or int(c.get("every", 0)) == 0 or c.get("resolution") is None:
        return
    res = int(c.resolution)
    if res > 0 and res % multiple:
        raise UserError(f"sample.resolution={res} is not usable for {family}: it must be a multiple of {multiple} "
                        f"(e.g. {max(multiple, res // multiple * multiple)}); unset, it is data.resolution.")
