"""A folder of captioned images (kohya / dreambooth layout): :class:`FolderDataset`.

Folder layout: every image (``.png .jpg .jpeg .webp .bmp``, any letter case) has a same-named
caption beside it (``cat.png`` + ``cat.txt``; another extension with ``data.caption_ext=.caption``). The folder is searched recursively, so
kohya's ``10_concept/`` subfolders work; the repeat prefix is *not* interpreted (each file is one
sample). Hidden files and folders (names starting with ``.``, e.g. macOS ``._cat.png`` resource
forks or ``.ipynb_checkpoints/``) are skipped because they are copies or junk, never training
data. Samples are sorted by their path relative to ``data.path`` (plain string order of the POSIX
form), so the order does not depend on the filesystem.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from runner.data.buckets import BucketSpec, Size, cover_geometry, describe_buckets
from runner.data.checks import _check_missing_caption, _check_resolution, check_index
from runner.data.images import (
    _ACCEPTED,
    IMAGE_EXTENSIONS,
    IMAGE_PIPELINE_VERSION,
    _load_rgb,
    _resize_crop,
    _to_tensor,
    _verify_header,
    crop_offset,
    oriented_size,
    resize_crop_to,
    sha256_file,
)
from runner.data.masks import describe_masks, find_masks, is_mask_file, load_mask, mask_tensor
from runner.data.references import describe_references, find_references, is_control_folder, is_reference_file
from runner.errors import UserError

log = logging.getLogger("runner")


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

# An image whose short side is less than resolution / UPSCALE_WARN is named in a warning and the
# data summary: blown up that far it teaches the model blur (kohya and OneTrainer users expect it).
UPSCALE_WARN = 4

_PATH_HINT = (
    "Set data.path to a folder of images (" + _ACCEPTED + ", any letter case; subfolders are "
    "searched) each with a same-named .txt caption beside it (cat.png + cat.txt), or leave "
    "data.path unset (null) to use the built-in demo set."
)


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
        missing_caption: str = "error",
        verify_limit: int = VERIFY_LIMIT,
        caption_ext: str = CAPTION_EXTENSION,
        buckets: BucketSpec | None = None,
        key: str = "data.path",
        size_in_fingerprint: bool = False,
        masks: bool = False,
        references: int = 0,
    ) -> None:
        """``buckets``: aspect-ratio buckets (runner/data/buckets.py) instead of the square crop;
        ``key``: the setting named in error messages (``data.sets[1].path`` for a set);
        ``size_in_fingerprint``: put the output size into the cache fingerprint even without buckets
        (a set whose resolution differs from ``data.resolution``, which the cache signature holds);
        ``masks``: ``data.masks``, a loss mask per image (runner/data/masks.py), found and checked here;
        ``references``: ``data.references``, reference images per target (runner/data/references.py), found
        and checked here."""
        self.resolution = _check_resolution(resolution)
        missing_caption = _check_missing_caption(missing_caption)
        self.center_crop = center_crop
        self.caption_ext = caption_ext
        self.key = key
        self.size_in_fingerprint = size_in_fingerprint or buckets is not None
        self.root = _check_root(path, key)
        shown = str(path)

        images, self.skipped = _find_images(self.root, caption_ext, skip_masks=masks, skip_references=references > 0)
        if not images:
            raise UserError(
                f"{key}={shown!r} contains no images: searched {str(self.root)!r} and its "
                f"subfolders for files ending in {_ACCEPTED} (any letter case; hidden files "
                f"are skipped). {_path_hint(key, caption_ext)}"
            )

        captions, self.missing_captions = _read_captions(images, caption_ext, missing_caption, shown, key)

        self.verified = len(images) <= verify_limit
        # Short side < resolution / UPSCALE_WARN; found by the eager header check only.
        self.upscaled: list[tuple[Path, tuple[int, int]]] = (
            _verify_images(images, self.resolution, shown, key) if self.verified else [])

        self.paths: list[Path] = images
        self.captions: list[str] = captions
        self._shown = shown
        # Buckets: every image's shown size (header only) and its bucket, fixed for the run.
        self.buckets = buckets
        self.original_sizes: list[tuple[int, int]] = []  # (width, height) after EXIF rotation
        self.sizes: list[Size] = []  # output (height, width) per image
        if buckets is not None:
            self.original_sizes = [oriented_size(p, shown, key) for p in images]
            self.sizes = [buckets.assign(w, h) for w, h in self.original_sizes]
        self.masks: list[Path] | None = None
        if masks:
            shown_sizes = self.original_sizes or [oriented_size(p, shown, key) for p in images]
            self.masks = find_masks(images, shown_sizes, key, shown)
        self.references: list[list[Path]] | None = None
        if references:
            shown_sizes = self.original_sizes or [oriented_size(p, shown, key) for p in images]
            self.references = find_references(images, shown_sizes, int(references), key, shown)

    def __len__(self) -> int:
        return len(self.paths)

    def _geometry(self, index: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Bucket path: (resized width and height, crop offset left and top) of image ``index``."""
        w, h = self.original_sizes[index]
        size = self.sizes[index]
        resized = cover_geometry(w, h, size)
        return resized, crop_offset(resized[0] - size[1], resized[1] - size[0], self.center_crop, index)

    def light(self, index: int) -> dict[str, Any]:
        """Sample ``index`` without its pixels: what a run whose latents are all cached needs."""
        index = check_index(index, len(self.paths), "images")
        out: dict[str, Any] = {"caption": self.captions[index], "index": index}
        if self.buckets is not None:
            (w, h), (left, top) = self.original_sizes[index], self._geometry(index)[1]
            out["original_size"] = torch.tensor([h, w], dtype=torch.int64)
            out["crop_top_left"] = torch.tensor([top, left], dtype=torch.int64)
        return out

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = check_index(index, len(self.paths), "images")
        img = _load_rgb(self.paths[index], self._shown, self.key)
        out: dict[str, Any] = {}
        if self.masks is not None:  # the same geometry as the image: it covers the same pixels
            mask = self._crop(load_mask(self.masks[index], img.size, self.key), index)
            out["mask"] = mask_tensor(mask)
        if self.references is not None:  # resized to the target's size, then its crop: the same framing
            refs = [_load_rgb(r, self._shown, self.key) for r in self.references[index]]
            refs = [r if r.size == img.size else r.resize(img.size, Image.Resampling.LANCZOS) for r in refs]
            out["references"] = torch.stack([_to_tensor(self._crop(r, index)) for r in refs])
        return {"pixel_values": _to_tensor(self._crop(img, index)), **out, **self.light(index)}

    def _crop(self, img: Any, index: int) -> Any:
        """The square or bucket resize and crop of image ``index`` (or of its mask, the same size)."""
        if self.buckets is None:
            return _resize_crop(img, self.resolution, self.center_crop, index)
        resized, offset = self._geometry(index)
        return resize_crop_to(img, self.sizes[index], resized, offset)

    def group_of(self, index: int) -> Size:
        """The output (height, width) of sample ``index``: samples of one batch share it."""
        return self.sizes[index] if self.buckets is not None else (self.resolution, self.resolution)

    def caption(self, index: int) -> str:
        return self.captions[index]

    def fingerprint(self, index: int) -> dict[str, Any]:
        """What the pixels of sample ``index`` depend on, for the encoder cache's keys: the file's
        sha256 (reading bytes is much cheaper than decoding), the crop's index when it is
        not centered, and the output size when it is not the signature's ``data.resolution``."""
        fp: dict[str, Any] = {
            "file_sha256": sha256_file(self.paths[index]),
            "pipeline": IMAGE_PIPELINE_VERSION,
        }
        if not self.center_crop:
            fp["crop_index"] = index
        if self.size_in_fingerprint:
            fp["size"] = list(self.group_of(index))
        if self.masks is not None:
            fp["mask_sha256"] = sha256_file(self.masks[index])
        if self.references is not None:
            fp["references_sha256"] = [sha256_file(r) for r in self.references[index]]
        return fp

    def describe(self) -> str:
        """One line at start: how many images are used, and what was skipped or upscaled and why."""
        r = self.resolution
        extra = []
        if self.buckets is not None:
            counts: dict[Size, int] = {}
            for size in self.sizes:
                counts[size] = counts.get(size, 0) + 1
            extra.append(describe_buckets(counts))
        skipped = [f"{n} {why}" for why, n in self.skipped.items() if n]
        if skipped:
            extra.append("skipped: " + ", ".join(skipped))
        if self.upscaled:
            p, (w, h) = self.upscaled[0]
            extra.append(f"{len(self.upscaled)} upscaled more than {UPSCALE_WARN}x, e.g. {p.name} {w}x{h}")
        if self.missing_captions:
            extra.append(f"{self.missing_captions} with empty captions")
        if self.masks is not None:
            extra.append(describe_masks(self.masks))
        if self.references is not None:
            extra.append(describe_references(self.references))
        extra.append("center crop" if self.center_crop else "per-index random crop")
        if not self.verified:
            extra.append("headers not pre-checked")
        if self.caption_ext != CAPTION_EXTENSION:
            extra.append(f"captions from {self.caption_ext} files")
        size = f"at {r}x{r}" if self.buckets is None else f"bucketed around {r}x{r}"
        return f"{len(self)} images used, {size}, from folder {str(self.root)!r} ({'; '.join(extra)})"


