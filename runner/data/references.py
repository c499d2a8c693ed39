"""``data.references=N``: paired edit data, N reference (control) images per target, checked before step 1.

An edit model (Flux.1 Kontext; later Qwen-Image-Edit, Flux.2) learns "target = instruction applied to
the references": each training image is the *target*, its caption the *instruction*, and it has
``data.references`` reference images. Where reference ``k`` (1-based) of ``photos/cat.jpg`` is found
(the peers' two conventions; the first that exists wins, as for masks):

1. a control folder beside the image with the same name (ai-toolkit's and OneTrainer's "control
   folder" layout): ``photos/control/cat.png`` for reference 1, ``photos/control2/cat.png`` for
   reference 2, and so on;
2. ``<stem>_ref<k>.<ext>`` beside the image (the suffix layout): ``photos/cat_ref1.png``.

``<ext>`` is any image extension the data accepts, ``.png`` tried first. With ``data.references > 0``
control folders and ``*_ref<k>`` files are never training images themselves.

In the batch, a sample's references are one tensor ``references``: float32 ``[N, 3, H, W]`` in
[-1, 1] (``[B, N, 3, H, W]`` collated), generic over the family: a trainer says how many it takes
(``max_references``) and what it does with them. Each reference is resized to its target's size as
shown (after EXIF rotation), then cropped, bucketed and flipped with the target (runner/data/folder.py,
runner/data/flip.py), so both show the same framing; the latent cache keys by the references' bytes
too (their sha256 is in the sample's fingerprint).

Refused before training, naming the file (:func:`find_references`): a target without one of its
references, a reference that cannot be read, one whose aspect ratio differs from its target's by
more than :data:`RATIO_TOLERANCE` (after the shared crop it would show other content: a family
trained on a batch of same-sized targets and references cannot take it), and a reference beyond
``data.references`` (``cat_ref2.png`` with ``data.references=1``: it would be ignored silently).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from runner.data.images import IMAGE_EXTENSIONS, _verify_header, oriented_size
from runner.errors import UserError

CONTROL_FOLDER = "control"
REF_SUFFIX = "_ref"
RATIO_TOLERANCE = 0.01  # as for masks: a reference saved at a scaled size still matches
_EXTS = (".png",) + tuple(e for e in IMAGE_EXTENSIONS if e != ".png")
_CONTROL_RE = re.compile(rf"^{CONTROL_FOLDER}\d*$")
_REF_RE = re.compile(rf"{REF_SUFFIX}\d+$")
LAYOUT = ("control/<stem>.png (control2/ for a second reference ...) beside the image, else "
          "<stem>_ref1.png (<stem>_ref2.png ...) beside it")


def is_reference_file(path: Path) -> bool:
    """A file that :func:`find_reference` would read as a reference (in ``control*/`` or ``*_ref<k>``)."""
    return bool(_REF_RE.search(path.stem)) or bool(_CONTROL_RE.match(path.parent.name))


def is_control_folder(name: str) -> bool:
    """``control``, ``control2`` ...: folders that hold references, not training images."""
    return bool(_CONTROL_RE.match(name))


def _candidates(image: Path, k: int) -> list[tuple[Path, str]]:
    folder = CONTROL_FOLDER if k == 1 else f"{CONTROL_FOLDER}{k}"
    return [(image.parent / folder, image.stem), (image.parent, f"{image.stem}{REF_SUFFIX}{k}")]


def find_reference(image: Path, k: int) -> Path | None:
    """Reference ``k`` (1-based) of ``image``: its control folder first, then ``<stem>_ref<k>``; None if neither."""
    for folder, stem in _candidates(image, k):
        for ext in _EXTS:
            for candidate in (folder / (stem + ext), folder / (stem + ext.upper())):
                if candidate.is_file():
                    return candidate
    return None


def _expected(image: Path, k: int) -> str:
    (folder, stem), (_, suffixed) = _candidates(image, k)
    return f"{str(folder / (stem + '.png'))!r} or {str(image.parent / (suffixed + '.png'))!r}"


def check_reference(path: Path, image_size: tuple[int, int], shown: str, key: str) -> None:
    """Refuse a reference that cannot be read or whose aspect ratio differs from its target's.

    ``image_size``: the target's (width, height) as shown (after EXIF rotation). The header is
    verified here; the pixels are decoded per visit, where a truncated body is caught naming the file."""
    _verify_header(path, shown, key)
    rw, rh = oriented_size(path, shown, key)
    iw, ih = image_size
    if abs(rw / rh - iw / ih) > RATIO_TOLERANCE * (iw / ih):
        raise UserError(
            f"{key}={shown!r}: reference {str(path)!r} is {rw}x{rh} but its target is {iw}x{ih}: the aspect ratios "
            "differ, so after the crop they share the reference would show other content than the target. Crop or pad "
            "the reference to the target's aspect ratio (any size of it: it is resized to the target's), or remove "
            "the pair.")


def find_references(images: list[Path], sizes: list[tuple[int, int]], count: int, key: str,
                    shown: str) -> list[list[Path]]:
    """Every image's ``count`` references, each checked (:func:`check_reference`); a UserError naming
    the first missing one, or the first reference beyond ``count``."""
    found = [[find_reference(p, k) for k in range(1, count + 1)] for p in images]
    missing = [(p, k) for p, refs in zip(images, found) for k, r in enumerate(refs, 1) if r is None]
    if missing:
        (first, k), more = missing[0], (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        raise UserError(
            f"{key}={shown!r}: data.references={count} but {len(missing)} reference images are missing, e.g. "
            f"reference {k} of {str(first)!r}{more}: looked for {_expected(first, k)}. Give every target "
            f"{count} reference image(s) ({LAYOUT}), remove the target, or lower data.references.")
    _refuse_orphans(images, key, shown)
    for p in images:
        extra = find_reference(p, count + 1)
        if extra is not None:
            raise UserError(
                f"{key}={shown!r}: {str(extra)!r} is reference {count + 1} of {str(p)!r}, but data.references={count}: "
                f"it would be ignored. Set data.references={count + 1} (if the trainer takes that many) or move the "
                "file out of the data folder.")
    for refs, size in zip(found, sizes):
        for r in refs:
            check_reference(r, size, shown, key)  # type: ignore[arg-type]
    return found  # type: ignore[return-value]


def _orphans(images: list[Path]) -> list[Path]:
    """Reference images beside the targets' folders whose target image is not there (a pair with its target missing)."""
    targets = {(p.parent, p.stem) for p in images}
    out: list[Path] = []
    for parent in sorted({p.parent for p in images}):
        for child in sorted(parent.iterdir()):
            if child.is_dir() and is_control_folder(child.name):
                out += [f for f in sorted(child.iterdir())
                        if f.suffix.lower() in _EXTS and not f.name.startswith(".") and (parent, f.stem) not in targets]
            elif child.suffix.lower() in _EXTS and _REF_RE.search(child.stem):
                if (parent, _REF_RE.sub("", child.stem)) not in targets:
                    out.append(child)
    return out


