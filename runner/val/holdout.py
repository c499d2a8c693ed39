"""A held-out validation loss (``data.val_fraction`` or ``data.val_path``, ``val.every``).

``python -m runner data.val_fraction=0.1 val.every=50`` holds 10 % of the images out of training
and writes their mean loss as a ``val_loss`` column of metrics.jsonl (and to the tracker, and to
loss.png) every 50 steps and after the last one.

Comparable between runs and between resumes:

* **The split** (``data.val_fraction``) ranks the samples by a hash of ``val.seed`` and each
  sample's identity (its path relative to ``data.path``; the index for the demo set, or what a
  dataset's ``sample_key(i)`` returns) and holds out the first ``round(fraction * n)`` (at least
  one, and at least one left to train on). The same data and ``val.seed`` hold out the same
  images in every run, whatever ``train.seed``; adding images moves few of them. The held-out
  samples are never trained on: training draws its order (runner/loop.py) over the rest only.
  ``data.val_path`` is a separate folder in ``data.path``'s layout instead, read by the trainer's
  own ``dataset()`` with ``data.path`` set to it.
* **The noise and timesteps** of each held-out sample come from a seed fixed by ``val.seed`` and
  the sample's identity, not by the step: the trainers draw every random number of a sample from
  ``batch["sample_seed"]`` (runner/trainer.py), so every evaluation of one sample sees the same
  noise and timestep, and the curve moves only because the weights did.

The pass: the trainer's own ``encode`` and ``loss`` under ``torch.no_grad()`` with every module in
eval mode (train flags restored after), the run's autocast and the plugins' step contexts, in
micro-batches of ``val.batch_size`` (default: the training micro-batch); the mean weights each
micro-batch by its share, as training does. The encode path is training's: with ``offload=park``
the held-out samples of ``data.val_fraction`` are part of the data set park caches, so they are
read from the encoder cache like the training samples. Samples of ``data.val_path`` are not in
that data set: their cacheable encode parts (``encode_parts``) are computed once, before any
plugin runs (park may then drop the encoders), and kept in host RAM (SDXL at 1024 px: about
1.2 MB per sample), like the sampler's prompts; a trainer without encode parts encodes them at
every evaluation.

It changes nothing in training: the global RNG states (torch, CUDA, Python, numpy) are forked and
restored, no gradient is made, and the training losses are bit-identical with and without it
(tests/runner/val/test_holdout.py). An out-of-memory error halves the validation micro-batch and
retries; at one sample the evaluation is skipped with a warning: validation must never cost the
run. It runs between optimizer steps, where the gradients are freed; the planner plans it only
when it can raise the peak (``val.batch_size`` above the training micro-batch; runner/plan/val.py).

Several processes. ``dist=ddp``: every rank holds the same weights and evaluates every held-out
sample on its own; rank 0 logs the value. ``dist=fsdp``: each forward all-gathers the sharded units,
so every rank must run every forward; every rank evaluates *every* held-out sample too, each attempt
agreed on like a training step (runner/distributed/agree.py: an out-of-memory error on one rank halves the
micro-batch on all of them; the value is the ranks' mean, of equal numbers). Why not a share per
rank: the forwards are collective, so all ranks would still have to run the same number of them,
padding the held-out set to a multiple of the world size and weighting the padded samples out;
evaluating all of them costs the world size times the compute of a share, but the value is the one
process's formula on the same samples, micro-batches and seeds (equal within float tolerance, the
weights themselves differing by reduction order), and the held-out set is small beside training.
After the pass the FSDP units are resharded (a no-grad forward leaves the root unit gathered).
"""
from __future__ import annotations

import copy
import hashlib
import logging
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runner.errors import UserError
from runner.optim.modes import at_evaluation_point
from runner.val.config import ValConfig, as_val_path, val_source

if TYPE_CHECKING:
    from runner.context import RunContext

log = logging.getLogger("runner")

COLUMN = "val_loss"


# ---- the split -----------------------------------------------------------------------------------
def sample_key(dataset: Any, index: int) -> str:
    """A sample's identity, stable across runs: ``dataset.sample_key(i)`` when the dataset has it,
    else its file's path relative to the data folder, else its index."""
    fn = getattr(dataset, "sample_key", None)
    if callable(fn):
        return str(fn(index))
    paths, root = getattr(dataset, "paths", None), getattr(dataset, "root", None)
    if paths is not None and root is not None:
        return Path(paths[index]).relative_to(root).as_posix()
    return str(index)


