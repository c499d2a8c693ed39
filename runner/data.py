"""Training data: a folder of captioned images, or a built-in procedural demo set.

``build_dataset(cfg.data)`` returns a map-style :class:`torch.utils.data.Dataset` whose samples
are ``{"pixel_values": float32 [3, R, R] in [-1, 1], "caption": str, "index": int}``. The runner
owns sample order and batching (it calls ``ds[i]`` and :func:`collate`), so everything here is a
pure function of the index: the same index always yields the same tensor, in any process, in any
epoch. That is what makes runs resumable and micro-batch splits invisible, and it is why the
augmentations below are *deterministic per index* rather than drawn from a global RNG.

Folder layout (kohya / dreambooth): every image (``.png .jpg .jpeg .webp .bmp``, any letter case)
has a same-named ``.txt`` caption beside it (``cat.png`` + ``cat.txt``). The folder is searched
recursively, so kohya's ``10_concept/`` subfolders work; the repeat prefix is *not* interpreted
(each file is one sample). Hidden files and folders (names starting with ``.``, e.g. macOS
``._cat.png`` resource forks or ``.ipynb_checkpoints/``) are skipped because they are copies or
junk, never training data. Samples are sorted by their path relative to ``data.path`` (plain
string order of the POSIX form), so the order does not depend on the filesystem.

Image pipeline, per sample: decode -> apply the EXIF orientation (phone photos are otherwise
sideways) -> convert to RGB (alpha is composited over white, not dropped, because the colour
under fully transparent pixels is arbitrary, often black) -> resize the short side to R with
LANCZOS -> crop R x R -> optional horizontal flip -> scale to [-1, 1].

Errors a user can cause (missing folder, no images, missing or non-UTF-8 captions, unreadable
images, bad ``data.*`` values) raise :class:`runner.errors.UserError` naming the key and file.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageOps
from torch.utils.data import Dataset

from runner.errors import UserError, valid_list

log = logging.getLogger("runner")

IMAGE_EXTENSIONS: tuple[str, ...] = (".bmp", ".jpeg", ".jpg", ".png", ".webp")
MISSING_CAPTION_MODES: tuple[str, ...] = ("error", "empty")
CAPTION_EXTENSION = ".txt"

# Folders with at most this many images get an eager header check (``Image.open().verify()``)
# at construction. Trade-off: verify() reads each file once without decoding pixels (for PNG
# it walks every chunk and checks CRCs; for JPEG it only parses the header), so a few thousand
# typical images cost seconds and a broken file fails before any model is loaded, instead of
# hours into a run. Beyond the limit the cost grows with the data set (and on network disks
# can dominate start-up), so large folders are only checked lazily in __getitem__, which still
# names the file. verify() does not catch everything (e.g. a truncated JPEG body), so the lazy
# check always runs too.
VERIFY_LIMIT = 2048

# Resampling filter for the short-side resize. LANCZOS gives the sharpest downscale; with
# ``reducing_gap`` PIL first shrinks by an integer factor, which makes big photos much faster
# at a quality cost that is invisible at training resolutions.
_RESAMPLE = Image.Resampling.LANCZOS
_REDUCING_GAP = 3.0

_ACCEPTED = ", ".join(IMAGE_EXTENSIONS)
_PATH_HINT = (
    "Set data.path to a folder of images (" + _ACCEPTED + ", any letter case; subfolders are "
    "searched) each with a same-named .txt caption beside it (cat.png + cat.txt), or leave "
    "data.path unset (null) to use the built-in demo set."
)


# --------------------------------------------------------------------------------------------
# public API


def build_dataset(data_cfg: Any) -> Dataset:
    """Build the training dataset described by ``cfg.data`` (a DataConfig or a DictConfig).

    ``data_cfg.path`` None -> :class:`DemoDataset` (no files, no download); otherwise
    :class:`FolderDataset`. All ``data.*`` values are validated here, before any file is read,
    so a typo fails in milliseconds.
    """
    resolution = _check_resolution(_get(data_cfg, "resolution", 64))
    missing_caption = _check_missing_caption(_get(data_cfg, "missing_caption", "error"))
    center_crop = bool(_get(data_cfg, "center_crop", True))
    random_flip = bool(_get(data_cfg, "random_flip", False))
    path = _get(data_cfg, "path", None)

    if path is None:
        demo_size = _get(data_cfg, "demo_size", 16)
        if isinstance(demo_size, bool) or not isinstance(demo_size, int) or demo_size < 1:
            raise UserError(
                f"data.demo_size={demo_size!r} is not valid: it is the number of images in the "
                "built-in demo set (used because data.path is unset) and must be a whole number "
                "of at least 1, e.g. data.demo_size=16."
            )
        return DemoDataset(demo_size, resolution, random_flip=random_flip)

    return FolderDataset(
        path,
        resolution,
        center_crop=center_crop,
        random_flip=random_flip,
        missing_caption=missing_caption,
    )


def collate(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Merge per-sample dicts into one batch dict.

    Tensors are stacked (they must share a shape), Python ints become an int64 tensor, and
    everything else (captions) stays a list in sample order. The runner adds ``sample_seed``.
    """
    if not samples:
        raise ValueError("collate() needs at least one sample")
    keys = list(samples[0])
    for s in samples[1:]:
        if set(s) != set(keys):
            raise ValueError(f"collate(): samples have different keys: {sorted(keys)} vs {sorted(s)}")
    batch: dict[str, Any] = {}
    for key in keys:
        values = [s[key] for s in samples]
        first = values[0]
        if isinstance(first, torch.Tensor):
            batch[key] = torch.stack(values)
        elif isinstance(first, int) and not isinstance(first, bool):
            batch[key] = torch.tensor(values, dtype=torch.int64)
        else:
            batch[key] = list(values)
    return batch