def _path_hint(key: str = "data.path", caption_ext: str = CAPTION_EXTENSION) -> str:
    return _PATH_HINT.replace("data.path", key).replace(".txt caption", f"{caption_ext} caption")


def _check_root(path: Any, key: str = "data.path") -> Path:
    shown = str(path)
    hint = _path_hint(key)
    if not shown.strip():
        raise UserError(f"{key} is empty ({shown!r}). {hint}")
    root = Path(os.path.expanduser(shown)).absolute()
    if not root.exists():
        raise UserError(f"{key}={shown!r} does not exist (looked for {str(root)!r}). {hint}")
    if not root.is_dir():
        raise UserError(f"{key}={shown!r} is a file, not a folder ({str(root)!r}). {hint}")
    return root


def _other_caption_ext(image: Path, caption_ext: str) -> str:
    """' (cat.txt is there: set data.caption_ext=.txt)' when a caption with another usual extension exists."""
    for ext in (CAPTION_EXTENSION, ".caption", ".tags", ".md"):
        if ext != caption_ext and image.with_suffix(ext).is_file():
            return f" ({image.with_suffix(ext).name} is there: set data.caption_ext={ext} to read those)"
    return ""


def _find_images(root: Path, caption_ext: str = CAPTION_EXTENSION, skip_masks: bool = False,
                 skip_references: bool = False) -> tuple[list[Path], dict[str, int]]:
    """All non-hidden image files under ``root``, sorted by relative POSIX path, and how many
    files were passed over, by reason (for the data summary line). ``skip_masks``
    (``data.masks=true``): ``masks/`` folders and ``*_mask`` images are masks, not samples;
    ``skip_references`` (``data.references > 0``): ``control*/`` folders and ``*_ref<k>`` images are references.

    Symlinked folders are followed (people link data sets in), with a guard against loops.
    """
    found: list[tuple[str, Path]] = []
    seen: set[str] = set()
    hidden, other_types = 0, {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        hidden += sum(d.startswith(".") for d in dirnames)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not (skip_references and is_control_folder(d))]
        for name in filenames:
            if name.startswith("."):
                hidden += 1
                continue
            ext = os.path.splitext(name)[1].lower()
            if ext in IMAGE_EXTENSIONS:
                p = Path(dirpath) / name
                if (skip_masks and is_mask_file(p)) or (skip_references and is_reference_file(p)):
                    continue
                found.append((p.relative_to(root).as_posix(), p))
            elif ext not in (CAPTION_EXTENSION, caption_ext.lower()):
                other_types[ext or "no extension"] = other_types.get(ext or "no extension", 0) + 1
    found.sort(key=lambda t: t[0])
    skipped = {"hidden files or folders": hidden}
    if other_types:
        kinds = ", ".join(sorted(other_types)[:4]) + (", ..." if len(other_types) > 4 else "")
        skipped[f"files that are not {_ACCEPTED} images ({kinds})"] = sum(other_types.values())
    return [p for _, p in found], skipped


