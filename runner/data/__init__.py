"""Training data: a folder of captioned images, several of them, or a built-in procedural demo set.

``build_dataset(cfg.data)`` returns a map-style :class:`torch.utils.data.Dataset` whose samples
are ``{"pixel_values": float32 [3, H, W] in [-1, 1], "caption": str, "index": int}`` (and, with
aspect-ratio buckets, ``original_size`` and ``crop_top_left`` for SDXL's ``time_ids``). The runner
owns sample order and batching (:mod:`runner.data.order`; it calls ``ds.visit(i, seed)`` or
``ds[i]`` and :func:`collate`), so everything here is a pure function of the index and, for what
varies per visit (captions), of the visit's seed: the same visit always yields the same tensor
and text, in any process, in any epoch. That is what makes runs resumable and micro-batch splits
invisible, and it is why the augmentations are *deterministic per index or per visit* rather
than drawn from a global RNG.

What a dataset may offer the runner besides ``ds[i]`` (all optional; a user's own dataset needs
none of them): ``visit(i, seed)`` (the sample as that visit trains on it), ``light_visit(i, seed)``
(the same without pixels, when every latent is cached), ``group_of(i)`` (its output size: a
batch's samples share it), ``set_layout()`` (runner/data/sets.py), ``caption(i)`` and
``fingerprint(i)`` (what the encoder cache keys by), ``extra_captions()`` (caption texts visits
may add, for the cache), ``describe()`` (the log line).

The package: :mod:`runner.data.folder` (a folder of images with captions), :mod:`runner.data.demo`
(the built-in coloured shapes), :mod:`runner.data.images` (decoding, resize/crop,
per-index randomness), :mod:`runner.data.captions` (caption dropout, tag shuffling),
:mod:`runner.data.buckets` (aspect-ratio buckets), :mod:`runner.data.sets` (several sets,
repeats, weights), :mod:`runner.data.order` (each step's batch), :mod:`runner.data.checks`
(``data.*`` values) and :mod:`runner.data.flip` (``data.random_flip``: decided per visit by the
runner, on the collated batch, not here), :mod:`runner.data.masks` (``data.masks``) and :mod:`runner.data.references`
(``data.references``: reference images per target for edit trainers, a ``references`` tensor
``[N, 3, H, W]`` per sample).

Errors a user can cause (missing folder, no images, missing or non-UTF-8 captions, unreadable
images, bad ``data.*`` values) raise :class:`runner.errors.UserError` naming the key and file.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from runner.data.buckets import BucketSpec, Size
from runner.data.captions import CaptionRules, caption_rules
from runner.data.checks import (
    _check_bucket_settings,
    _check_caption_ext,
    _check_demo_prior,
    _check_masks,
    _check_missing_caption,
    _check_references,
    _check_resolution,
    _check_sets,
    _get,
)
from runner.data.demo import DemoDataset, DemoPrior
from runner.data.folder import FolderDataset
from runner.data.order import BatchOrder, StepBatch
from runner.data.sets import TrainingData
from runner.errors import UserError

__all__ = ["BatchOrder", "DemoDataset", "FolderDataset", "StepBatch", "TrainingData", "build_dataset", "build_video_dataset", "refuse_image_only_options",
           "check_dataset", "check_options", "collate", "describe_dataset", "planned_size", "visit_samples"]


@dataclass(frozen=True)
class DataOptions:
    """Every ``data.*`` value, checked (:func:`check_options`), before any file is read."""

    resolution: int
    missing_caption: str
    center_crop: bool
    caption_ext: str
    rules: CaptionRules
    buckets: bool
    bucket_step: int
    bucket_min_side: int | None
    bucket_max_side: int | None
    sets: tuple[dict[str, Any], ...]
    path: str | None
    demo_size: Any
    masks: bool = False
    demo_prior: int = 0
    references: int = 0

    def bucket_spec(self, resolution: int) -> BucketSpec | None:
        if not self.buckets:
            return None
        return BucketSpec(resolution, self.bucket_step, self.bucket_min_side, self.bucket_max_side)


def check_options(data_cfg: Any) -> DataOptions:
    """Check every ``data.*`` value (types, ranges, names) without reading a file; a UserError
    naming the key otherwise. Called in validation, so a typo fails in milliseconds."""
    resolution = _check_resolution(_get(data_cfg, "resolution", 64))
    buckets, step, low, high = _check_bucket_settings(data_cfg)
    sets = tuple(_check_sets(data_cfg))
    options = DataOptions(
        resolution=resolution,
        missing_caption=_check_missing_caption(_get(data_cfg, "missing_caption", "error")),
        center_crop=bool(_get(data_cfg, "center_crop", True)),
        caption_ext=_check_caption_ext(_get(data_cfg, "caption_ext", ".txt")),
        rules=caption_rules(data_cfg),
        buckets=buckets, bucket_step=step, bucket_min_side=low, bucket_max_side=high,
        sets=sets,
        path=_get(data_cfg, "path", None),
        demo_size=_get(data_cfg, "demo_size", 16),
        masks=_check_masks(_get(data_cfg, "masks", False)),
        demo_prior=_check_demo_prior(data_cfg),
        references=_check_references(data_cfg),
    )
    if buckets:
        for res, key in [(resolution, "data.resolution")] + [
                (s["resolution"], f"data.sets[{n}].resolution") for n, s in enumerate(sets) if s["resolution"]]:
            if (low is not None and low > res) or (high is not None and high < res):
                raise UserError(
                    f"{key}={res} is outside data.bucket_min_side={low} .. data.bucket_max_side={high}: the buckets "
                    "are built around the resolution's area, so it must lie between the side limits. Widen them or "
                    "leave them unset (half and twice the resolution)."
                )
    return options


def build_dataset(data_cfg: Any, references: int | None = None) -> Dataset:
    """Build the training dataset described by ``cfg.data`` (a DataConfig or a DictConfig).

    ``data.path`` and ``data.sets`` unset -> :class:`DemoDataset` (no files, no download);
    ``data.path`` -> :class:`FolderDataset`; ``data.sets`` -> :class:`TrainingData` over one
    folder per set. With caption dropout or tag shuffling the result is a :class:`TrainingData`
    (it applies them per visit). All ``data.*`` values are validated here, before any file is
    read, so a typo fails in milliseconds. ``references``: the trainer's count of reference images per
    target (its ``data.references``, resolved with the family's default: runner/data/checks.py).
    """
    o = check_options(data_cfg)
    if references is not None:
        o = dataclasses.replace(o, references=references)
    if not o.sets and o.path is None:
        demo_size = o.demo_size
        if isinstance(demo_size, bool) or not isinstance(demo_size, int) or demo_size < 1:
            raise UserError(
                f"data.demo_size={demo_size!r} is not valid: it is the number of images in the "
                "built-in demo set (used because data.path is unset) and must be a whole number "
                "of at least 1, e.g. data.demo_size=16."
            )
        base: Dataset = DemoDataset(demo_size, o.resolution, masks=o.masks, references=o.references)  # always square
        if o.demo_prior:  # data.demo_prior: a built-in regularization (class) set beside it
            prior = DemoPrior(o.demo_prior, o.resolution, masks=o.masks, references=o.references)
            return TrainingData([(base, 1, None, "demo"), (prior, 1, None, "data.demo_prior")], o.rules,
                                priors=frozenset({1}))
        return TrainingData([(base, 1, None, "demo")], o.rules) if o.rules.active else base

    handed_over = _take(_folder_key(data_cfg, references=o.references))
    if handed_over is not None:
        return handed_over
    if not o.sets:
        folder = FolderDataset(o.path, o.resolution, center_crop=o.center_crop,
                               missing_caption=o.missing_caption, caption_ext=o.caption_ext,
                               buckets=o.bucket_spec(o.resolution), masks=o.masks, references=o.references)
        return TrainingData([(folder, 1, None, "data.path")], o.rules) if o.rules.active else folder
    parts = []
    for n, s in enumerate(o.sets):
        res = s["resolution"] or o.resolution
        folder = FolderDataset(s["path"], res, center_crop=o.center_crop,
                               missing_caption=o.missing_caption, caption_ext=s["caption_ext"] or o.caption_ext,
                               buckets=o.bucket_spec(res), key=f"data.sets[{n}].path",
                               size_in_fingerprint=res != o.resolution, masks=o.masks,
                               references=o.references)
        parts.append((folder, s["repeats"], s["weight"], f"data.sets[{n}]"))
    return TrainingData(parts, o.rules, priors=frozenset(n for n, s in enumerate(o.sets) if s["role"] == "prior"))


def check_dataset(data_cfg: Any, video: Any = None, references: int | None = None) -> None:
    """Build the folder data set during validation, so that a broken image or caption fails before
    the plan and the model build, and hand it to the next :func:`build_dataset` of the same settings
    (the trainer's, seconds later) so the scan and header checks run once. Handed over once only:
    later builds read the folder again, so edits between runs of one process are seen. Every job
    of a sweep is checked before the first starts, so each keeps its own hand-off until it builds.

    ``video``: a video trainer's ``(default_frames, default_fps)`` (its ``video_defaults``): the
    folder is read as clips (:func:`build_video_dataset`) instead of images. ``references``: the trainer's
    count of reference images per target (an unset ``data.references`` is its ``default_references``:
    runner/data/references.py :func:`run_references`), so the folder is checked as the trainer reads it."""
    from runner.data.video import check_video_keys

    check_video_keys(data_cfg)
    if _get(data_cfg, "path", None) is None and not _get(data_cfg, "sets", None):
        return
    if video is not None:
        _CHECKED[_folder_key(data_cfg, video)] = build_video_dataset(data_cfg, *video)
    else:
        count = check_options(data_cfg).references if references is None else references
        _CHECKED[_folder_key(data_cfg, references=count)] = build_dataset(data_cfg, references=count)


def build_video_dataset(data_cfg: Any, default_frames: int, default_fps: float | None,
                        audio_rate: int | None = None) -> Dataset:
    """The clips of ``cfg.data`` for a video trainer (runner/data/video.py): ``data.path``'s clips,
    or the built-in moving shapes. ``default_frames``/``default_fps``: the trainer's values for an
    unset ``data.frames``/``data.fps``; ``audio_rate``: an audio-video trainer's rate (each sample gets its audio)."""
    from runner.data.demo_video import DemoClips
    from runner.data.video import ClipFolderDataset, check_video_keys, clip_settings

    check_video_keys(data_cfg)
    _check_resolution(_get(data_cfg, "resolution", 64))
    refuse_image_only_options(data_cfg)
    rules = caption_rules(data_cfg)
    settings = clip_settings(data_cfg, default_frames, default_fps, audio_rate)
    path = _get(data_cfg, "path", None)
    if path is None:
        demo_size = _get(data_cfg, "demo_size", 16)
        if isinstance(demo_size, bool) or not isinstance(demo_size, int) or demo_size < 1:
            raise UserError(f"data.demo_size={demo_size!r} is not valid: it is the number of clips in the built-in "
                            "demo set (used because data.path is unset) and must be a whole number of at least 1.")
        return _with_caption_rules(DemoClips(demo_size, settings), rules, "demo")
    handed_over = _take(_folder_key(data_cfg, (default_frames, default_fps)))
    if handed_over is not None:
        return handed_over
    clips = ClipFolderDataset(path, settings, missing_caption=_check_missing_caption(_get(data_cfg, "missing_caption",
                                                                                           "error")))
    return _with_caption_rules(clips, rules, "data.path")


def _with_caption_rules(clips: Dataset, rules: CaptionRules, name: str) -> Dataset:
    """Clips with ``data.caption_dropout`` / ``data.shuffle_tags`` applied per visit, as images get them
    (runner/data/sets.py ``TrainingData`` is generic over the data set it wraps)."""
    if not rules.active:
        return clips
    wrapped = TrainingData([(clips, 1, None, name)], rules)
    for attr in ("frame_counts", "_shown", "settings"):  # what the video trainer and its checks read
        if hasattr(clips, attr):
            setattr(wrapped, attr, getattr(clips, attr))
    return wrapped


def refuse_image_only_options(data_cfg: Any) -> None:
    """Aspect-ratio buckets and several data sets are image options: a video trainer's clips have their
    own frame size (data.width x data.height) and come from data.path alone."""
    if bool(_get(data_cfg, "buckets", False)):
        raise UserError("data.buckets=true applies to image trainers; a video trainer's clips all take one frame size, "
                        "data.width x data.height. Set data.buckets=false, and data.width/data.height for the clips.")
    if bool(_get(data_cfg, "masks", False)):
        raise UserError("data.masks=true applies to image trainers: a video trainer's clips have no loss masks yet. "
                        "Set data.masks=false for this trainer.")
    if _get(data_cfg, "references", 0):
        raise UserError("data.references applies to image edit trainers (trainer=flux_kontext): a video trainer's clips "
                        "have no reference images. Set data.references=0 for this trainer.")
    if _get(data_cfg, "demo_prior", 0):
        raise UserError("data.demo_prior adds a prior (class) set of images beside the demo images; a video trainer "
                        "reads clips. Set data.demo_prior=0 for this trainer.")
    if _get(data_cfg, "sets", None):
        raise UserError("data.sets applies to image trainers; a video trainer reads its clips from data.path alone. "
                        "Put the clips in one folder (sub-folders are searched) and set data.path, not data.sets.")


_CHECKED: dict[tuple, Dataset] = {}
_KEEP_HANDOVER: list[bool] = [False]


def _take(key: tuple) -> Dataset | None:
    """The data set the checks read, handed over to the run's first reader (kept for it while a
    :func:`handover_kept` reader, the preflight's cache count, reads it first)."""
    return _CHECKED.get(key) if _KEEP_HANDOVER[0] else _CHECKED.pop(key, None)


@contextlib.contextmanager
def handover_kept() -> Iterator[None]:
    """Readers inside this block get the checked data set without taking it from the run, so the preflight
    that counts the encoder cache's entries scans no folder the run scans again."""
    before, _KEEP_HANDOVER[0] = _KEEP_HANDOVER[0], True
    try:
        yield
    finally:
        _KEEP_HANDOVER[0] = before
_KEYED = ("path", "resolution", "center_crop", "missing_caption", "caption_ext", "caption_dropout",
          "shuffle_tags", "keep_tokens", "buckets", "bucket_step", "bucket_min_side", "bucket_max_side", "sets",
          "masks", "demo_prior", "references")


def _folder_key(data_cfg: Any, video: Any = None, references: int = 0) -> tuple:
    """What a checked data set is handed over by: its settings and the reference count it was read with
    (an unset ``data.references`` is the trainer's own count, so the setting alone does not say it)."""
    keys = _KEYED + (("frames", "fps", "frame_sampling", "width", "height") if video is not None else ())
    return (*(str(_get(data_cfg, k, None)) for k in keys), str(video), int(references))


def planned_size(data_cfg: Any) -> tuple[Size, str]:
    """The (height, width) the planner plans, and why, for ``cfg.data``.

    Square ``data.resolution`` unless buckets or per-set resolutions make sizes vary: then the
    largest size any sample can have (the bucket with the most pixels of any set), an upper
    bound that needs no file read. The demo set is always square.
    """
    o = check_options(data_cfg)
    resolutions = sorted({s["resolution"] or o.resolution for s in o.sets}) if o.sets else [o.resolution]
    if not o.buckets or (not o.sets and o.path is None):
        res = resolutions[-1]
        why = "" if len(resolutions) == 1 else f"the largest data.sets resolution ({', '.join(map(str, resolutions))})"
        return (res, res), why
    best: tuple[Size, int] | None = None
    for res in resolutions:
        spec = o.bucket_spec(res)
        size = spec.largest()
        if best is None or size[0] * size[1] > best[0][0] * best[0][1]:
            best = (size, len(spec.sizes))
    (h, w), count = best
    return (h, w), f"the largest of {count} aspect-ratio buckets (data.buckets)"


def visit_samples(dataset: Any, indices: Sequence[int], seeds: torch.Tensor) -> list[dict[str, Any]]:
    """The samples of one batch as their visits train on them: ``ds.visit(i, seed)`` where the
    dataset has it (per-visit captions), else ``ds[i]``."""
    visit = getattr(dataset, "visit", None)
    if callable(visit):
        return [visit(i, s) for i, s in zip(indices, seeds.tolist())]
    return [dataset[i] for i in indices]


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


def describe_sample(dataset: Any, index: int) -> str:
    """Where sample ``index`` comes from, for a message: its file for a folder (through sets, the
    held-out split and a cache's view, which keep the folder's indices), else its index."""
    for _ in range(8):  # wrappers nest a few deep at most
        paths = getattr(dataset, "paths", None)
        if isinstance(paths, list) and 0 <= index < len(paths):
            return str(paths[index])
        if callable(getattr(dataset, "locate", None)) and isinstance(getattr(dataset, "datasets", None), list):
            part, index = dataset.locate(index)
            dataset = dataset.datasets[part]
            continue
        inner = next((getattr(dataset, a) for a in ("source", "dataset", "base") if getattr(dataset, a, None) is not None),
                     None)
        if inner is None or inner is dataset:
            break
        dataset = inner
    return f"sample {index}"