def _hash(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "big")


def held_out_count(n: int, fraction: float) -> int:
    """How many of ``n`` samples ``fraction`` holds out: rounded, at least one."""
    return max(1, int(fraction * n + 0.5))


def split_indices(dataset: Any, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, held-out indices), both ascending: the held-out ones are the
    :func:`held_out_count` samples whose key hashes lowest with ``seed``."""
    n = len(dataset)
    k = held_out_count(n, fraction)
    if n - k < 1:
        raise UserError(f"data.val_fraction={fraction} holds out {k} of the {n} samples and leaves none to train on; "
                        "lower it, or use a separate folder (data.val_path).")
    ranked = sorted(range(n), key=lambda i: (_hash("val-split", seed, sample_key(dataset, i)), i))
    held = sorted(ranked[:k])
    chosen = set(held)
    return [i for i in range(n) if i not in chosen], held


def sample_seeds(keys: Sequence[str], seed: int) -> torch.Tensor:
    """Each held-out sample's noise/timestep seed: a hash of ``val.seed`` and its identity, below 2**40
    (the trainers derive further seeds from it by multiplying by about 2**20 in int64)."""
    return torch.tensor([_hash("val-noise", seed, key) >> 24 for key in keys], dtype=torch.int64)


class TrainingSubset(torch.utils.data.Dataset):
    """The data set without its held-out samples: what the loop's sample order draws from.

    Each item is the base data set's own (its ``index`` field, which the encoder cache reads, is
    the base index). Anything that indexes the data set by position must go through this view.
    """

    def __init__(self, dataset: Any, indices: list[int], held_out: int) -> None:
        self.dataset, self.indices, self.held_out = dataset, indices, held_out

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.dataset[self.indices[i]]

    # What runner/data/order.py and the loop read of a data set (buckets, several sets, per-visit
    # captions), by position in this view; absent where the base data set lacks it.
    def __getattr__(self, name: str) -> Any:
        base = self.__dict__["dataset"]
        if name in ("visit", "light_visit") and callable(getattr(base, name, None)):
            fn = getattr(base, name)
            return lambda i, seed: fn(self.indices[i], seed)
        if name == "group_of" and callable(getattr(base, name, None)):
            return lambda i: base.group_of(self.indices[i])
        if name == "set_layout" and callable(getattr(base, name, None)):
            return self._set_layout
        raise AttributeError(name)

    def _set_layout(self) -> list[Any]:
        """The base's sets over this view: the indices are ascending, so each set's kept samples
        stay one contiguous range; a set left with no sample is dropped."""
        from bisect import bisect_left
        from dataclasses import replace

        out = []
        for s in self.dataset.set_layout():
            start, stop = bisect_left(self.indices, s.start), bisect_left(self.indices, s.stop)
            if stop > start:
                out.append(replace(s, start=start, stop=stop))
        return out

    def describe(self) -> str:
        from runner.data import describe_dataset

        return (f"{describe_dataset(self.dataset)}; {self.held_out} held out for the validation loss "
                f"(data.val_fraction), {len(self.indices)} trained on")


# ---- the pass ------------------------------------------------------------------------------------
class NoValidation:
    """No held-out data: the loop's calls do nothing and the data set is trained whole."""

    def training_view(self, dataset: Any) -> Any:
        return dataset

    def maybe_evaluate(self, step: int) -> dict[str, float]:
        return {}


@contextmanager
def _rng_untouched(device: torch.device) -> Iterator[None]:
    """Every global RNG this process may draw from, as it was before the block."""
    py, npy = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


