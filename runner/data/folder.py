"""A folder of captioned images (kohya / dreambooth layout): :class:`FolderDataset`.

Folder layout: every image (``.png .jpg .jpeg .webp .bmp``, any letter case) has a same-named
``.txt`` caption beside it (``cat.png`` + ``cat.txt``). The folder is searched recursively, so
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

from torch.utils.data import Dataset

from runner.data.checks import _check_missing_caption, _check_resolution
from runner.data.images import (
    _ACCEPTED,
    IMAGE_EXTENSIONS,
    _load_rgb,
    _resize_crop,
    _to_tensor,
    _verify_header,
)
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
    ) -> None:
        self.resolution = _check_resolution(resolution)
        missing_caption = _check_missing_caption(missing_caption)
        self.center_crop = center_crop
        self.root = _check_root(path)
        shown = str(path)

        images, self.skipped = _find_images(self.root)
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
        self.upscaled: list[tuple[Path, tuple[int, int]]] = []  # short side < resolution / UPSCALE_WARN
        if self.verified:
            for img in images:
                w, h = _verify_header(img, shown)
                if min(w, h) * UPSCALE_WARN < self.resolution:
                    self.upscaled.append((img, (w, h)))
        if self.upscaled:
            p, (w, h) = self.upscaled[0]
            log.warning("data.path=%r: %d images are upscaled more than %dx to %d px and will look blurry (first: "
                        "%s, %dx%d); remove them or lower data.resolution", shown, len(self.upscaled), UPSCALE_WARN,
                        self.resolution, p, w, h)

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
        return {"pixel_values": _to_tensor(img), "caption": self.captions[index], "index": index}

    def describe(self) -> str:
        """One line at start: how many images are used, and what was skipped or upscaled and why."""
        r = self.resolution
        extra = []
        skipped = [f"{n} {why}" for why, n in self.skipped.items() if n]
        if skipped:
            extra.append("skipped: " + ", ".join(skipped))
        if self.upscaled:
            p, (w, h) = self.upscaled[0]
            extra.append(f"{len(self.upscaled)} upscaled more than {UPSCALE_WARN}x, e.g. {p.name} {w}x{h}")
        if self.missing_captions:
            extra.append(f"{self.missing_captions} with empty captions")
        extra.append("center crop" if self.center_crop else "per-index random crop")
        if not self.verified:
            extra.append("headers not pre-checked")
        return f"{len(self)} images used, at {r}x{r}, from folder {str(self.root)!r} ({'; '.join(extra)})"


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


def _find_images(root: Path) -> tuple[list[Path], dict[str, int]]:
    """All non-hidden image files under ``root``, sorted by relative POSIX path, and how many
    files were passed over, by reason (for the data summary line).

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
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                hidden += 1
                continue
            ext = os.path.splitext(name)[1].lower()
            if ext in IMAGE_EXTENSIONS:
                p = Path(dirpath) / name
                found.append((p.relative_to(root).as_posix(), p))
            elif ext != CAPTION_EXTENSION:
                other_types[ext or "no extension"] = other_types.get(ext or "no extension", 0) + 1
    found.sort(key=lambda t: t[0])
    skipped = {"hidden files or folders": hidden}
    if other_types:
        kinds = ", ".join(sorted(other_types)[:4]) + (", ..." if len(other_types) > 4 else "")
        skipped[f"files that are not {_ACCEPTED} images ({kinds})"] = sum(other_types.values())
    return [p for _, p in found], skipped


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