def describe_dataset(ds: Any) -> str:
    """One line for the run log: how many samples, at what resolution, from where."""
    describe = getattr(ds, "describe", None)
    if callable(describe):
        return describe()
    try:
        n = len(ds)
    except TypeError:
        n = "?"
    return f"{n} samples from {type(ds).__name__}"


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


_SALT_FLIP = 1
_SALT_CROP_X = 2
_SALT_CROP_Y = 3
_SALT_DEMO = 4


def flips(index: int) -> bool:
    """Whether ``random_flip`` mirrors sample ``index``: a fixed coin per index (about half).

    Fixed per index (not per epoch) so that a resumed or re-split run sees identical pixels;
    the price is that each image is seen in only one orientation within a run.
    """
    return bool(_mix(index, _SALT_FLIP) & 1)


def _to_tensor(img: Image.Image) -> torch.Tensor:
    """RGB uint8 PIL image -> float32 [3, H, W] in [-1, 1]."""
    arr = np.array(img, dtype=np.uint8)  # a writable copy: torch.from_numpy warns on read-only
    t = torch.from_numpy(arr).permute(2, 0, 1).to(torch.float32)
    return (t / 127.5 - 1.0).contiguous()


# --------------------------------------------------------------------------------------------
# folder dataset


class FolderDataset(Dataset):
    """Captioned images from a folder tree (kohya / dreambooth layout); see the module docstring.

    Captions are read eagerly (they are tiny, and a bad one should fail before training);
    pixels are decoded lazily in ``__getitem__`` and not cached, so memory does not grow with
    the data set. When ``center_crop`` is False the crop is a *deterministic random* crop: its
    offset is a hash of the index, so each image keeps one fixed off-centre framing for the
    whole run (reproducible, but not a fresh augmentation every epoch).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        resolution: int,
        *,
        center_crop: bool = True,
        random_flip: bool = False,
        missing_caption: str = "error",
        verify_limit: int = VERIFY_LIMIT,
    ) -> None:
        self.resolution = _check_resolution(resolution)
        missing_caption = _check_missing_caption(missing_caption)
        self.center_crop = center_crop
        self.random_flip = random_flip
        self.root = _check_root(path)
        shown = str(path)

        images = _find_images(self.root)
        if not images:
            raise UserError(
                f"data.path={shown!r} contains no images: searched {str(self.root)!r} and its "
                f"subfolders for files ending in {_ACCEPTED} (any letter case; hidden files "
                f"are skipped). {_PATH_HINT}"
            )

        captions: list[str] = []
        missing: list[Path] = []
        for img in images:
            cap = _caption_path(img)
            if cap is None:
                missing.append(img)
                captions.append("")
            else:
                captions.append(_read_caption(cap, shown))
        if missing:
            if missing_caption == "error":
                examples = ", ".join(
                    f"{str(p)!r} needs {str(p.with_suffix(CAPTION_EXTENSION))!r}" for p in missing[:3]
                )
                more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
                raise UserError(
                    f"data.path={shown!r}: {len(missing)} of {len(images)} images have no caption "
                    f"file: {examples}{more}. Each image needs a same-named .txt file beside it "
                    "holding its caption (UTF-8); or set data.missing_caption=empty to train "
                    "those images with an empty caption instead."
                )
            log.warning(
                "data.path=%r: %d of %d images have no .txt caption; using an empty caption for "
                "them (data.missing_caption=empty). First: %s",
                shown, len(missing), len(images), missing[0],
            )
        self.missing_captions = len(missing)

        self.verified = len(images) <= verify_limit
        if self.verified:
            for img in images:
                _verify_header(img, shown)

        self.paths: list[Path] = images
        self.captions: list[str] = captions
        self._shown = shown

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < 0:
            index += len(self.paths)
        if not 0 <= index < len(self.paths):
            raise IndexError(f"index {index} out of range for {len(self.paths)} images")
        img = _load_rgb(self.paths[index], self._shown)
        img = _resize_crop(img, self.resolution, self.center_crop, index)
        if self.random_flip and flips(index):
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return {"pixel_values": _to_tensor(img), "caption": self.captions[index], "index": index}

    def describe(self) -> str:
        r = self.resolution
        extra = []
        if self.missing_captions:
            extra.append(f"{self.missing_captions} with empty captions")
        extra.append("center crop" if self.center_crop else "per-index random crop")
        if self.random_flip:
            extra.append("per-index random flip")
        if not self.verified:
            extra.append("headers not pre-checked")
        return f"{len(self)} images at {r}x{r} from folder {str(self.root)!r} ({', '.join(extra)})"


def _check_root(path: Any) -> Path:
    shown = str(path)
    if not shown.strip():
        raise UserError(f"data.path is empty ({shown!r}). {_PATH_HINT}")
    root = Path(os.path.expanduser(shown)).absolute()
    if not root.exists():
        raise UserError(f"data.path={shown!r} does not exist (looked for {str(root)!r}). {_PATH_HINT}")
    if not root.is_dir():
        raise UserError(f"data.path={shown!r} is a file, not a folder ({str(root)!r}). {_PATH_HINT}")
    return root


def _find_images(root: Path) -> list[Path]:
    """All non-hidden image files under ``root``, sorted by relative POSIX path.

    Symlinked folders are followed (people link data sets in), with a guard against loops.
    """
    found: list[tuple[str, Path]] = []
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            if os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS:
                p = Path(dirpath) / name
                found.append((p.relative_to(root).as_posix(), p))
    found.sort(key=lambda t: t[0])
    return [p for _, p in found]


def _caption_path(image: Path) -> Path | None:
    """``cat.png`` -> ``cat.txt`` (or ``cat.TXT``) beside it, or None."""
    for ext in (CAPTION_EXTENSION, CAPTION_EXTENSION.upper()):
        cand = image.with_suffix(ext)
        if cand.is_file():
            return cand
    return None


def _read_caption(path: Path, shown: str) -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(
            f"data.path={shown!r}: cannot read caption file {str(path)!r} ({e.strerror or e}). "
            "Make it a readable UTF-8 text file."
        ) from None
    try:
        text = raw.decode("utf-8-sig")  # tolerate a BOM, which Windows editors add
    except UnicodeDecodeError as e:
        raise UserError(
            f"data.path={shown!r}: caption file {str(path)!r} is not valid UTF-8 (byte "
            f"0x{raw[e.start]:02x} at offset {e.start}). Re-save it as UTF-8 text."
        ) from None
    return text.strip()


def _bad_image(path: Path, shown: str, err: BaseException) -> UserError:
    reason = (str(err) or type(err).__name__).replace(f" {str(path)!r}", "")  # PIL repeats it
    return UserError(
        f"data.path={shown!r}: cannot read image {str(path)!r} ({reason}). Remove the file or "
        f"re-save it as a valid image ({_ACCEPTED})."
    )


def _verify_header(path: Path, shown: str) -> None:
    try:
        with Image.open(path) as im:
            im.verify()
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, struct.error ...)
        raise _bad_image(path, shown, e) from None


def _load_rgb(path: Path, shown: str) -> Image.Image:
    """Decode fully (so truncation is caught here) and return an RGB image."""
    try:
        with Image.open(path) as im:
            im.load()
            img = im.copy()  # closing the file invalidates `im` itself
    except Exception as e:  # see _verify_header
        raise _bad_image(path, shown, e) from None
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


# --------------------------------------------------------------------------------------------
# built-in demo set

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


def demo_image(index: int, resolution: int) -> Image.Image:
    """Draw demo image ``index`` at ``resolution`` (RGB), deterministically.

    Drawn at 2x and downsampled, which anti-aliases the edges: hard aliased edges are harder
    for a tiny model to learn and look worse in samples. Size and position vary a little per
    index (from the index hash) so the model has to read the caption, not memorise one layout.
    """
    shape, fg, bg = demo_spec(index)
    ss = 2
    n = resolution * ss
    img = Image.new("RGB", (n, n), _COLOURS[bg])
    draw = ImageDraw.Draw(img)
    h = _mix(index, _SALT_DEMO)
    size = n * (0.45 + 0.2 * ((h & 0xFF) / 255))  # 45% .. 65% of the side
    cx = n / 2 + (((h >> 8) & 0xFF) / 255 - 0.5) * (n - size) * 0.8
    cy = n / 2 + (((h >> 16) & 0xFF) / 255 - 0.5) * (n - size) * 0.8
    half = size / 2
    box = (cx - half, cy - half, cx + half, cy + half)
    colour = _COLOURS[fg]
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=colour)
    else:  # vertical stripes across the whole image, 4 periods
        period = n / 4
        phase = ((h >> 24) & 0xFF) / 255 * period
        x = -period + phase
        while x < n:
            draw.rectangle((x, 0, x + period / 2 - 1, n), fill=colour)
            x += period
    return img.resize((resolution, resolution), Image.Resampling.LANCZOS)


class DemoDataset(Dataset):
    """``size`` procedurally drawn images of coloured shapes, with matching captions.

    Needs no files or network, so a fresh checkout can train end to end. Each image is one
    shape (circle, square, triangle or stripes) in one colour on a contrasting plain background,
    captioned e.g. "a red circle on a blue background": simple enough that a tiny diffusion
    model's loss visibly drops within a few dozen steps, and caption-dependent, so conditioning
    matters. Images are drawn at the target resolution on first access and cached as tensors
    (16 images at 64 px are ~800 KB); the flip, when enabled, is applied after the cache.
    """

    def __init__(self, size: int, resolution: int, *, random_flip: bool = False) -> None:
        self.size = int(size)
        self.resolution = _check_resolution(resolution)
        self.random_flip = random_flip
        self._cache: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < 0:
            index += self.size
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} demo images")
        t = self._cache.get(index)
        if t is None:
            t = _to_tensor(demo_image(index, self.resolution))
            self._cache[index] = t
        if self.random_flip and flips(index):
            t = torch.flip(t, dims=[2])
        else:
            t = t.clone()  # callers may modify the batch in place; keep the cache pristine
        return {"pixel_values": t, "caption": demo_caption(index), "index": index}

    def describe(self) -> str:
        r = self.resolution
        flip = ", per-index random flip" if self.random_flip else ""
        return f"{self.size} images at {r}x{r} from the built-in demo set (coloured shapes{flip})"


# --------------------------------------------------------------------------------------------
# config checks


def _get(cfg: Any, key: str, default: Any) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _check_resolution(resolution: Any) -> int:
    ok = isinstance(resolution, int) and not isinstance(resolution, bool) and resolution > 0
    if ok and resolution % 8 == 0:
        return resolution
    if ok:
        lo, hi = resolution // 8 * 8, resolution // 8 * 8 + 8
        near = f"{hi}" if lo == 0 else f"{lo} or {hi}"
        hint = f", e.g. data.resolution={near}"
    else:
        hint = ", e.g. data.resolution=64 or 512"
    raise UserError(
        f"data.resolution={resolution!r} is not valid: it must be a positive whole number of "
        f"pixels that is a multiple of 8 (the VAE turns 8x8 pixels into one latent){hint}."
    )


def _check_missing_caption(value: Any) -> str:
    if value in MISSING_CAPTION_MODES:
        return value
    raise UserError(
        f"data.missing_caption={value!r} is not valid; valid values: "
        f"{valid_list(str(value), MISSING_CAPTION_MODES)} (error: stop when an image has no .txt "
        "caption; empty: use an empty caption for it)."
    )