class Validation:
    """The held-out loss of one run; built by :func:`build_validation` (see the module docstring)."""

    def __init__(self, ctx: RunContext, config: Any, *, held: list[int] | None = None, train: list[int] | None = None,
                 val_dataset: Any = None, keys: list[str]) -> None:
        self.ctx = ctx
        self.every = int(config.every)
        self.batch_size = int(config.batch_size) if config.batch_size is not None else ctx.run.micro_batch
        self.total_steps = int(ctx.cfg.train.steps)
        self.held, self.train = held, train  # data.val_fraction: indices into the trainer's data set
        self.val_dataset = val_dataset  # data.val_path: the trainer's data set of that folder
        self.source: Any = val_dataset  # where held-out samples are read (the loop's data set for a fraction)
        self.keys = keys
        self.seeds = sample_seeds(keys, int(config.seed))
        self.parts: dict[str, dict[str, torch.Tensor]] | None = None  # val_path: encode parts on the host
        self.rows: list[dict[str, Any]] = []  # val_path with parts: each sample's keys but its pixels
        self.done: set[int] = set()

    def __len__(self) -> int:
        return len(self.keys)

    # ---- the loop's side -----------------------------------------------------------------------
    def training_view(self, dataset: Any) -> Any:
        """The loop's data set (park may have replaced it by one of the same indices) without the held-out samples."""
        if self.held is None:
            return dataset
        if len(dataset) != len(self.held) + len(self.train):
            raise RuntimeError(f"the training data set has {len(dataset)} samples, but the validation split was made "
                               f"on {len(self.held) + len(self.train)}")
        self.source = dataset
        return TrainingSubset(dataset, self.train, len(self.held))

    def due(self, step: int) -> bool:
        return step == self.total_steps or (self.every > 0 and step % self.every == 0)

    def maybe_evaluate(self, step: int) -> dict[str, float]:
        """``{"val_loss": x}`` after the steps of the schedule (and the last), else ``{}``."""
        if not self.due(step) or step in self.done:
            return {}
        self.done.add(step)
        t0 = time.perf_counter()
        with at_evaluation_point(self.ctx.optimizer):  # schedule-free: its evaluated weights, then back exactly
            value = self.evaluate(step)
        if value is None:
            return {}
        log.info("validation: step %d, val_loss %.6f over %d held-out samples (%.1f s)", step, value, len(self),
                 time.perf_counter() - t0)
        return {COLUMN: value}

    # ---- the evaluation --------------------------------------------------------------------------
    def raw_batch(self, lo: int, hi: int) -> dict[str, Any]:
        """Held-out samples ``lo:hi`` as the loader gives them, with their fixed seeds."""
        from runner.data import collate

        if self.held is not None:
            rows = [self.source[i] for i in self.held[lo:hi]]
        elif self.parts is not None:  # encoded at start: finish_encode reads no pixels
            rows = self.rows[lo:hi]
        else:
            rows = [self.source[i] for i in range(lo, hi)]
        raw = collate(rows)
        raw["sample_seed"] = self.seeds[lo:hi]
        return raw

    def _encoded(self, lo: int, hi: int) -> dict[str, Any]:
        from runner.trainer import encode, move_batch

        ctx = self.ctx
        mb = move_batch(self.raw_batch(lo, hi), ctx.device)
        if self.parts is None:
            return encode(ctx.trainer, ctx.models, mb)
        parts = {p: {k: v[lo:hi].to(ctx.device) for k, v in t.items()} for p, t in self.parts.items()}
        return ctx.trainer.finish_encode(parts, mb)

    def _passes(self, micro: int) -> float:
        ctx, n = self.ctx, len(self)
        total = 0.0
        for lo in range(0, n, micro):
            hi = min(lo + micro, n)
            with ctx.step_context(), ctx.accelerator.autocast():
                loss = ctx.trainer.loss(ctx.models, self._encoded(lo, hi))
            total += float(loss.detach()) * (hi - lo) / n
            del loss
        return total

    def evaluate(self, step: int) -> float | None:
        """The mean held-out loss now (None when even one sample at a time ran out of memory)."""
        from runner.guards.oom import first_line, is_out_of_memory, release_memory

        ctx = self.ctx
        flags = [(m, m.training) for _, module in ctx.models.items() for m in module.modules()]
        micro = max(1, min(self.batch_size, len(self)))
        try:
            with _rng_untouched(ctx.device), torch.no_grad():
                for _, module in ctx.models.items():
                    module.eval()
                while True:
                    error: BaseException | None = None
                    try:  # dist=fsdp: an attempt every rank agrees on (module docstring); else the passes
                        return ctx.dist.agreed(self._passes)(micro)
                    except Exception as e:
                        if not is_out_of_memory(e):
                            raise
                        error = e
                    error.__traceback__ = None
                    release_memory(ctx.device, ctx.card)
                    ctx.run_phase("on_oom", step, error)
                    if micro == 1:
                        log.warning("validation: out of memory at step %d even one sample at a time (%s); no val_loss "
                                    "for this step, training goes on", step, first_line(error))
                        return None
                    log.warning("validation: out of memory at step %d: validation micro-batch %d -> %d (%s)", step,
                                micro, micro // 2, first_line(error))
                    micro //= 2
                    self.batch_size = micro
        finally:
            ctx.dist.reshard()  # dist=fsdp: the root unit stays gathered after a no-grad forward
            for m, training in flags:
                m.training = training

    # ---- data.val_path: encode parts once, before the plugins ----------------------------------------
    @torch.no_grad()
    def encode_parts_now(self) -> None:
        """Every cacheable encode part of the held-out folder, computed now and kept on the host.

        Part by part, each part's modules on the device only while they encode (the models are
        all on the host before the plugins run; a VAE's ``encode`` bypasses forward hooks, so
        modules are moved, not hooked).
        """
        from runner.data import collate
        from runner.trainer import move_batch

        ctx, trainer, models = self.ctx, self.ctx.trainer, self.ctx.models
        specs = trainer.encode_parts()
        t0 = time.perf_counter()
        samples = [self.source[i] for i in range(len(self))]
        self.rows = [{k: v for k, v in s.items() if k != "pixel_values"} for s in samples]
        chunks: dict[str, dict[str, list[torch.Tensor]]] = {p: {} for p in specs}
        for part, spec in specs.items():
            modules = [models[m] for m in spec.modules if m in models]
            for m in modules:
                m.to(ctx.device)
            try:
                with ctx.accelerator.autocast():
                    for lo in range(0, len(self), self.batch_size):
                        hi = min(lo + self.batch_size, len(self))
                        raw = collate(samples[lo:hi])
                        raw["sample_seed"] = self.seeds[lo:hi]
                        for k, v in trainer.encode_part(models, part, move_batch(raw, ctx.device)).items():
                            chunks[part].setdefault(k, []).append(v.to(ctx.host))
            finally:
                for m in modules:
                    m.to(ctx.host)
        self.parts = {p: {k: torch.cat(v) for k, v in t.items()} for p, t in chunks.items()}
        nbytes = sum(v.numel() * v.element_size() for t in self.parts.values() for v in t.values())
        log.info("validation: %d samples of data.val_path encoded once (%s) and kept on the host (%.1f MiB, %.1f s)",
                 len(self), ", ".join(specs), nbytes / 2**20, time.perf_counter() - t0)


def _cacheable(trainer: Any) -> bool:
    return all(callable(getattr(trainer, m, None)) for m in ("encode_parts", "encode_part", "finish_encode"))


def build_validation(ctx: RunContext) -> Validation | NoValidation:
    """The run's held-out loss, from ``cfg.data.val_*`` and ``cfg.val``; call before
    ``ctx.apply_setup_phases()`` (with ``data.val_path`` it encodes there; see the module docstring).

    Needs ``ctx.cfg``, ``ctx.trainer``, ``ctx.models`` and ``ctx.accelerator``.
    """
    cfg = ctx.cfg
    fraction, path = val_source(cfg)
    if fraction == 0 and path is None:
        return NoValidation()
    config = cfg.get("val") or ValConfig()
    seed = int(config.seed)
    if fraction > 0:
        dataset = ctx.trainer.dataset()
        train, held = split_indices(dataset, fraction, seed)
        keys = [sample_key(dataset, i) for i in held]
        val = Validation(ctx, config, held=held, train=train, keys=keys)
        where = f"{len(held)} of {len(dataset)} samples held out (data.val_fraction={fraction}, val.seed={seed})"
    else:
        twin = copy.copy(ctx.trainer)
        twin.cfg = copy.deepcopy(cfg)
        twin.cfg.data.path = str(path)
        with as_val_path():
            dataset = twin.dataset()  # the trainer's own reading of data.path, on the held-out folder
        val = Validation(ctx, config, val_dataset=dataset, keys=[sample_key(dataset, i) for i in range(len(dataset))])
        where = f"{len(dataset)} samples of data.val_path={str(path)!r}"
        if _cacheable(ctx.trainer):
            val.encode_parts_now()
    schedule = f"every {val.every} steps and after the last" if val.every else "after the last step"
    log.info("validation: %s, evaluated %s in batches of %d", where, schedule, val.batch_size)
    return val