def _refuse_orphans(images: list[Path], key: str, shown: str) -> None:
    orphans = _orphans(images)
    if orphans:
        first = orphans[0]
        stem = _REF_RE.sub("", first.stem)
        target = (first.parent.parent if is_control_folder(first.parent.name) else first.parent) / f"{stem}.png"
        more = f" (and {len(orphans) - 1} more)" if len(orphans) > 1 else ""
        raise UserError(
            f"{key}={shown!r}: reference {str(first)!r}{more} has no target image: looked for {str(target)!r} (any "
            "image extension). The pair would be dropped. Add the target image (with its caption), or remove the "
            "reference.")


def describe_references(refs: list[list[Path]]) -> str:
    """``"references: 2 per target, 3 from control folders, 1 from *_ref files"``."""
    flat = [r for rs in refs for r in rs]
    in_folder = sum(is_control_folder(r.parent.name) for r in flat)
    parts = [f"{n} from {where}" for n, where in ((in_folder, "control folders"), (len(flat) - in_folder, "*_ref files"))
             if n]
    per = len(refs[0]) if refs else 0
    return f"references: {per} per target, " + ", ".join(parts)


def run_references(cfg: Any) -> int:
    """Reference images per target the run's trainer reads, known before it is built (for the data
    check of validation, runner/checks.py): ``data.references`` when set, else the trainer
    class's ``default_references`` (runner/trainer.py "Reference images"; 0 when it declares none or
    cannot be imported: that is reported when it is built). Whether the trainer takes that many is
    checked when it is built (:func:`runner.trainer.reference_count`)."""
    from hydra.utils import get_class

    data = cfg.get("data") if hasattr(cfg, "get") else None
    value = data.get("references") if data is not None and hasattr(data, "get") else None
    if value is not None:
        return value  # checked by runner/data/checks.py with the other data.* values
    try:
        cls = get_class(str(cfg.trainer.get("_target_")))
    except Exception:  # noqa: BLE001 - an unimportable trainer is reported when it is built
        return 0
    default = getattr(cls, "default_references", 0)
    return default if isinstance(default, int) and not isinstance(default, bool) and default >= 0 else 0
