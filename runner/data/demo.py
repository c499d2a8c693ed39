"""The built-in demo set: procedurally drawn coloured shapes with matching captions.

Needs no files and no network, so a fresh checkout trains end to end (``data.path`` unset).
Every image and caption is a pure function of its index (see :mod:`runner.data`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image, ImageDraw
from torch.utils.data import Dataset

from runner.data.checks import _check_resolution, check_index
from runner.data.images import _SALT_DEMO, _mix, _to_tensor
from runner.data.masks import mask_tensor

# Saturated, well-separated colours. A (shape, background) pair is used only if the two are far
# apart in RGB and not in _LOW_CONTRAST (yellow/white are far apart in RGB but hard to tell
# apart by eye), so every shape stands out from its background.
_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 80, 220),
    "yellow": (245, 215, 40),
    "purple": (140, 60, 190),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
_LOW_CONTRAST = {frozenset(("yellow", "white"))}
_MIN_RGB_DISTANCE = 200
_SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "stripes")


def _demo_combos() -> list[tuple[str, str, str]]:
    combos = []
    for shape in _SHAPES:
        for fg, a in _COLOURS.items():
            for bg, b in _COLOURS.items():
                if (
                    fg != bg
                    and math.dist(a, b) >= _MIN_RGB_DISTANCE
                    and frozenset((fg, bg)) not in _LOW_CONTRAST
                ):
                    combos.append((shape, fg, bg))
    return combos


_DEMO_COMBOS = _demo_combos()


def _coprime_stride(n: int) -> int:
    """A stride near n * 0.618 that is coprime to n, so ``i * stride % n`` visits every combo
    once per n images while neighbours differ in shape and colours."""
    s = max(1, int(n * 0.618))
    while math.gcd(s, n) != 1:
        s += 1
    return s


_DEMO_STRIDE = _coprime_stride(len(_DEMO_COMBOS))


def demo_spec(index: int) -> tuple[str, str, str]:
    """(shape, colour, background colour) of demo image ``index``; repeats every N combos."""
    return _DEMO_COMBOS[(index * _DEMO_STRIDE) % len(_DEMO_COMBOS)]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def demo_caption(index: int) -> str:
    """E.g. "a red circle on a blue background" or "white stripes on an orange background"."""
    shape, fg, bg = demo_spec(index)
    thing = f"{fg} stripes" if shape == "stripes" else f"{_article(fg)} {fg} {shape}"
    return f"{thing} on {_article(bg)} {bg} background"


def draw_solid_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, half: float,
                     colour: tuple[int, int, int]) -> bool:
    """Draw a circle, square or triangle of half-side ``half`` centred at (cx, cy) and return True;
    False for the stripes, which the image and the clip demo each draw their own way."""
    box = (cx - half, cy - half, cx + half, cy + half)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=colour)
    else:
        return False
    return True


def demo_image(index: int, resolution: int) -> Image.Image:
    """Draw demo image ``index`` at ``resolution`` (RGB), deterministically.

    Drawn at 2x and downsampled, which anti-aliases the edges: hard aliased edges are harder
    for a tiny model to learn and look worse in samples. Size and position vary a little per
    index (from the index hash) so the model has to read the caption, not memorise one layout.
    """
    _, fg, bg = demo_spec(index)
    return _draw(index, resolution, _COLOURS[fg], _COLOURS[bg])


def demo_mask(index: int, resolution: int) -> torch.Tensor:
    """The loss mask of demo image ``index`` (``data.masks=true``): 1 on its shape, 0 on the background,
    float32 ``[1, R, R]``. Drawn as the image is, so it covers the shape's (anti-aliased) pixels."""
    img = _draw(index, resolution, (255, 255, 255), (0, 0, 0)).convert("L")
    return mask_tensor(img)


REFERENCE_GREYS = (128, 96, 160, 64)  # the shape's colour in reference 1, 2 ... of a paired demo sample


def demo_reference(index: int, resolution: int, k: int) -> torch.Tensor:
    """Reference ``k`` (0-based) of demo image ``index`` (``data.references``): the same shape at the same
    place on the same background, in grey, so the edit the caption asks for is its colour. ``[3, R, R]``."""
    _, _, bg = demo_spec(index)
    grey = REFERENCE_GREYS[k % len(REFERENCE_GREYS)]
    return _to_tensor(_draw(index, resolution, (grey, grey, grey), _COLOURS[bg]))


def demo_instruction(index: int) -> str:
    """The caption of a paired demo sample, an edit instruction: "make the circle red"."""
    shape, fg, _ = demo_spec(index)
    return f"make the stripes {fg}" if shape == "stripes" else f"make the {shape} {fg}"


