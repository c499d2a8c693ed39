"""A model of PyTorch's CUDA caching allocator: what a sequence of allocations *reserves*.

Why: the live-bytes tracker counts what tensors hold (``torch.cuda.max_memory_allocated``), but
a card runs out when the allocator cannot *reserve* a block: it rounds every request, keeps
freed blocks cached for reuse, and a cached block too small for the next request is
fragmentation. On the H200 (docs/benchmarks.md, "GPU truth") reserved was 1.01-1.03x the
allocated peak without side streams. Replaying the planner's allocation sequence through this
model gives the reserved peak of the step as the allocator would hold it, so the budget can be
checked against what the card must really provide.

What is modelled (c10/cuda/CUDACachingAllocator.cpp, read for its rules, no code copied):

* every request is rounded up to 512 B; requests of at most 1 MiB come from the small pool,
  larger ones from the large pool; a zero-byte request takes no block;
* a request takes the smallest cached free block of its pool that fits (best fit), split when
  the remainder is worth keeping, and freed blocks merge with free neighbours;
* ``expandable_segments=False``: a miss reserves a new segment: 2 MiB for small requests,
  20 MiB for requests under 10 MiB, the request rounded up to 2 MiB above that; a large block
  is split only when more than 1 MiB remains;
* ``expandable_segments=True`` (the runner's default, plugins/allocator.py): each pool is one
  virtual range mapped in pages (2 MiB small, 20 MiB large) on demand; a miss extends the free
  block at the end of the range, or maps new pages there; any remainder of 512 B or more is
  split off;
* a cap (``cap_bytes``, what ``set_per_process_memory_fraction`` does): when reserving more would
  pass it, the allocator frees what it has cached (whole free segments; unused pages of an
  expandable range) and retries (``retries``); if it still cannot, that is an OOM (``ooms``;
  the model records it and goes on, so one replay finds every point that would fail).

Not modelled, and why: one stream. A block a side stream used is reusable only after that
stream's work is done (``record_stream``); with stream offload the H200 reserved 1.18x the
allocated peak, and the planner's in-order simulation cannot know how far the host runs ahead
of the copies. Under a cap an expandable range's released pages are remapped where the next
request fits (the real allocator prefers the lowest free address run); that only matters at
the cap, where the retry count is what the plan reports.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_BLOCK = 512
SMALL_SIZE = 2**20  # requests up to this size use the small pool
SMALL_BUFFER = 2 * 2**20  # small-pool segment, and an expandable small pool's page
LARGE_BUFFER = 20 * 2**20  # segment for requests under MIN_LARGE_ALLOC, and an expandable large page
MIN_LARGE_ALLOC = 10 * 2**20
ROUND_LARGE = 2 * 2**20


def round_size(nbytes: int) -> int:
    """The bytes a request of ``nbytes`` takes: a multiple of 512 B, at least 512 B."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment reserved for a (rounded) request that no cached block fits (classic segments)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass
class _Block:
    addr: int
    size: int
    segment: int  # classic: the segment's id; expandable: the pool's range
    free: bool = True


class _Pool:
    """One pool's blocks by address and its free blocks by (size, address)."""

    def __init__(self, small: bool, base: int) -> None:
        self.small = small
        self.base = base  # where its addresses start (pools never share an address)
        self.by_addr: dict[int, _Block] = {}
        self.by_end: dict[int, int] = {}  # end address -> start address of the block ending there
        self.free: list[tuple[int, int]] = []  # sorted (size, addr) of free blocks
        self.end = base  # expandable: end of the range used so far

    def add(self, b: _Block) -> None:
        self.by_addr[b.addr] = b
        self.by_end[b.addr + b.size] = b.addr
        if b.free:
            bisect.insort(self.free, (b.size, b.addr))

    def remove(self, b: _Block) -> None:
        del self.by_addr[b.addr]
        del self.by_end[b.addr + b.size]
        if b.free:
            del self.free[bisect.bisect_left(self.free, (b.size, b.addr))]

    def neighbours(self, b: _Block) -> tuple[_Block | None, _Block | None]:
        prev = self.by_addr.get(self.by_end.get(b.addr, -1))
        nxt = self.by_addr.get(b.addr + b.size)
        same = lambda o: o if o is not None and o.segment == b.segment else None
        return same(prev), same(nxt)


