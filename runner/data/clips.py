"""Clips on disk: finding them in a folder, counting their frames, decoding the frames a sample needs.

A clip is one of:

* a **folder of frames** (``clip1/0001.png`` ...) with its caption beside it (``clip1.txt``); the
  frames are ordered by name, numbers compared as numbers (``2.png`` before ``10.png``). A folder
  has no frame rate of its own: it is taken to be at ``data.fps`` (nothing is resampled);
* a **video file** (``.mp4 .mov .mkv .webm .avi .m4v``) with a same-named ``.txt`` caption,
  decoded by PyAV when it is installed (the ``video`` extra: ``pip install
  'diffusion-memory-runner[video]'``); its frame rate is the container's;
* an **animated GIF** (decoded by Pillow, no extra); its frame rate comes from its frame durations;
* an **image** with a caption: a one-frame clip.

Which frames a sample takes is :mod:`runner.data.video`'s business; here a clip only answers its
frame count and rate, and decodes a list of frame indices, reading the file front to back (exact
for every container, and cheap for the short clips video LoRAs train on).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, ImageSequence

from runner.data.images import IMAGE_EXTENSIONS, _load_rgb, _to_rgb
from runner.errors import UserError

VIDEO_EXTENSIONS: tuple[str, ...] = (".avi", ".m4v", ".mkv", ".mov", ".mp4", ".webm")
ANIMATED_EXTENSIONS: tuple[str, ...] = (".gif",)
STILL_EXTENSIONS: tuple[str, ...] = tuple(e for e in IMAGE_EXTENSIONS if e not in ANIMATED_EXTENSIONS)
CAPTION_EXTENSION = ".txt"
VIDEO_EXTRA_HINT = ("install a decoder with pip install 'diffusion-memory-runner[video]' (PyAV), or extract each "
                    "clip's frames into a folder (clip1/0001.png ... with clip1.txt beside the folder)")


@dataclass
class Clip:
    """One clip of the folder: where it is, its caption, and (once counted) its frames and rate."""

    kind: str  # frames | video | gif | image
    path: Path
    caption: str
    files: list[Path] = field(default_factory=list)  # frames folder: its frame files, in order
    length: int = 0  # frames in the clip
    fps: float | None = None  # the clip's own frame rate; None: a frames folder or an image

    def relative(self, root: Path) -> str:
        return self.path.relative_to(root).as_posix()


def natural_key(name: str) -> list[object]:
    """``frame2`` before ``frame10``: digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


def have_video_decoder() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


# ---- finding clips -------------------------------------------------------------------------------
def _caption_beside(path: Path) -> Path | None:
    """``clip.mp4`` or the folder ``clip/`` -> ``clip.txt`` (or ``.TXT``) beside it, or None."""
    base = path.parent / path.name if path.is_dir() else path.with_suffix("")
    for ext in (CAPTION_EXTENSION, CAPTION_EXTENSION.upper()):
        cand = base.parent / (base.name + ext)
        if cand.is_file():
            return cand
    return None


def _visible(names: list[str]) -> list[str]:
    return sorted((n for n in names if not n.startswith(".")), key=natural_key)


def find_clips(root: Path) -> tuple[list[tuple[str, Path, Path | None]], dict[str, int]]:
    """Every clip under ``root`` as ``(kind, path, caption file or None)``, in path order, and the
    files passed over by reason. A folder is a frames clip when it has a caption file beside it, or
    when it holds images none of which has a caption; otherwise it is searched on."""
    found: list[tuple[str, Path, Path | None]] = []
    skipped: dict[str, int] = {"hidden files or folders": 0}
    other: set[str] = set()

    def visit(folder: Path) -> None:
        try:
            names = os.listdir(folder)
        except OSError as e:
            raise UserError(f"data.path: cannot read folder {str(folder)!r} ({e.strerror or e}).") from None
        skipped["hidden files or folders"] += sum(n.startswith(".") for n in names)
        for name in _visible(names):
            path = folder / name
            if path.is_dir():
                stills = [p for p in _visible(os.listdir(path)) if Path(p).suffix.lower() in STILL_EXTENSIONS]
                caption = _caption_beside(path)
                uncaptioned = stills and not any(_caption_beside(path / p) for p in stills)
                if caption is not None or uncaptioned:
                    found.append(("frames", path, caption))
                else:
                    visit(path)
                continue
            ext = path.suffix.lower()
            if ext == CAPTION_EXTENSION:
                continue
            kind = ("video" if ext in VIDEO_EXTENSIONS else "gif" if ext in ANIMATED_EXTENSIONS
                    else "image" if ext in STILL_EXTENSIONS else None)
            if kind is None:
                other.add(ext or "no extension")
                skipped["other files"] = skipped.get("other files", 0) + 1
                continue
            found.append((kind, path, _caption_beside(path)))

    visit(root)
    if other:
        kinds = ", ".join(sorted(other)[:4]) + (", ..." if len(other) > 4 else "")
        skipped[f"files that are neither clips nor images ({kinds})"] = skipped.pop("other files")
    return found, skipped