def _draw(index: int, resolution: int, colour: tuple[int, int, int], background: tuple[int, int, int]) -> Image.Image:
    shape = demo_spec(index)[0]
    ss = 2
    n = resolution * ss
    img = Image.new("RGB", (n, n), background)
    draw = ImageDraw.Draw(img)
    h = _mix(index, _SALT_DEMO)
    size = n * (0.45 + 0.2 * ((h & 0xFF) / 255))  # 45% .. 65% of the side
    cx = n / 2 + (((h >> 8) & 0xFF) / 255 - 0.5) * (n - size) * 0.8
    cy = n / 2 + (((h >> 16) & 0xFF) / 255 - 0.5) * (n - size) * 0.8
    half = size / 2
    if not draw_solid_shape(draw, shape, cx, cy, half, colour):
        # vertical stripes across the whole image, 4 periods
        period = n / 4
        phase = ((h >> 24) & 0xFF) / 255 * period
        x = -period + phase
        while x < n:
            draw.rectangle((x, 0, x + period / 2 - 1, n), fill=colour)
            x += period
    return img.resize((resolution, resolution), Image.Resampling.LANCZOS)


def cached_copy(cache: dict[int, torch.Tensor], index: int, draw: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """A copy of sample ``index``'s pixels from ``cache``, drawn with ``draw(index)`` on first use.

    Shared by the demo sets, which draw each sample on first access and keep it as a tensor; a
    copy goes out because callers may modify the batch in place, and the cache must stay pristine.
    """
    t = cache.get(index)
    if t is None:
        t = draw(index)
        cache[index] = t
    return t.clone()


class DemoDataset(Dataset):
    """``size`` procedurally drawn images of coloured shapes, with matching captions.

    Needs no files or network, so a fresh checkout can train end to end. Each image is one
    shape (circle, square, triangle or stripes) in one colour on a contrasting plain background,
    captioned e.g. "a red circle on a blue background": simple enough that a tiny diffusion
    model's loss visibly drops within a few dozen steps, and caption-dependent, so conditioning
    matters. Images are drawn at the target resolution on first access and cached as tensors
    (16 images at 64 px are ~800 KB). ``data.random_flip`` is the runner's, per visit (runner/data/flip.py).
    """

    def __init__(self, size: int, resolution: int, masks: bool = False, references: int = 0) -> None:
        """``masks``: each sample also carries its shape as a loss mask (``data.masks=true``);
        ``references``: a paired edit set (``data.references=N``): each target carries N grey versions of
        its shape (:func:`demo_reference`) and its caption is the instruction (:func:`demo_instruction`)."""
        self.size = int(size)
        self.resolution = _check_resolution(resolution)
        self.masks = bool(masks)
        self.references = int(references)
        self._cache: dict[int, torch.Tensor] = {}
        self._masks: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = check_index(index, self.size, "demo images")
        t = cached_copy(self._cache, index, lambda i: _to_tensor(demo_image(i, self.resolution)))
        out: dict[str, Any] = {"pixel_values": t}
        if self.masks:
            out["mask"] = cached_copy(self._masks, index, lambda i: demo_mask(i, self.resolution))
        if self.references:
            out["references"] = self._references(index, index)
        return {**out, "caption": self.caption(index), "index": index}

    def _references(self, index: int, drawn: int) -> torch.Tensor:
        return torch.stack([demo_reference(drawn, self.resolution, k) for k in range(self.references)])

    def caption(self, index: int) -> str:
        """The caption of image ``index`` without drawing it (the encoder cache keys text by it)."""
        return demo_instruction(index) if self.references else demo_caption(index)

    def describe(self) -> str:
        r = self.resolution
        masks = "; loss masks: each shape" if self.masks else ""
        refs = f"; {self.references} grey reference(s) per image, edit instructions as captions" if self.references else ""
        return f"{self.size} images at {r}x{r} from the built-in demo set (coloured shapes){masks}{refs}"


class DemoPrior(DemoDataset):
    """A built-in prior (class) set for the demo (``data.demo_prior=N``): shapes drawn from other indices
    than the demo set's, captioned with the class alone ("a circle", "stripes"), as DreamBooth's
    class images carry the class prompt. With ``data.masks`` each carries its shape as mask too."""

    OFFSET = 10_000  # draws from indices the demo set (16 by default) never reaches

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = check_index(index, self.size, "demo prior images")
        i = index + self.OFFSET
        t = cached_copy(self._cache, index, lambda _: _to_tensor(demo_image(i, self.resolution)))
        out: dict[str, Any] = {"pixel_values": t}
        if self.masks:
            out["mask"] = cached_copy(self._masks, index, lambda _: demo_mask(i, self.resolution))
        if self.references:
            out["references"] = self._references(index, i)
        return {**out, "caption": self.caption(index), "index": index}

    def caption(self, index: int) -> str:
        shape = demo_spec(index + self.OFFSET)[0]
        if self.references:
            return f"make the {shape} coloured"
        return "stripes" if shape == "stripes" else f"{_article(shape)} {shape}"

    def describe(self) -> str:
        r = self.resolution
        return f"{self.size} class images at {r}x{r} from the built-in demo prior set (\"a circle\" ...)"
