"""The caching allocator's model: its rules, each on a sequence whose reserved bytes follow from them.

The figures are the allocator's documented constants (512 B blocks, 2 MiB small segments, 20 MiB
segments below 10 MiB, 2 MiB rounding above; 2 MiB / 20 MiB pages for expandable segments). The
model against the real allocator is the GPU test at the end (skipped without CUDA).
"""
from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys

import pytest

from runner.memory.caching_allocator import (
    LARGE_BUFFER,
    SMALL_BUFFER,
    CachingAllocatorModel,
    round_size,
    segment_size,
)

MiB = 2**20


def test_requests_are_rounded_to_512_bytes_and_segments_by_size() -> None:
    assert [round_size(n) for n in (1, 512, 513, 4096)] == [512, 512, 1024, 4096]
    assert segment_size(MiB) == SMALL_BUFFER
    assert segment_size(MiB + 512) == LARGE_BUFFER
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(15 * MiB + 512) == 16 * MiB


def test_fixed_segments_are_cached_split_and_merged() -> None:
    m = CachingAllocatorModel(expandable_segments=False)
    m.alloc("tiny", 100)
    assert (m.allocated, m.reserved) == (512, SMALL_BUFFER)
    m.alloc("a", 3 * MiB)  # a 20 MiB segment; 17 MiB stay cached in it
    assert m.reserved == SMALL_BUFFER + LARGE_BUFFER
    m.alloc("b", 15 * MiB)  # fits the cached remainder: nothing new is reserved
    assert m.reserved == SMALL_BUFFER + LARGE_BUFFER
    m.free("a")
    m.alloc("c", 5 * MiB)  # 3 MiB + 2 MiB are free in the segment, but not together: a new one
    assert m.reserved == SMALL_BUFFER + 2 * LARGE_BUFFER
    m.free("b")  # b merges with the free 3 MiB before it and the 2 MiB after: one 20 MiB block
    m.alloc("d", 18 * MiB)
    assert m.reserved == SMALL_BUFFER + 2 * LARGE_BUFFER
    assert m.peak_allocated == 512 + 3 * MiB + 15 * MiB + 5 * MiB


def test_a_large_block_is_split_only_when_more_than_1_mib_remains() -> None:
    m = CachingAllocatorModel(expandable_segments=False)
    m.alloc("a", 12 * MiB)  # a 12 MiB segment, exactly
    m.free("a")
    m.alloc("b", 11 * MiB + 512)  # 1 MiB - 512 B would remain: the whole block is taken
    m.alloc("c", 512 * 1024 + 1)  # small pool: unaffected
    m.alloc("d", 11 * MiB)  # the 12 MiB block is in use: a new segment
    assert m.reserved == 12 * MiB + SMALL_BUFFER + 12 * MiB


def test_expandable_segments_grow_the_free_end_page_by_page() -> None:
    m = CachingAllocatorModel(expandable_segments=True)
    m.alloc("a", 3 * MiB)
    assert m.reserved == LARGE_BUFFER  # one 20 MiB page of the large pool
    m.alloc("b", 30 * MiB)  # 17 MiB free at the end grow to 30 MiB: 33 MiB in two pages
    assert m.reserved == 2 * LARGE_BUFFER
    m.free("a")
    m.alloc("c", 2 * MiB)  # the 3 MiB hole is the best fit: no new page
    assert m.reserved == 2 * LARGE_BUFFER
    m.free("b")  # the free end now starts at 2 MiB
    m.alloc("d", 40 * MiB)  # it grows to 40 MiB: pages up to 42 MiB
    assert m.reserved == 3 * LARGE_BUFFER


def test_expandable_segments_prefer_a_cached_hole_to_the_growing_end() -> None:
    m = CachingAllocatorModel(expandable_segments=True)
    for k in "abc":
        m.alloc(k, 6 * MiB)
    m.free("a")  # a 6 MiB hole at the start; 2 MiB free at the end of the first page
    m.alloc("d", 2 * MiB)  # the end fits exactly but can grow: the hole is taken
    m.alloc("e", 4 * MiB)  # the rest of the hole
    assert m.reserved == LARGE_BUFFER
    m.alloc("f", 2 * MiB)  # now the end
    assert m.reserved == LARGE_BUFFER


