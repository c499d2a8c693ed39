"""Several data sets in one run, and per-visit captions: :class:`TrainingData`.

``data.sets=[{path, repeats, weight, caption_ext, resolution}, ...]`` trains on several folders
at once. Each set is a :class:`~runner.data.folder.FolderDataset` of its own (its own caption
extension, resolution and buckets); :class:`TrainingData` puts them in one index space (set 0's
images first, then set 1's ...) so the rest of the runner (the batch order, the encoder cache,
the loop) sees one map-style dataset. ``data.path`` is the one-set shorthand.

How a set's ``repeats`` and ``weight`` decide what is trained (runner/data/order.py draws it):

* ``repeats`` (kohya's ``num_repeats``, default 1): each image of the set appears ``repeats``
  times in the set's pool of one epoch.
* no ``weight`` on any set (kohya): an epoch is every pool once, all sets together, so an image's
  share of the visits is proportional to its set's ``repeats``; an epoch has
  ``sum(images * repeats)`` visits.
* a ``weight`` on every set (SimpleTuner's ``probability``): each step's batch comes from one set,
  set ``s`` with probability ``weight_s / sum(weights)``; within a set, its pool is used in a
  shuffled order and refilled when used up. A set's share of the steps is then its weight
  whatever its size or repeats, and its images share that equally (repeats, the same for every
  image of a set, no longer change frequencies: they only lengthen the set's cycle).
* weights on some sets only: refused (it would leave the others' share undefined).

Captions (runner/data/captions.py) are applied here, per visit: :meth:`TrainingData.visit`
takes the visit's seed. All sets share one encoder cache: entries are keyed by content (the
image file and the size it is cropped to, the caption text), so an image in two sets at one size
is encoded once.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from runner.data.captions import CaptionRules
from runner.data.checks import check_index


@dataclass(frozen=True)
class SetInfo:
    """One set's place in the index space and its sampling settings."""

    name: str  # the setting that defines it, for messages: data.sets[1] or data.path
    start: int  # first global index
    stop: int  # one past the last
    repeats: int = 1
    weight: float | None = None
    prior: bool = False  # role: prior, a regularization (class) set whose loss is x loss.prior_weight

    @property
    def size(self) -> int:
        return self.stop - self.start


def prior_share(sets: list[SetInfo]) -> float | None:
    """The prior sets' expected share of the trained samples (None without a prior set).

    With weights each step's batch comes from one set, so it is the prior sets' share of the
    weights (of the steps); without, every pool is used once an epoch, so it is their share of
    ``images x repeats``."""
    if not any(s.prior for s in sets):
        return None
    if all(s.weight is not None for s in sets):
        return sum(s.weight for s in sets if s.prior) / sum(s.weight for s in sets)  # type: ignore[misc]
    return sum(s.size * s.repeats for s in sets if s.prior) / sum(s.size * s.repeats for s in sets)