def _read_captions(images: list[Path], caption_ext: str, missing_caption: str, shown: str,
                   key: str) -> tuple[list[str], int]:
    """Every image's caption, read eagerly so that a bad one fails before training, and how many
    images have none. A missing caption is an error naming the first few (and a caption file with
    another usual extension, if one is there), or under ``data.missing_caption=empty`` an empty
    caption and one warning."""
    captions: list[str] = []
    missing: list[Path] = []
    for img in images:
        cap = _caption_path(img, caption_ext)
        if cap is None:
            missing.append(img)
            captions.append("")
        else:
            captions.append(_read_caption(cap, shown, key))
    if missing:
        if missing_caption == "error":
            examples = ", ".join(
                f"{str(p)!r} needs {str(p.with_suffix(caption_ext))!r}" for p in missing[:3]
            )
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            other = _other_caption_ext(missing[0], caption_ext)
            refs = [p for p in missing if is_reference_file(p)]  # control/ or *_ref1 read as samples: data.references=0
            edit = (f" {str(refs[0])!r} looks like a reference image (runner/data/references.py): for an edit trainer "
                    "set data.references=1, which reads control/ and *_ref<k> files as references." if refs else "")
            raise UserError(
                f"{key}={shown!r}: {len(missing)} of {len(images)} images have no caption "
                f"file: {examples}{more}. Each image needs a same-named {caption_ext} file beside it "
                f"holding its caption (UTF-8){other}; or set data.missing_caption=empty to train "
                f"those images with an empty caption instead.{edit}"
            )
        log.warning(
            "%s=%r: %d of %d images have no %s caption; using an empty caption for "
            "them (data.missing_caption=empty). First: %s",
            key, shown, len(missing), len(images), caption_ext, missing[0],
        )
    return captions, len(missing)


