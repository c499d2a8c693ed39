"""What reads the encoder cache during training, for ``offload=park``: the stand-ins for a trainer's
``encode`` (:class:`CachedEncode`) and, once everything is cached, for its dataset
(:class:`IndexSamples`). The cache itself (keys, entries, filling) is plugins/park/cache.py.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from runner.plugins.park.cache import EncoderCache
from runner.trainer import ModelSet, batch_device, host_list

log = logging.getLogger("runner")

class CachedEncode:
    """Stands in for ``trainer.encode``: cached parts from disk, the others computed, then
    the trainer's own ``finish_encode`` (per-sample randomness).

    Parts computed from the caption alone are looked up by the batch's caption text (which may
    differ per visit: caption dropout trains some visits on ``""``); the others by the sample's
    view: its index, plus ``samples`` when the visit is mirrored (the batch's ``flip``,
    ``data.random_flip``: runner/data/flip.py and plugins/park/cache.py ``CachePlan``).
    """

    def __init__(self, trainer: Any, cache: EncoderCache, keys: dict[str, list[str]],
                 captions: dict[str, dict[str, str]] | None = None, samples: int = 0) -> None:
        self.trainer_ref = weakref.ref(trainer)  # stored on the trainer: no reference cycle
        self.cache = cache
        self.keys = keys  # part -> key per view
        self.captions = captions or {}
        self.samples = samples
        self.reads = 0
        self.warned = False

    def _keys(self, part: str, batch: dict[str, Any], index: list[int]) -> list[str]:
        by_index = [self.keys[part][i] for i in index]
        by_text = self.captions.get(part)
        if by_text is None or "caption" not in batch:
            return by_index
        keys = []
        for caption, own in zip(batch["caption"], by_index):
            key = by_text.get(caption)
            if key is None:  # not a caption the run planned (a hand-made batch): the sample's own entry
                if not self.warned:
                    log.warning("offload=park: caption %r of sample batch is not in the encoder cache's plan; using "
                                "each sample's own caption entry", caption)
                    self.warned = True
                key = own
            keys.append(key)
        return keys

    @torch.no_grad()
    def __call__(self, models: ModelSet, batch: dict[str, Any]) -> dict[str, Any]:
        trainer = self.trainer_ref()
        if "index" not in batch:
            raise RuntimeError("offload=park: the batch has no 'index' key, so cached entries cannot be found; "
                               "the trainer's dataset must return each sample's index")
        index = host_list(batch["index"])  # the host originals: no read of the card
        flip = host_list(batch["flip"]) if "flip" in batch else [False] * len(index)  # data.random_flip, this visit
        views = [i + self.samples if f else i for i, f in zip(index, flip)]
        device = batch_device(batch)
        parts = {}
        for part in trainer.encode_parts():
            if part in self.keys:
                parts[part] = self.cache.load_batch(part, self._keys(part, batch, views), device)
                self.reads += 1
            else:
                parts[part] = trainer.encode_part(models, part, batch)
        return trainer.finish_encode(parts, batch)


# What IndexSamples passes through from the dataset it stands in for (runner/data: the batch order
# reads the sizes and sets, the cache the captions).
_DELEGATED = ("group_of", "set_layout", "caption", "fingerprint", "extra_captions")


class IndexSamples(torch.utils.data.Dataset):
    """The dataset when every encode part is cached: a sample is its index and whatever else
    needs no pixels (the visit's caption, SDXL's crop and size conditioning), no image decoded."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.n = len(dataset)
        describe = getattr(dataset, "describe", None)
        self._describe = describe() if callable(describe) else f"{self.n} samples"

    def __len__(self) -> int:
        return self.n

    def __getattr__(self, name: str) -> Any:
        if name in _DELEGATED:
            return getattr(self.__dict__["dataset"], name)
        raise AttributeError(name)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} samples")
        light = getattr(self.dataset, "light", None)
        return dict(light(index)) if callable(light) else {"index": index}

    def visit(self, index: int, seed: int) -> dict[str, Any]:
        light_visit = getattr(self.dataset, "light_visit", None)
        return light_visit(index, seed) if callable(light_visit) else self[index]

    def describe(self) -> str:
        return f"{self._describe}; every sample's encoder outputs cached (offload=park)"


