"""Checks of the ``data.*`` values, shared by :func:`runner.data.build_dataset` and the datasets.

Each bad value raises a :class:`runner.errors.UserError` that names the key and a valid example,
before any file is read, so a typo fails in milliseconds.
"""
from __future__ import annotations

from typing import Any

from runner.errors import UserError, valid_list

MISSING_CAPTION_MODES: tuple[str, ...] = ("error", "empty")


def _get(cfg: Any, key: str, default: Any) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def check_index(index: int, size: int, what: str) -> int:
    """``index`` into a data set of ``size`` ``what`` ("images", "samples"), a negative one
    counted from the end as for a list; out of range is an IndexError, which also ends a plain
    ``for sample in dataset`` loop."""
    if index < 0:
        index += size
    if not 0 <= index < size:
        raise IndexError(f"index {index} out of range for {size} {what}")
    return index


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


def _check_masks(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise UserError(f"data.masks={value!r} is not valid: give true (a loss mask per image, masks/<stem>.png or "
                    "<stem>_mask.png beside it; runner/data/masks.py) or false (the whole image is trained).")


def _check_references(data_cfg: Any) -> int:
    """``data.references``: reference (control) images per target for an edit trainer (runner/data/references.py)."""
    value = _get(data_cfg, "references", 0)
    value = 0 if value is None else value
    if not _whole(value) or value < 0:
        raise UserError(f"data.references={value!r} is not valid: the number of reference (control) images per target "
                        "image, a whole number >= 0 (0: plain captioned images; 1 for trainer=flux_kontext), found as "
                        "control/<stem>.png or <stem>_ref1.png beside each image (runner/data/references.py).")
    return int(value)


EDIT_FAMILIES = ", or train an edit family (trainer=flux_kontext or qwen_image_edit)"
DECLARE = (", or declare it on the trainer: max_references = N (the most it takes) and default_references (what "
           "an unset data.references trains on), see 'Reference images' in runner/trainer.py")


def family_references(data_cfg: Any, max_references: int, name: str, default: int = 0,
                      other: str = EDIT_FAMILIES) -> int:
    """``data.references``, refused when it exceeds what trainer ``name`` takes (its ``max_references``):
    a reference no family reads would be ignored silently. Unset (null), it is the family's own count
    (``default``): an edit family that needs references trains on them (Kontext: 1), any other family
    on plain images (Flux.2 takes references but does not need them: 0), so a preset written for an
    edit family sets no data key another trainer would have to refuse. ``other``: what else a user can
    do when the trainer takes none (a built-in: train an edit family; a user's trainer: :data:`DECLARE`)."""
    if data_cfg is None or _get(data_cfg, "references", None) is None:
        return default
    count = _check_references(data_cfg)
    if count > max_references:
        takes = (f"takes at most {max_references} reference image(s) per target" if max_references
                 else "is not an edit model: it takes no reference images")
        raise UserError(f"data.references={count}: {name} {takes}. Set data.references={min(count, max_references)}"
                        f"{'' if max_references else other}.")
    return count


def check_reference_declaration(max_references: Any, default: Any, name: str) -> tuple[int, int]:
    """A trainer's declared ``max_references`` / ``default_references`` (runner/trainer.py), as ints:
    whole numbers with ``0 <= default <= max``, else a UserError naming the attribute. Checked once,
    when the trainer is built, so a wrong declaration is not read as "takes no references"."""
    for attr, value in (("max_references", max_references), ("default_references", default)):
        if not _whole(value) or value < 0:
            raise UserError(f"{name}.{attr}={value!r} is not valid: a whole number >= 0 of reference images per "
                            "target (max_references: the most the trainer takes; default_references: how many an "
                            "unset data.references trains on, at most max_references). See 'Reference images' in "
                            "runner/trainer.py.")
    if default > max_references:
        raise UserError(f"{name}.default_references={default} is more than its max_references={max_references}: an "
                        "unset data.references would ask for more reference images than the trainer takes. Lower "
                        f"default_references to at most {max_references}, or raise max_references.")
    return int(max_references), int(default)


def _check_demo_prior(data_cfg: Any) -> int:
    value = _get(data_cfg, "demo_prior", 0)
    value = 0 if value is None else value
    if not _whole(value) or value < 0:
        raise UserError(f"data.demo_prior={value!r} is not valid: the number of images of the built-in prior (class) "
                        "set beside the demo set, a whole number >= 0, e.g. data.demo_prior=4 (0: none).")
    if value and (_get(data_cfg, "path", None) is not None or _get(data_cfg, "sets", None)):
        raise UserError(f"data.demo_prior={value} adds a prior set to the built-in demo set, but data.path or "
                        "data.sets is set. Give your own class images as a set with role: prior, e.g. data.sets='[{path: "
                        "/data/dog}, {path: /data/dogs_class, role: prior}]', and leave data.demo_prior at 0.")
    return value


SET_KEYS: tuple[str, ...] = ("path", "repeats", "weight", "caption_ext", "resolution", "role")
SET_ROLES: tuple[str, ...] = ("instance", "prior")  # prior: a regularization (class) set, loss x loss.prior_weight


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_caption_ext(value: Any, key: str = "data.caption_ext") -> str:
    """``.txt``, ``.caption`` ...: a dot, then letters, digits, ``_`` or ``-`` (no folder part)."""
    text = str(value) if value is not None else ""
    body = text[1:]
    if text.startswith(".") and body and all(c.isalnum() or c in "_-" for c in body):
        return text
    near = "." + text.lstrip(".*") if text.lstrip(".*") and all(c.isalnum() or c in "_-" for c in text.lstrip(".*")) else ""
    hint = f" Did you mean {key}={near}?" if near and near != text else ""
    raise UserError(
        f"{key}={value!r} is not valid: it is the extension of the caption file beside each image, a dot and a "
        f"name, e.g. {key}=.txt (the default) or {key}=.caption (kohya's --caption_extension).{hint}"
    )


def _check_optional_resolution(value: Any, key: str) -> int | None:
    if value is None:
        return None
    try:
        return _check_resolution(value)
    except UserError as e:
        raise UserError(str(e).replace("data.resolution", key)) from None


def _check_bucket_settings(data_cfg: Any) -> tuple[bool, int, int | None, int | None]:
    buckets = _get(data_cfg, "buckets", False)
    if not isinstance(buckets, bool):
        raise UserError(f"data.buckets={buckets!r} is not valid: give true (aspect-ratio buckets) or false (square crops).")
    step = _get(data_cfg, "bucket_step", 64)
    if not _whole(step) or step <= 0 or step % 8:
        raise UserError(
            f"data.bucket_step={step!r} is not valid: bucket sides are multiples of it, a whole number of pixels that "
            "is a multiple of 8 (the VAE factor; 16 for Flux), e.g. data.bucket_step=64 (kohya's --bucket_reso_steps)."
        )
    sides = {}
    for name in ("bucket_min_side", "bucket_max_side"):
        value = _get(data_cfg, name, None)
        if value is not None and (not _whole(value) or value < step):
            raise UserError(
                f"data.{name}={value!r} is not valid: give a whole number of pixels of at least data.bucket_step="
                f"{step}, or leave it unset (null) for {'half' if name == 'bucket_min_side' else 'twice'} "
                "data.resolution."
            )
        sides[name] = value
    low, high = sides["bucket_min_side"], sides["bucket_max_side"]
    if low is not None and high is not None and low > high:
        raise UserError(f"data.bucket_min_side={low} is larger than data.bucket_max_side={high}; swap them.")
    return buckets, step, low, high


def _check_sets(data_cfg: Any) -> list[dict[str, Any]]:
    """``data.sets`` as plain dicts, every value checked; ``[]`` when unset."""
    raw = _get(data_cfg, "sets", None)
    if raw is None:
        return []
    try:
        from omegaconf import OmegaConf

        items = OmegaConf.to_container(raw, resolve=True) if OmegaConf.is_config(raw) else list(raw)
    except Exception:  # noqa: BLE001 - not a list at all
        items = None
    if not isinstance(items, list):
        raise UserError(f"data.sets={raw!r} is not valid: give a list of sets, e.g. "
                        "data.sets='[{path: /data/a, repeats: 2}, {path: /data/b}]'.")
    if items and _get(data_cfg, "path", None) is not None:
        raise UserError("data.path and data.sets are both set: data.path is the shorthand for one set. Put that "
                        "folder into data.sets as one more {path: ...} entry, or leave data.sets empty.")
    out = []
    for n, item in enumerate(items):
        key = f"data.sets[{n}]"
        if not isinstance(item, dict):
            raise UserError(f"{key}={item!r} is not valid: each set is a mapping such as {{path: /data/a, repeats: 2}}.")
        unknown = sorted(set(item) - set(SET_KEYS))
        if unknown:
            from runner.errors import did_you_mean

            raise UserError(f"Unknown key '{key}.{unknown[0]}'.{did_you_mean(str(unknown[0]), SET_KEYS)} "
                            f"Valid keys of a set: {', '.join(SET_KEYS)}.")
        path = item.get("path")
        if path is None or not str(path).strip():
            raise UserError(f"{key}.path is missing: every set needs the folder of its images, e.g. "
                            f"data.sets='[{{path: /data/a}}]'.")
        repeats = item.get("repeats", 1)
        repeats = 1 if repeats is None else repeats
        if not _whole(repeats) or repeats < 1:
            raise UserError(f"{key}.repeats={repeats!r} is not valid: how many times each image of the set appears "
                            "per epoch, a whole number >= 1 (kohya's num_repeats), e.g. repeats: 10.")
        weight = item.get("weight")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0):
            raise UserError(f"{key}.weight={weight!r} is not valid: the relative chance that a step's batch comes from "
                            "this set, a number > 0 (SimpleTuner's probability), or unset on every set.")
        ext = item.get("caption_ext")
        role = "instance" if item.get("role") is None else item.get("role")
        if role not in SET_ROLES:
            raise UserError(f"{key}.role={role!r} is not valid; valid values: {valid_list(str(role), SET_ROLES)} "
                            "(instance: the images to learn; prior: a regularization set of the class, DreamBooth's "
                            "prior preservation, whose loss is multiplied by loss.prior_weight).")
        out.append({
            "path": str(path),
            "repeats": int(repeats),
            "weight": None if weight is None else float(weight),
            "caption_ext": None if ext is None else _check_caption_ext(ext, f"{key}.caption_ext"),
            "resolution": _check_optional_resolution(item.get("resolution"), f"{key}.resolution"),
            "role": role,
        })
    if out and all(s["role"] == "prior" for s in out):
        raise UserError("data.sets: every set has role: prior, so nothing is left to learn. Give the images to learn "
                        "role: instance (the default) and keep role: prior for the regularization (class) set.")
    weighted = [s["weight"] is not None for s in out]
    if any(weighted) and not all(weighted):
        unset = ", ".join(f"data.sets[{n}]" for n, w in enumerate(weighted) if not w)
        raise UserError(f"data.sets: weight is set on some sets but not on {unset}. Give every set a weight (the "
                        "chance a step's batch comes from it) or none (sets then mix in proportion to images x repeats).")
    return out
