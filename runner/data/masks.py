"""``data.masks=true``: a loss mask per image, read beside the image, checked before step 1.

Where a mask is found (the peers' two conventions; the first that exists wins):

1. ``masks/<stem>.<ext>`` in a ``masks`` folder beside the image (OneTrainer's and SimpleTuner's
   "mask folder" layout): ``photos/cat.jpg`` -> ``photos/masks/cat.png``;
2. ``<stem>_mask.<ext>`` beside the image (kohya's and OneTrainer's suffix layout):
   ``photos/cat.jpg`` -> ``photos/cat_mask.png``.

``<ext>`` is any image extension the data accepts, ``.png`` tried first. The folder wins over the
suffix because a dedicated folder is the more deliberate choice: a folder tree that has both
trains on the folder's masks, and :func:`find_mask` says so in the data line (``n masks from
masks/``). With ``data.masks=true`` neither masks nor ``masks/`` folders are training images.

A mask is grayscale, 0 (ignored) .. 255 (trained fully), any mode PIL reads (colour is converted
to luminance, alpha is ignored). It is resized to the image's size as shown (after EXIF rotation)
and then cropped, resized and flipped with the image (runner/data/folder.py, runner/data/flip.py),
so it always covers the same pixels. The trainer downsamples it to the latent grid, area-averaged,
and the encoder cache keeps it beside the latents (runner/families/common/base.py ``encode_latents``).

Refused before training, naming the file (:func:`check_mask`): an image without a mask (a white
mask trains the whole image), a mask that cannot be read, one whose aspect ratio differs from its
image's by more than :data:`RATIO_TOLERANCE` (it would cover other pixels after the crop), and an
all-black one (its image would add nothing but a zero loss). Each check decodes the mask once at
start: masks are small single-channel files, so this costs far less than one training step.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from runner.data.images import IMAGE_EXTENSIONS
from runner.errors import UserError

MASK_FOLDER = "masks"
MASK_SUFFIX = "_mask"
# Relative difference of width/height allowed between a mask and its image: 1% covers the
# rounding of a mask saved at a smaller size (a 1000x667 image with a 300x200 mask).
RATIO_TOLERANCE = 0.01
_EXTS = (".png",) + tuple(e for e in IMAGE_EXTENSIONS if e != ".png")


def is_mask_file(path: Path) -> bool:
    """A file that :func:`find_mask` would read as a mask (``*_mask.<ext>`` or inside ``masks/``)."""
    return path.stem.endswith(MASK_SUFFIX) or path.parent.name == MASK_FOLDER


def find_mask(image: Path) -> Path | None:
    """The mask of ``image``: ``masks/<stem>.*`` beside it first, then ``<stem>_mask.*``; None if neither."""
    for folder, stem in ((image.parent / MASK_FOLDER, image.stem), (image.parent, image.stem + MASK_SUFFIX)):
        for ext in _EXTS:
            for candidate in (folder / (stem + ext), folder / (stem + ext.upper())):
                if candidate.is_file():
                    return candidate
    return None


def _read(path: Path, key: str) -> Image.Image:
    try:
        with Image.open(path) as im:
            im.load()
            img = im.copy()
    except Exception as e:  # noqa: BLE001 - PIL raises many types (OSError, SyntaxError ...)
        raise UserError(f"{key}: cannot read mask {str(path)!r} ({str(e) or type(e).__name__}). Re-save it as a "
                        "grayscale PNG (black: not trained, white: trained) or remove data.masks=true.") from None
    with contextlib.suppress(Exception):  # a malformed EXIF block: the image itself ignores it too
        img = ImageOps.exif_transpose(img)
    if img.mode in ("I", "F") or img.mode.startswith("I;16"):
        arr = np.asarray(img, dtype=np.float64)
        top = float(arr.max()) if arr.size else 0.0
        scale = 255.0 / 65535.0 if top > 255 else (255.0 if img.mode == "F" and top <= 1.0 else 1.0)
        return Image.fromarray(np.clip(arr * scale, 0, 255).astype(np.uint8), "L")
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        img = img.convert("RGB")  # the alpha channel is not the mask: luminance is
    return img.convert("L")


def check_mask(path: Path, image_size: tuple[int, int], key: str) -> None:
    """Refuse a mask that cannot be read, does not match its image's shape or is all black.

    ``image_size``: the image's (width, height) as shown (after EXIF rotation)."""
    mask = _read(path, key)
    (mw, mh), (iw, ih) = mask.size, image_size
    if abs(mw / mh - iw / ih) > RATIO_TOLERANCE * (iw / ih):
        raise UserError(
            f"{key}: mask {str(path)!r} is {mw}x{mh} but its image is {iw}x{ih}: the aspect ratios differ, so after "
            "the crop the mask would cover other pixels than it was drawn on. Save the mask at the image's size (or "
            "a scaled copy of it), or remove data.masks=true.")
    if not np.asarray(mask).any():
        raise UserError(
            f"{key}: mask {str(path)!r} is all black (zero everywhere), so its image would train nothing. Paint the "
            "parts to train white, remove the image with its mask, or remove data.masks=true.")


def load_mask(path: Path, image_size: tuple[int, int], key: str) -> Image.Image:
    """The mask as an ``L`` image of ``image_size`` (width, height), ready for the image's crop."""
    mask = _read(path, key)
    return mask if mask.size == image_size else mask.resize(image_size, Image.Resampling.BILINEAR)


def mask_tensor(mask: Image.Image) -> torch.Tensor:
    """An ``L`` image -> float32 ``[1, H, W]`` in 0..1."""
    arr = np.array(mask, dtype=np.uint8)
    return (torch.from_numpy(arr).to(torch.float32) / 255.0).unsqueeze(0).contiguous()


def find_masks(images: list[Path], sizes: list[tuple[int, int]], key: str, shown: str) -> list[Path]:
    """Every image's mask, each checked (:func:`check_mask`); a UserError naming the images without one."""
    found = [find_mask(p) for p in images]
    missing = [p for p, m in zip(images, found) if m is None]
    if missing:
        first = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(
            f"{key}={shown!r}: data.masks=true but {len(missing)} of {len(images)} images have no mask, e.g. "
            f"{str(first)!r}{more}: looked for {str(first.parent / MASK_FOLDER / (first.stem + '.png'))!r} and then "
            f"{str(first.parent / (first.stem + MASK_SUFFIX + '.png'))!r}. Give every image a mask (a white one "
            "trains the whole image) or remove data.masks=true.")
    for mask, size in zip(found, sizes):
        check_mask(mask, size, key)  # type: ignore[arg-type]
    return found  # type: ignore[return-value]


def describe_masks(masks: list[Path]) -> str:
    """``"loss masks: 3 from masks/, 1 from *_mask files"``."""
    in_folder = sum(m.parent.name == MASK_FOLDER for m in masks)
    parts = [f"{n} from {where}" for n, where in ((in_folder, "masks/"), (len(masks) - in_folder, "*_mask files")) if n]
    return "loss masks: " + ", ".join(parts)
