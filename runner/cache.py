"""On-disk cache of a trainer's encoder outputs (VAE posteriors, text embeddings).

Why: the frozen encoders (SDXL: VAE + two CLIPs, 0.9 B parameters; Flux: VAE + CLIP + T5-XXL,
4.9 B) cost device memory and time on every step, yet for a fixed data set they compute the same
thing every epoch. Encoding each sample once and reading the result back lets a run train
without those modules at all.

What is stored: one safetensors file per (part, key) under
``<root>/<part>/<key[:2]>/<key>.safetensors``, holding what ``trainer.encode_part`` returned
for one sample (no batch dimension). For the VAE that is the posterior's mean and std, not a
sample: the trainers draw the posterior sample from each sample's seed at use time
(``finish_encode``), so a cached run gives the same losses as an uncached one. Files are
written to a temporary name in the same folder and renamed into place, so a crash or a second
run filling the same cache never leaves a half-written entry.

How entries are keyed: ``sha256`` of the trainer's ``cache_signature(part)`` (model identity,
source files' size and mtime, dtypes, tokenizer, resolution, crop, flip ...) plus the runner's
extra settings (device type, autocast, quantization and tiling config), plus the content of the
sample's inputs: the image file's bytes (with the per-index crop/flip it gets), or the pixels
for the built-in demo set and any other dataset, and the caption text. Identical captions share
one text entry. Local weights are identified by file size and mtime rather than by hashing
gigabytes of weights on every start; an in-place edit that keeps both would not be noticed
(delete the cache folder after such an edit).

Batch size and bitwise equality: the encoders' kernels may round differently for different
batch shapes (measured on this CPU: the SDXL pooled text embedding differs by 4.8e-7 between a
batch of 8 and one of 2). The pre-pass therefore encodes in batches of the run's micro-batch size
by default and pads the last batch to that size, which makes every entry bitwise equal to what
the uncached run computes (rows of one batch shape do not depend on each other).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runner.cache_entry import FORMAT, verify_entry, write_entry  # noqa: F401  (FORMAT: re-exported)
from runner.errors import UserError, as_os_error, storage_error
from runner.trainer import EncodePart, ModelSet

log = logging.getLogger("runner")

__all__ = ["FORMAT", "EncoderCache", "CachePlan", "plan_cache", "fill_cache", "require_fillable", "check_writable"]
IMAGE_PIPELINE_VERSION = 1  # bump when runner.data.images' decode/resize/crop changes its pixels


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/diffusion-memory-runner/latents`` (``~/.cache/...`` by default).

    A per-user folder outside the run's output directory, so every run (and every sweep job)
    with the same data and encoders reuses the same entries.
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "diffusion-memory-runner" / "latents"


def resolve_cache_dir(value: str | os.PathLike[str] | None) -> Path:
    return default_cache_dir() if value in (None, "") else Path(os.path.expanduser(str(value))).absolute()


def writable_error(folder: Path) -> OSError | None:
    """None when ``folder`` can be created and written to (a temporary file is made and removed)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as e:
        return e
    return None


def check_writable(folder: Path, key: str = "offload.park.cache_dir") -> None:
    """Create ``folder`` and write a file in it; a UserError naming ``key`` if either fails."""
    e = writable_error(folder)
    if e is not None:
        raise UserError(
            f"{key}={str(folder)!r} is not a writable folder ({e.strerror or e}). Give a folder you can "
            f"write to, e.g. {key}=/tmp/latents, or leave it unset for {str(default_cache_dir())!r}."
        )


def is_image_part(spec: EncodePart) -> bool:
    """Parts that read pixels are "latents" parts (``offload.park.cache_latents``); the rest are text."""
    return "pixel_values" in spec.inputs


