"""The reference image of each sample prompt for an edit family (``sample.references``).

An edit model samples "prompt applied to a reference", so every prompt needs its reference:

* ``sample.references=[a.png, b.png]``: one image file per prompt, in order, resized (short side)
  to ``sample.resolution`` and centre-cropped square, as the sample is square;
* unset: prompt ``i`` takes the reference(s) of training sample ``i`` (modulo the data set's size), so a
  sample shows the trained edit on the data it learned from, resized (short side) to
  ``sample.resolution`` and centre-cropped square like a file. The data set's first samples are read
  once, at the start. Either way the reference has the sample's size, which is what the planner plans
  for the sampling pass (runner/plan/sampling.py: the example batch at ``sample.resolution``).

Refused before step 1 (:func:`check_references`): ``sample.references`` with a family that takes no
reference, a count that is not the prompts', or a trainer that takes more than one reference per
target (one file per prompt gives one). An unreadable file is refused when it is read, at the start,
naming it.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from runner.errors import UserError

log = logging.getLogger("runner")


def check_references(files: list[str], prompts: list[str], takes_references: bool, per_target: int, name: str) -> None:
    """``sample.references`` against the family and the prompts; a UserError naming the key."""
    if not files:
        return
    if not takes_references:
        raise UserError(f"sample.references is set, but {name} is not an edit model: its samples take no reference "
                        "image. Unset sample.references (or train an edit family, trainer=flux_kontext).")
    if len(files) != len(prompts):
        raise UserError(f"sample.references has {len(files)} file(s) for {len(prompts)} prompt(s): give one reference "
                        "image per prompt, in the prompts' order, or unset it (prompt i then takes training sample i's "
                        "reference).")
    if per_target != 1:
        raise UserError(f"sample.references gives one file per prompt, but data.references={per_target}. Unset "
                        "sample.references: each prompt then takes a training sample's references.")


def reference_pixels(trainer: Any, files: list[str], count: int, resolution: int) -> list[torch.Tensor]:
    """``[1, N, 3, H, W]`` reference pixels for each of ``count`` prompts (see the module docstring)."""
    from runner.data.images import _load_rgb, _resize_crop, _to_tensor

    if files:
        out = []
        for f in files:
            img = _resize_crop(_load_rgb(f, f, "sample.references"), resolution, True, 0)
            out.append(_to_tensor(img)[None, None])
        return out
    dataset = trainer.dataset()
    n = len(dataset)
    log.info("sample: prompt i takes the reference image(s) of training sample i (of %d); sample.references sets "
             "files instead", n)
    return [square(dataset[i % n]["references"], resolution).unsqueeze(0) for i in range(count)]


def square(pixels: torch.Tensor, resolution: int) -> torch.Tensor:
    """``[N, 3, H, W]`` -> ``[N, 3, R, R]``: the short side resized to ``resolution`` (antialiased
    bilinear), then the centre crop; unchanged when already that size."""
    h, w = pixels.shape[-2:]
    if (h, w) == (resolution, resolution):
        return pixels
    scale = resolution / min(h, w)
    size = (max(resolution, round(h * scale)), max(resolution, round(w * scale)))
    out = torch.nn.functional.interpolate(pixels, size=size, mode="bilinear", antialias=True, align_corners=False)
    top, left = (size[0] - resolution) // 2, (size[1] - resolution) // 2
    return out[..., top:top + resolution, left:left + resolution].contiguous()