def test_a_cap_frees_the_cache_and_retries_then_fails() -> None:
    m = CachingAllocatorModel(expandable_segments=False, cap_bytes=45 * MiB)
    m.alloc("a", 20 * MiB)
    m.alloc("b", 20 * MiB)
    m.free("a")
    m.alloc("c", 24 * MiB)  # 20 MiB are cached but too small: freeing them lets 24 MiB fit
    assert (m.retries, m.ooms, m.reserved) == (1, 0, 44 * MiB)
    m.alloc("d", 4 * MiB)  # 44 + 20 > 45 and nothing is cached: an OOM
    assert (m.retries, m.ooms, m.first_oom_at) == (2, 1, 4)


def test_a_cap_unmaps_unused_pages_of_an_expandable_range() -> None:
    m = CachingAllocatorModel(expandable_segments=True, cap_bytes=4 * LARGE_BUFFER)
    m.alloc("a", 2 * LARGE_BUFFER)
    m.alloc("b", LARGE_BUFFER)
    m.free("a")
    m.alloc("c", 2 * LARGE_BUFFER + 512)  # a's 2 pages are too few; 3 more would pass the cap
    assert (m.retries, m.ooms) == (1, 0)  # so a's pages are unmapped first: b's page + c's 3
    assert m.reserved == 4 * LARGE_BUFFER
    m.alloc("d", 512)  # the small pool's first page: over the cap with nothing left to release
    assert (m.retries, m.ooms, m.first_oom_at) == (2, 1, 4)


def test_random_sequences_keep_the_books() -> None:
    rng = random.Random(0)
    for expandable in (False, True):
        m = CachingAllocatorModel(expandable_segments=expandable)
        live: dict[int, int] = {}
        for i in range(3000):
            if live and rng.random() < 0.45:
                k = rng.choice(list(live))
                m.free(k)
                del live[k]
            else:
                n = rng.choice([rng.randint(1, 4096), rng.randint(1, 2 * MiB), rng.randint(MiB, 64 * MiB)])
                m.alloc(i, n)
                live[i] = round_size(n)
            assert m.allocated == sum(live.values()) <= m.reserved
        for pool in m.pools.values():  # blocks tile each segment: no overlap, no gap
            ends = sorted((b.addr, b.addr + b.size) for b in pool.by_addr.values())
            assert all(e0 <= a1 for (_, e0), (a1, _) in itertools.pairwise(ends))


_GPU_SCRIPT = r"""
import json, random, sys, torch
from runner.memory.caching_allocator import CachingAllocatorModel
rng = random.Random(1)
m = CachingAllocatorModel(expandable_segments=sys.argv[1] == "True")
live, peaks = {}, []
torch.cuda.reset_peak_memory_stats()
for i in range(4000):
    if live and rng.random() < 0.45:
        k = rng.choice(list(live)); del live[k]; m.free(k)
    else:
        n = rng.choice([rng.randint(1, 4096), rng.randint(1, 2 << 20), rng.randint(1 << 20, 64 << 20)])
        live[i] = torch.empty(n, dtype=torch.uint8, device="cuda"); m.alloc(i, n)
print(json.dumps([torch.cuda.max_memory_allocated(), m.peak_allocated,
                  torch.cuda.max_memory_reserved(), m.peak_reserved]))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA: the real allocator")
@pytest.mark.parametrize("expandable", [False, True])
def test_the_model_reserves_what_the_cuda_allocator_reserves(expandable: bool) -> None:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{expandable}"}
    out = subprocess.run([sys.executable, "-c", _GPU_SCRIPT, str(expandable)], env=env, capture_output=True,
                         text=True, check=True)
    real_alloc, model_alloc, real_reserved, model_reserved = json.loads(out.stdout.strip().splitlines()[-1])
    assert real_alloc == model_alloc
    assert abs(real_reserved - model_reserved) <= 0.02 * real_reserved
