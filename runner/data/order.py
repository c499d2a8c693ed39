"""Which samples make up each optimizer step's global batch: :class:`BatchOrder`.

The runner, not the trainer or a data loader, decides it, so that a run is a pure function of
its seed: ``order.batch(k)`` gives step ``k``'s dataset indices and one seed per sample, the
same in every process, after any resume, and however the step is cut into micro-batches (the
OOM recovery of runner/guards/oom.py re-cuts it; a distributed run shards the same global batch across
ranks). A sample's seed is its global position, ``train.seed * 1_000_003 + position`` with
``position = step * batch_size + row``: a *visit* seed, so the same image seen twice gets fresh
noise, timestep and caption draws.

Two ways to fill the steps, chosen from the data:

* **one stream** (every sample has the same output size and no set has a weight; the default):
  the epoch's pool (each image ``repeats`` times; once without ``data.sets``) is shuffled with a
  seeded permutation per epoch and cut into consecutive batches, which may cross the epoch
  boundary. Without sets this is exactly the order the runner always used (:class:`SampleOrder`).
* **batches within a group** (aspect-ratio buckets or per-set resolutions give samples different
  sizes, or sets have weights): a batch's samples share one output size, so their tensors stack
  and every micro-batch of a step is one bucket. Per epoch, each bucket's pool is shuffled and
  cut into batches; a bucket's last, partial batch is topped up from the start of its own
  shuffled list (so every step has ``train.batch_size`` samples; the log says how many visits an
  epoch repeats this way); then the epoch's batches are shuffled. With weights, each step first
  draws its set (runner/data/sets.py says how repeats and weights combine) and takes that set's
  next batch, each set cycling through its own pool.

Everything is seeded from ``train.seed`` and the epoch (or the set's cycle), never from a
global RNG, and computed lazily: one epoch's batch list is kept at a time.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from runner.data.captions import uniform
from runner.data.sets import SetInfo
from runner.errors import UserError

log = logging.getLogger("runner")

SEED_STRIDE = 1_000_003  # sample seed = train.seed * SEED_STRIDE + position
_SALT_SET = 0x53455453  # "SETS": the set each step draws (weighted sets)


class SampleOrder:
    """Global sample position -> dataset index, one seeded permutation per epoch (the one-stream
    order; kept as it was so that runs without the data options are unchanged bit for bit)."""

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples <= 0:
            raise UserError("The dataset is empty: data.path must hold at least one image with a caption.")
        self.n = num_samples
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).tolist()}
        return self._perms[epoch]

    def indices(self, start: int, count: int) -> list[int]:
        return [self._perm(p // self.n)[p % self.n] for p in range(start, start + count)]

    def sample_seeds(self, start: int, count: int) -> torch.Tensor:
        return torch.tensor([self.seed * SEED_STRIDE + p for p in range(start, start + count)], dtype=torch.int64)


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step's global batch: dataset indices and each sample's visit seed."""

    indices: list[int]
    seeds: torch.Tensor  # int64, one per index


def _generator(*parts: int) -> torch.Generator:
    seed = 0
    for p in parts:
        seed = (seed * 1_000_000_007 + int(p)) % (1 << 62)
    return torch.Generator().manual_seed(seed)


def _shuffled(items: list[int], *seed_parts: int) -> list[int]:
    perm = torch.randperm(len(items), generator=_generator(*seed_parts)).tolist()
    return [items[i] for i in perm]


def _batches_of(pool: list[int], groups: list[Any], batch_size: int, *seed_parts: int) -> tuple[list[list[int]], int]:
    """``pool`` cut into batches within each group (shuffled per group, the last batch topped up
    from the group's start), then the batches shuffled; and how many visits the top-ups repeat."""
    by_group: dict[Any, list[int]] = {}
    for i in pool:
        by_group.setdefault(groups[i], []).append(i)
    batches: list[list[int]] = []
    topped = 0
    for g, key in enumerate(sorted(by_group, key=repr)):
        members = _shuffled(by_group[key], *seed_parts, g)
        for lo in range(0, len(members), batch_size):
            chunk = members[lo:lo + batch_size]
            missing = batch_size - len(chunk)
            chunk += [members[j % len(members)] for j in range(missing)]
            topped += missing
            batches.append(chunk)
    order = torch.randperm(len(batches), generator=_generator(*seed_parts, -1)).tolist()
    return [batches[i] for i in order], topped


