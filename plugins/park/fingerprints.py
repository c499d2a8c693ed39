"""What each sample of a data set is, by content: the encoder cache's per-sample keys
(plugins/park/cache.py reads and writes entries under them)."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch


def _sha256_tensor(t: torch.Tensor) -> str:
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class SampleFingerprints:
    """What each sample's inputs are, by content, without decoding images where avoidable.

    * a dataset of runner.data that knows its samples (a folder, several sets): its own
      ``fingerprint(i)`` (the image file's sha256, the crop that index gets, the output size
      where it varies; :meth:`runner.data.FolderDataset.fingerprint`) and ``caption(i)``;
    * a data set with ``fingerprint(i)`` / ``caption(i)`` methods (the video clip folders: file
      bytes, frame indices and settings, without decoding a frame): what they return;
    * the built-in demo set and any other map-style dataset: the sha256 of ``ds[i]``'s pixels
      and its caption (the demo set draws small images quickly).

    Either way the orientation of the view (``flip``: ``data.random_flip`` decides it per visit,
    runner/data/flip.py) is part of an image's fingerprint.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._fingerprint = getattr(dataset, "fingerprint", None)
        self._caption = getattr(dataset, "caption", None)
        self._sample_cache: dict[int, dict[str, Any]] = {}

    def _sample(self, index: int) -> dict[str, Any]:
        s = self._sample_cache.get(index)
        if s is None:
            s = self.dataset[index]
            self._sample_cache = {index: s}  # keep one: callers ask input by input for one index
        return s

    def caption(self, index: int) -> str:
        if callable(self._caption):
            return self._caption(index)
        return str(self._sample(index)["caption"])

    def image(self, index: int, flip: bool = False) -> dict[str, Any]:
        fp = self._fingerprint(index) if callable(self._fingerprint) else None
        if fp is not None:
            return {**fp, "flip": bool(flip)}
        return {"pixels_sha256": _sha256_tensor(self._sample(index)["pixel_values"]), "flip": bool(flip)}

    def of(self, index: int, inputs: Sequence[str], flip: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in inputs:
            if key == "pixel_values":
                out[key] = self.image(index, flip)
            elif key in ("mask", "references") and callable(self._fingerprint) and (fp := self._fingerprint(index)) is not None:
                out[key] = {**fp, "flip": bool(flip)}  # it holds the mask's (data.masks) and references' sha256
            elif key == "caption":
                out[key] = self.caption(index)
            elif key in ("mask", "references"):  # pixels the loop mirrors with the image: the view is in the key
                out[key] = {"sha256": _sha256_tensor(self._sample(index)[key]), "flip": bool(flip)}
            else:
                value = self._sample(index)[key]
                out[key] = _sha256_tensor(value) if isinstance(value, torch.Tensor) else repr(value)
        return out

    def raw_inputs(self, indices: Sequence[int], inputs: Sequence[str], flips: Sequence[bool] | None = None) -> dict[str, Any]:
        """A raw batch with just ``inputs`` for ``indices`` (captions without decoding pixels), the
        pixels (and masks) of the rows where ``flips`` is true mirrored as the training loop mirrors them."""
        from runner.data import collate
        from runner.data.flip import flip_batch

        if set(inputs) <= {"caption"}:
            return {"caption": [self.caption(i) for i in indices]}
        batch = collate([self.dataset[i] for i in indices])
        if flips is not None:  # the pixels and their loss mask (data.masks), as the loop mirrors them
            batch = flip_batch(batch, torch.tensor(list(flips), dtype=torch.bool))
        return {k: batch[k] for k in inputs}


def entry_key(signature: dict[str, Any], fingerprint: dict[str, Any]) -> str:
    """One entry's key: the sample's ``fingerprint`` under the part's ``signature``, which records what the
    encoder is: each module's dtype and weights (the trainer's ``cache_signature``), its quantization (the
    quantization plugin's settings when it quantized one of the part's modules), the device type the run
    computes on and its autocast (``ctx.encoder_signature``). So an nf4 encoder's embeddings are never read
    by a bf16 run, nor the other way round (tests/plugins/park/test_plan_cache.py)."""
    blob = json.dumps({"signature": signature, "inputs": fingerprint}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