# ---- per-sample fingerprints ------------------------------------------------------------------
def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _sha256_tensor(t: torch.Tensor) -> str:
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class SampleFingerprints:
    """What each sample's inputs are, by content, without decoding images where avoidable.

    * a :class:`runner.data.FolderDataset`: the image file's sha256 (reading bytes is much
      cheaper than decoding), the flip that index gets and, without center crop, the index
      (its crop offset is a hash of the index); captions from the dataset's list;
    * a data set with ``fingerprint(i)`` / ``caption(i)`` methods (the video clip folders: file
      bytes, frame indices and settings, without decoding a frame): what they return;
    * the built-in demo set and any other map-style dataset: the sha256 of ``ds[i]``'s pixels
      and its caption (the demo set draws small images quickly).
    """

    def __init__(self, dataset: Any) -> None:
        from runner.data import DemoDataset, FolderDataset

        self.dataset = dataset
        self.folder = dataset if isinstance(dataset, FolderDataset) else None
        self.demo = dataset if isinstance(dataset, DemoDataset) else None
        self._sample_cache: dict[int, dict[str, Any]] = {}

    def _sample(self, index: int) -> dict[str, Any]:
        s = self._sample_cache.get(index)
        if s is None:
            s = self.dataset[index]
            self._sample_cache = {index: s}  # keep one: callers ask input by input for one index
        return s

    def caption(self, index: int) -> str:
        own = getattr(self.dataset, "caption", None)  # a data set that knows its captions (the clip sets)
        if callable(own):
            return str(own(index))
        if self.folder is not None:
            return self.folder.captions[index]
        if self.demo is not None:
            from runner.data.demo import demo_caption

            return demo_caption(index)
        return str(self._sample(index)["caption"])

    def image(self, index: int) -> dict[str, Any]:
        own = getattr(self.dataset, "fingerprint", None)  # a data set that fingerprints its samples (clip folders)
        if callable(own):
            return own(index)
        if self.folder is not None:
            from runner.data.images import flips

            ds = self.folder
            fp: dict[str, Any] = {
                "file_sha256": _sha256_file(ds.paths[index]),
                "pipeline": IMAGE_PIPELINE_VERSION,
                "flip": bool(ds.random_flip and flips(index)),
            }
            if not ds.center_crop:
                fp["crop_index"] = index
            return fp
        return {"pixels_sha256": _sha256_tensor(self._sample(index)["pixel_values"])}

    def of(self, index: int, inputs: Sequence[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in inputs:
            if key == "pixel_values":
                out[key] = self.image(index)
            elif key == "caption":
                out[key] = self.caption(index)
            else:
                value = self._sample(index)[key]
                out[key] = _sha256_tensor(value) if isinstance(value, torch.Tensor) else repr(value)
        return out

    def raw_inputs(self, indices: Sequence[int], inputs: Sequence[str]) -> dict[str, Any]:
        """A raw batch with just ``inputs`` for ``indices`` (captions without decoding pixels)."""
        from runner.data import collate

        if set(inputs) <= {"caption"}:
            return {"caption": [self.caption(i) for i in indices]}
        batch = collate([self.dataset[i] for i in indices])
        return {k: batch[k] for k in inputs}


def entry_key(signature: dict[str, Any], fingerprint: dict[str, Any]) -> str:
    blob = json.dumps({"signature": signature, "inputs": fingerprint}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


# ---- the store ----------------------------------------------------------------------------------
class EncoderCache:
    """Per-entry safetensors files under ``root``; see the module docstring for the layout."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, part: str, key: str) -> Path:
        return self.root / part / key[:2] / f"{key}.safetensors"

    def has(self, part: str, key: str) -> bool:
        """Whether a file exists for the entry (not whether it is intact: see :meth:`verify`)."""
        return self.path(part, key).is_file()

    def verify(self, part: str, key: str) -> str | None:
        """Why the entry cannot be used ("missing", "checksum mismatch ...") or None when it is intact."""
        return verify_entry(self.path(part, key), part, key)

    def verify_many(self, entries: Iterable[tuple[str, str]], threads: int | None = None) -> dict[tuple[str, str], str]:
        """The (part, key) pairs of ``entries`` that cannot be used, with the reason.

        Files are verified by a small thread pool (default: one thread per CPU core, at most 4):
        reading and ``zlib.crc32`` release the GIL, so on a cold disk the reads overlap and on a
        warm one the checksums run on every core. The pool costs nothing noticeable for a few
        entries and halves the wait for 10 k on two cores (bench/cache_verify.py).
        """
        entries = list(entries)
        threads = threads or min(4, os.cpu_count() or 1)
        if threads <= 1 or len(entries) < 16:
            reasons = [self.verify(p, k) for p, k in entries]
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="cache-verify") as pool:
                reasons = list(pool.map(lambda e: self.verify(*e), entries, chunksize=64))
        return {e: r for e, r in zip(entries, reasons) if r is not None}

    def save(self, part: str, key: str, tensors: dict[str, torch.Tensor]) -> Path:
        """Write one entry, with its checksum, atomically (temporary file, then ``os.replace``)."""
        final = self.path(part, key)
        data = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        try:
            write_entry(final, data, part, key)
        except Exception as e:  # a full or read-only disk (safetensors wraps the OSError in its own error)
            os_error = as_os_error(e, final)
            if os_error is None:
                raise
            raise storage_error(os_error, "Writing an encoder cache entry", final.parent,
                                advice=f"Entries written so far are kept and reused; set offload.park.cache_dir to "
                                       "a folder with space, or free some.") from None
        return final

    def load(self, part: str, key: str) -> dict[str, torch.Tensor]:
        """The entry's tensors; opens the file read-only (the checksum was verified by plan_cache)."""
        from safetensors.torch import load_file

        path = self.path(part, key)
        try:
            return load_file(path)
        except Exception as e:  # missing (deleted mid-run) or unreadable
            raise UserError(
                f"Encoder cache entry {str(path)!r} cannot be read ({type(e).__name__}: {e}). Delete it "
                f"(or the whole folder {str(self.root)!r}, set by offload.park.cache_dir) and run again to re-encode."
            ) from None

    def load_batch(self, part: str, keys: Sequence[str], device: torch.device | str) -> dict[str, torch.Tensor]:
        """Entries for ``keys``, stacked into a batch on ``device``."""
        rows = [self.load(part, k) for k in keys]
        return {name: torch.stack([r[name] for r in rows]).to(device) for name in rows[0]}


# ---- planning and filling ---------------------------------------------------------------------
@dataclass
class CachePlan:
    """Entry keys of every sample, per part, and which entries are still to be encoded."""

    keys: dict[str, list[str]]  # part -> key of each dataset index
    missing: dict[str, list[int]] = field(default_factory=dict)  # part -> one index per missing key (bad included)
    bad: dict[Path, str] = field(default_factory=dict)  # entries on disk that failed verification -> why

    def missing_count(self) -> int:
        return sum(len(v) for v in self.missing.values())

    def entry_count(self) -> int:
        """Distinct entries the run reads."""
        return sum(len(set(v)) for v in self.keys.values())

    def describe_bad(self) -> str:
        """'N entries failed verification (first: PATH: why)', or '' when none did."""
        if not self.bad:
            return ""
        path, why = next(iter(self.bad.items()))
        return f"{len(self.bad)} {'entry' if len(self.bad) == 1 else 'entries'} failed verification (first: {path}: {why})"


def plan_cache(
    trainer: Any,
    dataset: Any,
    parts: Sequence[str],
    cache: EncoderCache,
    extra_signature: dict[str, Any] | None = None,
) -> CachePlan:
    """Key every sample of ``dataset`` for each of ``parts`` and list the entries to encode.

    Every entry the run will read is verified here (:mod:`runner.cache_entry`), so an entry that
    is absent, empty, truncated, of an older format or fails its checksum is planned as missing
    and re-encoded by :func:`fill_cache`; ``plan.bad`` lists the ones that were on disk.
    """
    specs = trainer.encode_parts()
    fps = SampleFingerprints(dataset)
    n = len(dataset)
    plan = CachePlan(keys={p: [] for p in parts}, missing={p: [] for p in parts})
    signatures = {p: {**trainer.cache_signature(p), "runner": dict(extra_signature or {})} for p in parts}
    first_index: dict[tuple[str, str], int] = {}  # (part, key) -> first dataset index with it
    for p in parts:
        for i in range(n):
            key = entry_key(signatures[p], fps.of(i, specs[p].inputs))
            plan.keys[p].append(key)
            first_index.setdefault((p, key), i)
    unusable = cache.verify_many(first_index)
    for (p, key), i in first_index.items():  # dict order: by part, then by first index
        why = unusable.get((p, key))
        if why is not None:
            plan.missing[p].append(i)
            if why != "missing":
                plan.bad[cache.path(p, key)] = why
    return plan


def require_fillable(cache: EncoderCache, plan: CachePlan, key: str = "offload.park.cache_dir") -> None:
    """A UserError, before training, when entries must be (re-)encoded and ``cache.root`` cannot be written.

    Why only then: a complete, intact cache is only read, so it may sit on read-only media (a
    shared data set's mount, a container image layer); a cache with holes cannot be used as it is
    and cannot be repaired where it is, so the run stops with what to do instead of dying mid-run.
    """
    if not plan.missing_count():
        return
    e = writable_error(cache.root)
    if e is None:
        return
    bad = len(plan.bad)
    absent = plan.missing_count() - bad
    what = ", ".join(x for x in (f"{absent} missing" if absent else "", plan.describe_bad()) if x)
    raise UserError(
        f"{key}={str(cache.root)!r} cannot be written ({e.strerror or e}), but {plan.missing_count()} of the "
        f"{plan.entry_count()} encoder cache entries this run needs must be encoded there: {what}. Make the folder "
        f"writable, so that they are re-encoded in place, or set {key} to a writable folder (copy this cache "
        f"there first to re-encode only these entries)."
    )


def fill_cache(
    trainer: Any,
    models: ModelSet,
    dataset: Any,
    plan: CachePlan,
    cache: EncoderCache,
    batch_size: int,
    device: torch.device | str,
    autocast: Callable[[], Any] | None = None,
    log_every_s: float = 10.0,
) -> int:
    """Encode every missing entry of ``plan`` in batches of ``batch_size``; return how many.

    The last batch of each part is padded to ``batch_size`` by repeating its last sample, so
    every batch has the shape the training loop's micro-batches have (see the module
    docstring). Progress is logged at the start, every ``log_every_s`` seconds and at the end.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    specs = trainer.encode_parts()
    fps = SampleFingerprints(dataset)
    total = plan.missing_count()
    if total == 0:
        return 0
    done, t0, last = 0, time.perf_counter(), time.perf_counter()
    log.info("encoder cache: encoding %d entries (%s) in batches of %d into %s", total,
             ", ".join(f"{p}: {len(v)}" for p, v in plan.missing.items() if v), batch_size, cache.root)
    for part, indices in plan.missing.items():
        for lo in range(0, len(indices), batch_size):
            chunk = indices[lo:lo + batch_size]
            padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
            raw = fps.raw_inputs(padded, specs[part].inputs)
            batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in raw.items()}
            batch["sample_seed"] = torch.zeros(len(padded), dtype=torch.int64, device=device)
            with (autocast() if autocast is not None else nullcontext()), torch.no_grad():
                out = trainer.encode_part(models, part, batch)
            for row, index in enumerate(chunk):
                cache.save(part, plan.keys[part][index], {k: v[row] for k, v in out.items()})
            done += len(chunk)
            now = time.perf_counter()
            if now - last >= log_every_s or done == total:
                last = now
                rate = done / max(now - t0, 1e-9)
                log.info("encoder cache: %d/%d entries encoded (%.1f/s)", done, total, rate)
    return done