def _verify_images(images: list[Path], resolution: int, shown: str, key: str) -> list[tuple[Path, tuple[int, int]]]:
    """Check every image's header (see VERIFY_LIMIT) and return the images whose short side is
    less than ``resolution / UPSCALE_WARN``, with their (width, height), warning once about them:
    blown up that far they teach the model blur."""
    upscaled: list[tuple[Path, tuple[int, int]]] = []
    for img in images:
        w, h = _verify_header(img, shown, key)
        if min(w, h) * UPSCALE_WARN < resolution:
            upscaled.append((img, (w, h)))
    if upscaled:
        p, (w, h) = upscaled[0]
        log.warning("%s=%r: %d images are upscaled more than %dx to %d px and will look blurry (first: "
                    "%s, %dx%d); remove them or lower data.resolution", key, shown, len(upscaled), UPSCALE_WARN,
                    resolution, p, w, h)
    return upscaled


def _caption_path(image: Path, caption_ext: str = CAPTION_EXTENSION) -> Path | None:
    """``cat.png`` -> ``cat.txt`` (or ``cat.TXT``; ``caption_ext`` instead of .txt) beside it, or None."""
    for ext in (caption_ext, caption_ext.upper()):
        cand = image.with_suffix(ext)
        if cand.is_file():
            return cand
    return None


def _read_caption(path: Path, shown: str, key: str = "data.path") -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(
            f"{key}={shown!r}: cannot read caption file {str(path)!r} ({e.strerror or e}). "
            "Make it a readable UTF-8 text file."
        ) from None
    try:
        text = raw.decode("utf-8-sig")  # tolerate a BOM, which Windows editors add
    except UnicodeDecodeError as e:
        raise UserError(
            f"{key}={shown!r}: caption file {str(path)!r} is not valid UTF-8 (byte "
            f"0x{raw[e.start]:02x} at offset {e.start}). Re-save it as UTF-8 text."
        ) from None
    return text.strip()