class BatchOrder:
    """Step -> :class:`StepBatch` for ``dataset`` (see the module docstring).

    Reads from the dataset, when it has them: ``set_layout()`` (runner/data/sets.py: each set's
    index range, repeats and weight) and ``group_of(i)`` (the output size: samples of one batch
    share it). Any other map-style dataset is one set of one group.
    """

    def __init__(self, dataset: Any, batch_size: int, seed: int) -> None:
        n = len(dataset)
        if n <= 0:
            raise UserError("The dataset is empty: data.path must hold at least one image with a caption.")
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        layout = getattr(dataset, "set_layout", None)
        self.sets: list[SetInfo] = layout() if callable(layout) else [SetInfo("data", 0, n)]
        group_of = getattr(dataset, "group_of", None)
        self.groups: list[Any] = [group_of(i) for i in range(n)] if callable(group_of) else [None] * n
        weights = [s.weight for s in self.sets]
        if any(w is not None for w in weights) and any(w is None for w in weights):
            unset = ", ".join(s.name for s in self.sets if s.weight is None)
            raise UserError(f"data.sets: weight is set on some sets but not on {unset}. Give every set a weight "
                            "(the chance a step's batch comes from it) or none (sets are then mixed in proportion "
                            "to images x repeats).")
        self.weighted = len(self.sets) > 1 and weights[0] is not None
        self.one_stream = not self.weighted and len(set(self.groups)) == 1
        # (base step, base position): step k starts at position base + (k - base step) * batch_size.
        self._base = (0, 0)
        self._epoch_cache: tuple[Any, list[list[int]]] | None = None
        self.topped_per_epoch = 0
        if self.one_stream:
            self.pool = [i for s in self.sets for i in range(s.start, s.stop) for _ in range(s.repeats)]
            self.stream = SampleOrder(len(self.pool), self.seed)
        elif not self.weighted:
            self.pool = [i for s in self.sets for i in range(s.start, s.stop) for _ in range(s.repeats)]
            epoch0, self.topped_per_epoch = _batches_of(self.pool, self.groups, self.batch_size, self.seed, 0)
            self.batches_per_epoch = len(epoch0)
            self._epoch_cache = (0, epoch0)
        else:
            total = sum(s.weight for s in self.sets)
            if not total > 0:
                raise UserError("data.sets: the weights add up to 0; give each set a weight > 0.")
            self.cumulative = []
            acc = 0.0
            for s in self.sets:
                acc += s.weight / total
                self.cumulative.append(acc)
            self.set_pools = [[i for i in range(s.start, s.stop) for _ in range(s.repeats)] for s in self.sets]
            self._set_cycles: dict[tuple[int, int], list[list[int]]] = {}
            self.set_batches = [len(self._set_cycle(s, 0)) for s in range(len(self.sets))]
            self._drawn: list[int] = []  # the set of each batch so far
            self._counts: list[list[int]] = [[0] * len(self.sets)]  # counts before batch b (every 1024th b)

    # ---- resume ------------------------------------------------------------------------------------
    def resume(self, step: int, samples_seen: int) -> None:
        """Continue the stream of a resumed run: step ``step`` starts at position ``samples_seen``
        (they differ from ``step * batch_size`` only if the batch size was changed on resume)."""
        self._base = (int(step), int(samples_seen))

    def position(self, step: int) -> int:
        base_step, base_position = self._base
        return base_position + (step - base_step) * self.batch_size

    # ---- the batch of a step ----------------------------------------------------------------------
    def batch(self, step: int) -> StepBatch:
        """Step ``step``'s (0-based) global batch."""
        start, b = self.position(step), self.batch_size
        seeds = torch.tensor([self.seed * SEED_STRIDE + p for p in range(start, start + b)], dtype=torch.int64)
        if self.one_stream:
            indices = [self.pool[j] for j in self.stream.indices(start, b)]
        elif not self.weighted:
            epoch, within = divmod(start // b, self.batches_per_epoch)
            indices = list(self._epoch(epoch)[within])
        else:
            indices = list(self._weighted_batch(start // b))
        return StepBatch(indices, seeds)

    def _epoch(self, epoch: int) -> list[list[int]]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            self._epoch_cache = (epoch, _batches_of(self.pool, self.groups, self.batch_size, self.seed, epoch)[0])
        return self._epoch_cache[1]

    def _set_cycle(self, s: int, cycle: int) -> list[list[int]]:
        key = (s, cycle)
        if key not in self._set_cycles:
            if len(self._set_cycles) > 4 * len(self.sets):
                self._set_cycles.clear()
            self._set_cycles[key] = _batches_of(self.set_pools[s], self.groups, self.batch_size, self.seed, s + 1, cycle)[0]
        return self._set_cycles[key]

    def set_of(self, batch_number: int) -> int:
        """The set that batch ``batch_number`` (a global count of batches) is drawn from."""
        u = uniform(self.seed * SEED_STRIDE + batch_number, _SALT_SET)
        for s, edge in enumerate(self.cumulative):
            if u < edge:
                return s
        return len(self.cumulative) - 1

    def _weighted_batch(self, number: int) -> list[int]:
        # How many earlier batches drew this batch's set: counted from the nearest stored point.
        every = 1024
        point = min(number // every, len(self._counts) - 1)
        counts = list(self._counts[point])
        for b in range(point * every, number):
            counts[self.set_of(b)] += 1
            if (b + 1) % every == 0 and (b + 1) // every == len(self._counts):
                self._counts.append(list(counts))
        s = self.set_of(number)
        cycle, within = divmod(counts[s], self.set_batches[s])
        return self._set_cycle(s, cycle)[within]

    # ---- for the run log ----------------------------------------------------------------------------
    def describe(self) -> str:
        if self.one_stream:
            return ""
        b = self.batch_size
        if not self.weighted:
            text = (f"batch order: {self.batches_per_epoch} batches of {b} per epoch, each from one size "
                    f"({len(set(self.groups))} sizes)")
            if self.topped_per_epoch:
                text += (f"; {self.topped_per_epoch} visits per epoch repeat an image to fill a size's last batch "
                         f"(train.batch_size={b})")
            return text
        shares = ", ".join(f"{s.name} {w:.0%}" for s, w in
                           zip(self.sets, [c - p for c, p in zip(self.cumulative, [0.0, *self.cumulative[:-1]])]))
        return f"batch order: each step's batch of {b} from one set, drawn by weight ({shares}), each from one size"