class CachingAllocatorModel:
    """Replays allocations and frees; reports allocated and reserved bytes and their peaks.

    ``alloc(key, nbytes)`` and ``free(key)`` mirror a storage's birth and death; ``key`` is any
    hashable that names one live allocation.
    """

    def __init__(self, expandable_segments: bool = True, cap_bytes: int | None = None) -> None:
        self.expandable = expandable_segments
        self.cap = cap_bytes
        self.pools = {True: _Pool(True, 1 << 56), False: _Pool(False, 0)}
        self.live: dict[object, tuple[_Block, int]] = {}  # key -> (block, requested bytes)
        self.segments: dict[int, int] = {}  # classic: segment id -> size
        self.pages: dict[bool, set[int]] = {True: set(), False: set()}  # expandable: mapped page numbers
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.retries = self.ooms = 0
        self.first_oom_at: int | None = None  # the allocation (counted from 1) that first failed
        self._count = 0
        self._segment_ids = 0

    # ---- the requests ------------------------------------------------------------------------
    def alloc(self, key: object, nbytes: int) -> None:
        if nbytes <= 0 or key in self.live:
            return
        self._count += 1
        size = round_size(nbytes)
        pool = self.pools[size <= SMALL_SIZE]
        block = self._best_fit(pool, size)
        if block is None:
            block = self._grow(pool, size)
        if self.expandable:
            self._map(pool, block.addr, size)
        pool.remove(block)
        block.free = False
        if block.size - size >= (MIN_BLOCK if pool.small or self.expandable else SMALL_SIZE + 1):
            rest = _Block(block.addr + size, block.size - size, block.segment)
            block.size = size
            pool.add(rest)
        pool.add(block)
        self.live[key] = (block, size)
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: object) -> None:
        found = self.live.pop(key, None)
        if found is None:
            return
        block, size = found
        pool = self.pools[size <= SMALL_SIZE]
        self.allocated -= size
        pool.remove(block)
        block.free = True
        prev, nxt = pool.neighbours(block)
        for other in (prev, nxt):
            if other is not None and other.free:
                pool.remove(other)
                block = _Block(min(block.addr, other.addr), block.size + other.size, block.segment)
        pool.add(block)

    # ---- finding and reserving space ---------------------------------------------------------
    def _best_fit(self, pool: _Pool, size: int) -> _Block | None:
        i = bisect.bisect_left(pool.free, (size, -1))
        tail = None
        while i < len(pool.free):
            b = pool.by_addr[pool.free[i][1]]
            if self.expandable and b.addr + b.size == pool.end:
                tail = tail or b  # the block that can grow is the last choice (it can serve any size)
                i += 1
                continue
            return b
        return tail

    def _grow(self, pool: _Pool, size: int) -> _Block:
        """A free block of at least ``size``: a new segment, or the expandable range extended."""
        if not self.expandable:
            seg = segment_size(size)
            self._reserve(seg)
            self._segment_ids += 1
            sid = self._segment_ids
            self.segments[sid] = seg
            addr = pool.end
            pool.end += seg
            block = _Block(addr, seg, sid)
            pool.add(block)
            return block
        last = pool.by_addr.get(pool.by_end.get(pool.end, -1))
        if last is not None and last.free:
            pool.remove(last)  # smaller than size: a fitting tail would have been the best fit
            last.size = size
            pool.end = last.addr + last.size
            pool.add(last)
            return last
        block = _Block(pool.end, size, 0)
        pool.end += size
        pool.add(block)
        return block

    def _map(self, pool: _Pool, addr: int, size: int) -> None:
        """Map the pages ``[addr, addr + size)`` touches that are not mapped yet."""
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        first, last = (addr - pool.base) // page, (addr - pool.base + size - 1) // page
        mapped = self.pages[pool.small]
        new = [p for p in range(first, last + 1) if p not in mapped]
        if new:
            self._reserve(len(new) * page)
            mapped.update(new)

    def _reserve(self, nbytes: int) -> None:
        if self.cap is not None and self.reserved + nbytes > self.cap:
            self.retries += 1
            self._release_cached()
            if self.reserved + nbytes > self.cap:
                self.ooms += 1
                if self.first_oom_at is None:
                    self.first_oom_at = self._count
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release the cached blocks no allocation uses."""
        self._release_cached()

    def _release_cached(self) -> None:
        """What the allocator frees before it retries: whole free segments, or unused pages."""
        if not self.expandable:
            for pool in self.pools.values():
                for b in [b for b in pool.by_addr.values() if b.free and b.size == self.segments.get(b.segment)]:
                    pool.remove(b)
                    self.reserved -= self.segments.pop(b.segment)
            return
        for small, pool in self.pools.items():
            page = SMALL_BUFFER if small else LARGE_BUFFER
            used: set[int] = set()
            for b in pool.by_addr.values():
                if not b.free:
                    used.update(range((b.addr - pool.base) // page, (b.addr - pool.base + b.size - 1) // page + 1))
            released = self.pages[small] - used
            self.reserved -= len(released) * page
            self.pages[small] = used