class TrainingData(Dataset):
    """One or more data sets as one map-style dataset, with per-visit caption rules.

    ``parts``: (dataset, repeats, weight, name) per set. Every method is a pure function of its
    arguments (the global index, and the visit's seed where captions vary), as runner.data requires.
    """

    def __init__(self, parts: list[tuple[Any, int, float | None, str]], rules: CaptionRules | None = None,
                 priors: frozenset[int] = frozenset()) -> None:
        """``priors``: the numbers of the sets with ``role: prior``; their samples carry ``prior=True``
        (every sample carries a ``prior`` flag once one set is a prior set), which the loss weighs."""
        self.rules = rules or CaptionRules()
        self.datasets = [p[0] for p in parts]
        self.sets: list[SetInfo] = []
        start = 0
        for n_set, (ds, repeats, weight, name) in enumerate(parts):
            n = len(ds)
            self.sets.append(SetInfo(name, start, start + n, int(repeats), None if weight is None else float(weight),
                                     n_set in priors))
            start += n
        self.has_prior = any(s.prior for s in self.sets)
        self._starts = [s.start for s in self.sets]
        self.n = start

    def __len__(self) -> int:
        return self.n

    def locate(self, index: int) -> tuple[int, int]:
        """(set number, index within the set) of global ``index``."""
        index = check_index(index, self.n, "samples")
        s = bisect.bisect_right(self._starts, index) - 1
        return s, index - self.sets[s].start

    def __getitem__(self, index: int) -> dict[str, Any]:
        s, local = self.locate(index)
        return self._with_role({**self.datasets[s][local], "index": self.sets[s].start + local}, s)

    def _with_role(self, sample: dict[str, Any], s: int) -> dict[str, Any]:
        if self.has_prior:  # a 0-d bool: collate stacks it into the batch's per-sample flags
            sample["prior"] = torch.tensor(self.sets[s].prior)
        return sample

    def _with_caption(self, sample: dict[str, Any], seed: int) -> dict[str, Any]:
        if self.rules.active and "caption" in sample:
            sample["caption"] = self.rules.apply(sample["caption"], seed)
        return sample

    def visit(self, index: int, seed: int) -> dict[str, Any]:
        """Sample ``index`` as the visit with ``seed`` trains on it (its caption may differ per visit)."""
        return self._with_caption(self[index], seed)

    def light_visit(self, index: int, seed: int) -> dict[str, Any]:
        """:meth:`visit` without pixels: for a run whose latents are all cached."""
        s, local = self.locate(index)
        ds = self.datasets[s]
        if callable(getattr(ds, "light", None)):
            sample = dict(ds.light(local))
        else:
            sample = {"caption": self._base_caption(ds, local)}
        sample["index"] = self.sets[s].start + local
        return self._with_caption(self._with_role(sample, s), seed)

    @staticmethod
    def _base_caption(ds: Any, local: int) -> str:
        fn = getattr(ds, "caption", None)
        return fn(local) if callable(fn) else str(ds[local]["caption"])

    def caption(self, index: int) -> str:
        """The file's caption (before per-visit rules): what the encoder cache keys text by."""
        s, local = self.locate(index)
        return self._base_caption(self.datasets[s], local)

    def extra_captions(self) -> set[str] | None:
        """Caption texts visits may train on besides the files' own (None: too many to list)."""
        return self.rules.extra_captions()

    def group_of(self, index: int) -> Any:
        s, local = self.locate(index)
        fn = getattr(self.datasets[s], "group_of", None)
        return fn(local) if callable(fn) else None

    def fingerprint(self, index: int) -> dict[str, Any] | None:
        """The set's own fingerprint of the sample's pixels; None for a set without one (the demo
        set, whose pixels the cache hashes instead)."""
        s, local = self.locate(index)
        fn = getattr(self.datasets[s], "fingerprint", None)
        return fn(local) if callable(fn) else None

    def set_layout(self) -> list[SetInfo]:
        return list(self.sets)

    def describe(self) -> str:
        lines = []
        for info, ds in zip(self.sets, self.datasets):
            what = ds.describe() if callable(getattr(ds, "describe", None)) else f"{len(ds)} samples"
            how = [f"repeats {info.repeats}"] if info.repeats != 1 else []
            if info.weight is not None:
                how.append(f"weight {info.weight:g}")
            if info.prior:
                how.append("prior (class) set")
            lines.append(f"{info.name}: {what}" + (f" [{', '.join(how)}]" if how else ""))
        if len(lines) == 1:
            ds = self.datasets[0]
            text = ds.describe() if callable(getattr(ds, "describe", None)) else f"{self.n} samples"
        else:
            text = f"{len(lines)} sets, {self.n} images: " + "; ".join(lines)
        share = prior_share(self.sets)
        if share is not None:
            per = "of the steps' batches" if all(s.weight is not None for s in self.sets) else "of the samples"
            text += f"; prior (class) sets: {share:.0%} {per}"
        if self.rules.active:
            text += f"; {self.rules.describe()}"
        return text
