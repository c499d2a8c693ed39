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
source files' size and mtime, dtypes, tokenizer, resolution, crop ...) plus the runner's
extra settings (device type, autocast, quantization and tiling config), plus the content of the
sample's inputs: the image file's bytes (with the per-index crop it gets), or the pixels
for the built-in demo set and any other dataset, and the caption text; and the orientation.

``data.random_flip`` flips a sample on some visits and not on others (runner/data/flip.py), so
with it an image part is planned for each sample in both orientations (kohya's ``flip_aug``), a
"view" ``(index, flip)``, and the cached encode reads the one each visit asks for (the batch's
``flip``); text parts do not depend on the orientation, so both views share one entry. Entries
of trainer cache format 1 (the flip was a fixed coin per image, and ``random_flip`` was part of
the signature) have other keys: they are never read, and are re-encoded once. Identical captions share
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

import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runner.data.images import IMAGE_PIPELINE_VERSION, sha256_file  # noqa: F401  (re-exported)
from runner.errors import UserError, as_os_error, storage_error
from runner.plugins.park.entry import FORMAT, verify_entry, write_entry  # noqa: F401  (FORMAT: re-exported)
from runner.plugins.park.fingerprints import SampleFingerprints, entry_key  # noqa: F401  (re-exported)
from runner.trainer import EncodePart, ModelSet

log = logging.getLogger("runner")

__all__ = ["FORMAT", "EncoderCache", "CachePlan", "plan_cache", "fill_cache", "require_fillable", "check_writable"]


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


# ---- the store ----------------------------------------------------------------------------------
class EncoderCache:
    """Per-entry safetensors files under ``root``; see the module docstring for the layout."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, part: str, key: str) -> Path:
        return self.root / part / key[:2] / f"{key}.safetensors"

    @contextmanager
    def filling(self) -> Iterator[bool]:
        """Held while this process encodes missing entries: a second run sharing the cache waits here
        and then plans again, finding what the first wrote, instead of encoding the same entries twice.

        An advisory ``flock`` on ``<root>/.filling.lock`` (released when the process ends, however it
        ends); where the platform has none, runs fill side by side as before (entries are written
        atomically either way). Yields whether it waited (then the caller plans again)."""
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, the atomic writes keep the cache sound
            yield False
            return
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".filling.lock", "a+") as f:
            waited = False
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("encoder cache: another run is filling %s; waiting for it, then encoding what it left",
                         self.root)
                fcntl.flock(f, fcntl.LOCK_EX)
                waited = True
            try:
                yield waited
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

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
                                advice="Entries written so far are kept and reused; set offload.park.cache_dir to "
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
    """Entry keys of every sample view, per part, and which entries are still to be encoded.

    A view is a dataset index in one orientation: view ``v`` is index ``v % n`` (``n`` samples),
    mirrored when ``v >= n``; there are ``n`` views without ``data.random_flip`` and ``2n`` with it.
    """

    keys: dict[str, list[str]]  # part -> key of each view (the first n: each dataset index, unflipped)
    missing: dict[str, list[int]] = field(default_factory=dict)  # part -> one view per missing key (bad included)
    bad: dict[Path, str] = field(default_factory=dict)  # entries on disk that failed verification -> why
    samples: int = 0  # n: views >= n are the mirrored ones
    # Parts that read only the caption are keyed by its text, so a visit whose caption differs from the
    # file's (caption dropout: "") finds its entry too: part -> caption text -> key.
    captions: dict[str, dict[str, str]] = field(default_factory=dict)
    missing_captions: dict[str, list[str]] = field(default_factory=dict)  # part -> extra caption texts to encode

    def view(self, index: int, flip: bool) -> int:
        return index + self.samples if flip else index

    def index_and_flip(self, view: int) -> tuple[int, bool]:
        return (view - self.samples, True) if self.samples and view >= self.samples else (view, False)

    def missing_count(self) -> int:
        return sum(len(v) for v in self.missing.values()) + sum(len(v) for v in self.missing_captions.values())

    def entry_count(self) -> int:
        """Distinct entries the run reads."""
        return sum(len(set(v) | set(self.captions.get(p, {}).values())) for p, v in self.keys.items())

    def describe_bad(self) -> str:
        """'N entries failed verification (first: PATH: why)', or '' when none did."""
        if not self.bad:
            return ""
        path, why = next(iter(self.bad.items()))
        return f"{len(self.bad)} {'entry' if len(self.bad) == 1 else 'entries'} failed verification (first: {path}: {why})"


def caption_only(spec: EncodePart) -> bool:
    """A part computed from the caption alone: keyed by the caption's text (see :class:`CachePlan`)."""
    return tuple(spec.inputs) == ("caption",)


def plan_cache(
    trainer: Any,
    dataset: Any,
    parts: Sequence[str],
    cache: EncoderCache,
    extra_signature: dict[str, Any] | Callable[[str], dict[str, Any]] | None = None,
    random_flip: bool = False,
) -> CachePlan:
    """Key every sample of ``dataset`` for each of ``parts`` (both orientations with ``random_flip``)
    and list the entries to encode. ``extra_signature``: the runner's settings in every key, one
    dict for all parts or a function of the part (``ctx.encoder_signature`` of its modules).

    Every entry the run will read is verified here (:mod:`runner.plugins.park.entry`), so an entry that
    is absent, empty, truncated, of an older format or fails its checksum is planned as missing
    and re-encoded by :func:`fill_cache`; ``plan.bad`` lists the ones that were on disk. Caption
    texts that visits may train on besides the files' own (``dataset.extra_captions()``: the
    empty caption of caption dropout) get entries too.
    """
    specs = trainer.encode_parts()
    fps = SampleFingerprints(dataset)
    n = len(dataset)
    plan = CachePlan(keys={p: [] for p in parts}, missing={p: [] for p in parts}, samples=n)
    def runner_settings(part: str) -> dict[str, Any]:  # one dict for every part, or each part's own
        return dict((extra_signature(part) if callable(extra_signature) else extra_signature) or {})

    signatures = {p: {**trainer.cache_signature(p), "runner": runner_settings(p)} for p in parts}
    extra_fn = getattr(dataset, "extra_captions", None)
    extra = extra_fn() if callable(extra_fn) else set()
    first_index: dict[tuple[str, str], int] = {}  # (part, key) -> first view with it
    extra_entries: dict[tuple[str, str], str] = {}  # (part, key) -> caption text no file has
    views = [(i, flip) for flip in ((False, True) if random_flip else (False,)) for i in range(n)]
    for p in parts:
        by_caption = caption_only(specs[p])
        if by_caption:
            plan.captions[p] = {}
            plan.missing_captions[p] = []
            if extra is None:
                raise UserError(
                    f"The encoder cache cannot hold the '{p}' part of {type(trainer).__name__}: it is computed from the "
                    "caption, and the captions vary per visit without limit (data.shuffle_tags=true). Set "
                    "offload.park.cache_text=false or data.shuffle_tags=false."
                )
        for v, (i, flip) in enumerate(views):
            key = entry_key(signatures[p], fps.of(i, specs[p].inputs, flip))
            plan.keys[p].append(key)
            first_index.setdefault((p, key), v)
            if by_caption:
                plan.captions[p][fps.caption(i)] = key
        if by_caption:
            for text in sorted(extra or ()):
                if text not in plan.captions[p]:
                    key = entry_key(signatures[p], {"caption": text})
                    plan.captions[p][text] = key
                    extra_entries[(p, key)] = text
    unusable = cache.verify_many([*first_index, *extra_entries])
    for (p, key), i in first_index.items():  # dict order: by part, then by first index
        why = unusable.get((p, key))
        if why is not None:
            plan.missing[p].append(i)
            if why != "missing":
                plan.bad[cache.path(p, key)] = why
    for (p, key), text in extra_entries.items():
        why = unusable.get((p, key))
        if why is not None:
            plan.missing_captions[p].append(text)
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
    counts = {p: len(v) + len(plan.missing_captions.get(p, ())) for p, v in plan.missing.items()}
    log.info("encoder cache: encoding %d entries (%s) in batches of %d into %s", total,
             ", ".join(f"{p}: {n}" for p, n in counts.items() if n), batch_size, cache.root)
    group_of = getattr(dataset, "group_of", None)
    for part, views in plan.missing.items():
        if part in plan.captions:  # by caption text: the files' captions, then the extra ones (dropout's "")
            texts = [fps.caption(plan.index_and_flip(v)[0]) for v in views] + list(plan.missing_captions.get(part, ()))
            chunks = [(None, texts[lo:lo + batch_size]) for lo in range(0, len(texts), batch_size)]
        else:  # by view, each batch of one output size (aspect-ratio buckets: tensors must stack)
            groups: dict[Any, list[int]] = {}
            for v in views:
                i = plan.index_and_flip(v)[0]
                groups.setdefault(group_of(i) if callable(group_of) else None, []).append(v)
            chunks = [(members[lo:lo + batch_size], None) for members in groups.values()
                      for lo in range(0, len(members), batch_size)]
        for chunk, texts in chunks:
            items = chunk if chunk is not None else texts
            padded = items + [items[-1]] * (batch_size - len(items))
            if chunk is not None:
                rows = [plan.index_and_flip(v) for v in padded]
                raw = fps.raw_inputs([i for i, _ in rows], specs[part].inputs, [f for _, f in rows])
            else:
                raw = {"caption": padded}
            batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in raw.items()}
            batch["sample_seed"] = torch.zeros(len(padded), dtype=torch.int64, device=device)
            with (autocast() if autocast is not None else nullcontext()), torch.no_grad():
                out = trainer.encode_part(models, part, batch)
            for row, item in enumerate(items):
                key = plan.keys[part][item] if chunk is not None else plan.captions[part][item]
                entry = {k: v[row] for k, v in out.items()}
                _refuse_nonfinite(entry, part, dataset, plan.index_and_flip(item)[0] if chunk is not None else None, item)
                cache.save(part, key, entry)
            del raw, batch, out, entry  # not held on the device across the next encode (as runner/plan/prepass.py)
            done += len(items)
            now = time.perf_counter()
            if now - last >= log_every_s or done == total:
                last = now
                rate = done / max(now - t0, 1e-9)
                log.info("encoder cache: %d/%d entries encoded (%.1f/s)", done, total, rate)
    return done


def _refuse_nonfinite(entry: dict[str, Any], part: str, dataset: Any, index: int | None, caption: Any) -> None:
    """An encoded entry holding NaN or inf is refused, naming its sample, before it is cached.

    Why: a NaN latent (an image whose pixels are NaN: a float TIFF, a broken decoder) was written
    with a valid checksum, so every later run read it as sound, and each step that drew the sample
    was skipped as non-finite without ever naming it."""
    bad = [k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
           and not bool(torch.isfinite(v).all())]
    if not bad:
        return
    from runner.data import describe_sample

    what = describe_sample(dataset, index) if index is not None else f"the caption {caption!r}"
    raise UserError(
        f"The encoder cache's '{part}' entry of {what} holds NaN or inf ({', '.join(bad)}): the sample itself is "
        "broken (pixels that are not finite, or a caption the encoder cannot take). Nothing was cached for it; "
        "fix or remove the file, then run again.")