# ---- counting frames ------------------------------------------------------------------------------
def _bad_clip(path: Path, shown: str, err: BaseException) -> UserError:
    reason = str(err) or type(err).__name__
    return UserError(f"data.path={shown!r}: cannot read clip {str(path)!r} ({reason}). Remove it or re-encode it "
                     f"(e.g. ffmpeg -i in.mov -c:v libx264 out.mp4).")


def count_frames(clip: Clip, shown: str) -> None:
    """Fill ``clip.length`` (and ``clip.fps`` for files that carry a rate), reading headers only
    where the container says how many frames it holds."""
    if clip.kind == "image":
        clip.length = 1
    elif clip.kind == "frames":
        clip.files = [clip.path / n for n in _visible(os.listdir(clip.path))
                      if Path(n).suffix.lower() in STILL_EXTENSIONS]
        clip.length = len(clip.files)
    elif clip.kind == "gif":
        try:
            with Image.open(clip.path) as im:
                clip.length = int(getattr(im, "n_frames", 1))
                duration = float(im.info.get("duration") or 100)  # ms per frame; browsers treat 0 as 100
        except Exception as e:  # PIL raises many types
            raise _bad_clip(clip.path, shown, e) from None
        clip.fps = 1000.0 / max(duration, 1.0)
    else:
        if not have_video_decoder():
            raise UserError(f"data.path={shown!r} holds video files ({clip.path.name} ...) but no video decoder is "
                            f"installed: {VIDEO_EXTRA_HINT}.")
        import av

        try:
            with av.open(str(clip.path)) as container:
                stream = container.streams.video[0]
                rate = stream.average_rate or stream.guessed_rate
                clip.fps = float(rate) if rate else None
                clip.length = int(stream.frames or 0)
                if clip.length <= 0:  # no frame count in the header: count by decoding
                    clip.length = sum(1 for _ in container.decode(stream))
        except (IndexError, av.error.FFmpegError, OSError) as e:
            raise _bad_clip(clip.path, shown, e) from None


# ---- decoding ---------------------------------------------------------------------------------------
def decode_frames(clip: Clip, indices: list[int], shown: str) -> list[Image.Image]:
    """RGB frames ``indices`` (ascending, possibly repeated) of ``clip``."""
    if clip.kind == "image":
        return [_load_rgb(clip.path, shown)] * len(indices)
    if clip.kind == "frames":
        return [_load_rgb(clip.files[i], shown) for i in indices]
    wanted = sorted(set(indices))
    got: dict[int, Image.Image] = {}
    try:
        if clip.kind == "gif":
            with Image.open(clip.path) as im:
                for i, frame in enumerate(ImageSequence.Iterator(im)):
                    if i in wanted:
                        got[i] = _to_rgb(frame.copy())
                    if i >= wanted[-1]:
                        break
        else:
            import av

            with av.open(str(clip.path)) as container:
                for i, frame in enumerate(container.decode(container.streams.video[0])):
                    if i in wanted:
                        got[i] = frame.to_image().convert("RGB")
                    if i >= wanted[-1]:
                        break
    except Exception as e:  # decoders raise many types; any of them means an unusable file
        raise _bad_clip(clip.path, shown, e) from None
    missing = [i for i in wanted if i not in got]
    if missing:
        raise _bad_clip(clip.path, shown, ValueError(f"it ends before frame {missing[0]} of the {clip.length} its "
                                                     f"header announces"))
    return [got[i] for i in indices]
