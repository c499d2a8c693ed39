"""Image decoding and transforms, and the per-index randomness of the augmentations.

Image pipeline, per sample: decode -> apply the EXIF orientation (phone photos are otherwise
sideways) -> convert to RGB (alpha is composited over white, not dropped, because the colour
under fully transparent pixels is arbitrary, often black) -> resize the short side to R with
LANCZOS -> crop R x R -> scale to [-1, 1].

Crop offsets are a hash of the sample index (:func:`_mix`), never a global RNG, so the same index
gives the same pixels in any process and epoch (see :mod:`runner.data`). ``data.random_flip`` is
not decided here: it changes on every visit of a sample (runner/data/flip.py).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from runner.errors import UserError

IMAGE_EXTENSIONS: tuple[str, ...] = (".bmp", ".jpeg", ".jpg", ".png", ".webp")
IMAGE_PIPELINE_VERSION = 1  # bump when decode/resize/crop changes the pixels: encoder-cache keys carry it

# Resampling filter for the short-side resize. LANCZOS gives the sharpest downscale; with
# ``reducing_gap`` PIL first shrinks by an integer factor, which makes big photos much faster
# at a quality cost that is invisible at training resolutions.
_RESAMPLE = Image.Resampling.LANCZOS
_REDUCING_GAP = 3.0

_ACCEPTED = ", ".join(IMAGE_EXTENSIONS)


# --------------------------------------------------------------------------------------------
# deterministic per-index randomness


_MASK64 = (1 << 64) - 1


def _mix(index: int, salt: int) -> int:
    """splitmix64 of (index, salt): a stable 64-bit hash, identical in every process.

    Python's ``hash()`` is salted per process for str and not meant for this; ``random.Random``
    would work but is heavier and its algorithms are not a documented stability promise.
    """
    z = (index * 0x9E3779B97F4A7C15 + salt * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


_SALT_FLIP = 1  # unused since the flip is per visit (runner/data/flip.py); kept so the other salts stay put
_SALT_CROP_X = 2
_SALT_CROP_Y = 3
_SALT_DEMO = 4


def _to_tensor(img: Image.Image) -> torch.Tensor:
    """RGB uint8 PIL image -> float32 [3, H, W] in [-1, 1]."""
    arr = np.array(img, dtype=np.uint8)  # a writable copy: torch.from_numpy warns on read-only
    t = torch.from_numpy(arr).permute(2, 0, 1).to(torch.float32)
    return (t / 127.5 - 1.0).contiguous()


# --------------------------------------------------------------------------------------------
# decoding, resize and crop


def sha256_file(path: Path) -> str:
    """The file's sha256 (an image's identity in encoder-cache keys: cheaper than decoding it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _bad_image(path: Path, shown: str, err: BaseException, key: str = "data.path") -> UserError:
    reason = (str(err) or type(err).__name__).replace(f" {str(path)!r}", "")  # PIL repeats it
    return UserError(
        f"{key}={shown!r}: cannot read image {str(path)!r} ({reason}). Remove the file or "
        f"re-save it as a valid image ({_ACCEPTED})."
    )


def _verify_header(path: Path, shown: str, key: str = "data.path") -> tuple[int, int]:
    """Check the file without decoding pixels; its (width, height) as stored (before EXIF rotation,
    which does not change the short side)."""
    try:
        with Image.open(path) as im:
            size = im.size
            im.verify()
            return size
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, struct.error ...)
        raise _bad_image(path, shown, e, key) from None


# EXIF orientations that turn the image a quarter: width and height swap (ImageOps.exif_transpose).
_QUARTER_TURNS = (5, 6, 7, 8)


def oriented_size(path: Path, shown: str, key: str = "data.path") -> tuple[int, int]:
    """(width, height) as the image is shown, after EXIF rotation, reading only the header.

    Aspect-ratio buckets need it for every image before training, so pixels are not decoded.
    """
    try:
        with Image.open(path) as im:
            w, h = im.size
            try:
                turned = im.getexif().get(0x0112, 1) in _QUARTER_TURNS
            except Exception:  # a malformed EXIF block: _load_rgb ignores it too
                turned = False
    except Exception as e:  # see _verify_header
        raise _bad_image(path, shown, e, key) from None
    return (h, w) if turned else (w, h)


def _load_rgb(path: Path, shown: str, key: str = "data.path") -> Image.Image:
    """Decode fully (so truncation is caught here) and return an RGB image."""
    try:
        with Image.open(path) as im:
            im.load()
            img = im.copy()  # closing the file invalidates `im` itself
    except Exception as e:  # see _verify_header
        raise _bad_image(path, shown, e, key) from None
    try:
        img = ImageOps.exif_transpose(img)
    except Exception:  # a malformed EXIF block should not make a good image unusable
        pass
    return _to_rgb(img)


def _to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode -> RGB. Alpha is composited over white; 16/32-bit and float are rescaled."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
        mode = img.mode
    elif mode in ("I", "F") or mode.startswith("I;16"):
        # PIL's convert() clips these to 0..255 instead of scaling: a 16-bit PNG turns white.
        arr = np.asarray(img, dtype=np.float64)
        top = float(arr.max()) if arr.size else 0.0
        if mode == "F":
            scale = 255.0 if top <= 1.0 else 1.0
        else:
            scale = 255.0 / 65535.0 if top > 255 else 1.0
        img = Image.fromarray(np.clip(arr * scale, 0, 255).astype(np.uint8), "L")
        mode = "L"
    if mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _resize_crop(img: Image.Image, r: int, center: bool, index: int) -> Image.Image:
    """Resize the short side to ``r`` (aspect kept), then crop ``r`` x ``r``."""
    w, h = img.size
    scale = r / min(w, h)
    nw, nh = max(r, round(w * scale)), max(r, round(h * scale))
    if (nw, nh) != (w, h):
        img = img.resize((nw, nh), _RESAMPLE, reducing_gap=_REDUCING_GAP)
    if center:
        left, top = (nw - r) // 2, (nh - r) // 2
    else:
        left = _mix(index, _SALT_CROP_X) % (nw - r + 1)
        top = _mix(index, _SALT_CROP_Y) % (nh - r + 1)
    if (left, top, nw, nh) == (0, 0, r, r):
        return img
    return img.crop((left, top, left + r, top + r))


def crop_offset(free_x: int, free_y: int, center: bool, index: int) -> tuple[int, int]:
    """(left, top) of a crop with ``free_x`` / ``free_y`` pixels to spare: centered, or a
    per-index hash (the same offsets ``_resize_crop`` draws)."""
    if center:
        return free_x // 2, free_y // 2
    return _mix(index, _SALT_CROP_X) % (free_x + 1), _mix(index, _SALT_CROP_Y) % (free_y + 1)


def resize_crop_to(img: Image.Image, size: tuple[int, int], resized: tuple[int, int], offset: tuple[int, int]) -> Image.Image:
    """Resize to ``resized`` (width, height) and crop ``size`` (height, width) at ``offset`` (left, top):
    the bucket path (runner.data.buckets computes the geometry from the header alone)."""
    th, tw = size
    if img.size != resized:
        img = img.resize(resized, _RESAMPLE, reducing_gap=_REDUCING_GAP)
    left, top = offset
    if (left, top, *resized) == (0, 0, tw, th):
        return img
    return img.crop((left, top, left + tw, top + th))
