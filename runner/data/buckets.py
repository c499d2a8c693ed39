"""Aspect-ratio buckets: which output size each image trains at (``data.buckets=true``).

Why: a square center crop of a 2:3 portrait throws away a third of it and teaches the model
that heads are cut off. With buckets every image keeps (nearly) its own aspect ratio at about
the same pixel count, and each step's batch is drawn from one bucket, so its tensors stack.

The bucket list (kohya sd-scripts' ``make_bucket_resolutions``): the target area is
``data.resolution`` squared; sides are multiples of ``data.bucket_step`` (64 px by default);
for every width from ``bucket_min_side`` to ``bucket_max_side`` in steps, the tallest height
that keeps the area within the target (and within the side limits) makes a bucket, and its
transpose another; the largest square that fits the area is always one. Defaults for the side
limits: half and twice ``data.resolution`` (512..2048 px at 1024).

Assignment: each image goes to the bucket whose aspect ratio is nearest its own, measured as
``|log(w/h) - log(bw/bh)|`` (symmetric for portrait and landscape; kohya compares ``w/h``
linearly, which favours wide buckets), ties to the smaller width. The image is resized to cover
the bucket (the smallest scale at which both sides reach it, rounded like kohya) and cropped to
it, center or at a per-index offset. ``original_size`` (height, width as stored, after EXIF
rotation) and ``crop_top_left`` (top, left in the resized image) are what SDXL's ``time_ids``
take, as in diffusers' ``train_text_to_image_sdxl.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

Size = tuple[int, int]  # (height, width), in pixels


@dataclass(frozen=True)
class BucketSpec:
    """The settings that define a bucket list (validated by :func:`runner.data.checks`)."""

    resolution: int  # target area = resolution ** 2
    step: int = 64
    min_side: int | None = None  # default resolution // 2, rounded down to the step
    max_side: int | None = None  # default resolution * 2

    @property
    def low(self) -> int:
        side = self.min_side if self.min_side is not None else self.resolution // 2
        return max(self.step, side // self.step * self.step)

    @property
    def high(self) -> int:
        side = self.max_side if self.max_side is not None else self.resolution * 2
        return side // self.step * self.step

    @cached_property
    def sizes(self) -> tuple[Size, ...]:
        """Every bucket as (height, width), sorted by width then height."""
        area, step, low, high = self.resolution ** 2, self.step, self.low, self.high
        found: set[Size] = set()
        square = min(high, max(step, math.isqrt(area) // step * step))
        found.add((square, square))
        width = low
        while width <= high:
            height = min(high, area // width // step * step)
            if height >= low:
                found.add((height, width))
                found.add((width, height))
            width += step
        return tuple(sorted(found, key=lambda hw: (hw[1], hw[0])))

    @cached_property
    def _log_ratios(self) -> tuple[float, ...]:
        return tuple(math.log(w / h) for h, w in self.sizes)

    def assign(self, width: int, height: int) -> Size:
        """The bucket (height, width) nearest an image of ``width`` x ``height`` in aspect ratio."""
        target = math.log(width / height)
        best = min(range(len(self.sizes)), key=lambda i: (abs(self._log_ratios[i] - target), self.sizes[i][1]))
        return self.sizes[best]

    def largest(self) -> Size:
        """The bucket with the most pixels (ties: the most square), which the planner plans."""
        return max(self.sizes, key=lambda hw: (hw[0] * hw[1], -abs(hw[0] - hw[1])))


def cover_geometry(width: int, height: int, target: Size) -> tuple[int, int]:
    """(resized width, resized height) of an image scaled to cover ``target`` (height, width).

    The scale is the larger of the two side ratios, so both sides reach the target and only one
    is cropped; rounded half up like kohya, and never below the target side.
    """
    th, tw = target
    scale = max(tw / width, th / height)
    return max(tw, int(width * scale + 0.5)), max(th, int(height * scale + 0.5))


def describe_buckets(counts: dict[Size, int]) -> str:
    """``"3 buckets: 64x96 (5), 64x64 (2), 96x64 (1)"`` (width x height, most used first)."""
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0][1], kv[0][0]))
    shown = ", ".join(f"{w}x{h} ({n})" for (h, w), n in ordered[:8])
    more = f", ... {len(ordered) - 8} more" if len(ordered) > 8 else ""
    return f"{len(ordered)} bucket{'s' if len(ordered) != 1 else ''} used: {shown}{more}"
