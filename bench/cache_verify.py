"""What verifying the encoder cache before training costs (plugins/park/entry.py, plan_cache).

    python bench/cache_verify.py                  # 10 000 entries of SDXL at 1024 px, bf16 (~2.9 GB on disk)
    python bench/cache_verify.py --dtype fp32     # the same in float32 (~5.8 GB)
    python bench/cache_verify.py --write          # also replace this section of docs/benchmarks.md

The entries are what SDXL's trainer caches per sample, half of each kind: a text entry
(``prompt_embeds`` 77 x 2048 and ``pooled`` 1280) and a latent entry (posterior ``mean`` and
``std``, 4 x 128 x 128 each at 1024 px), filled with random values and written by
``EncoderCache.save``. Timed: verifying every entry with one thread and with the default pool,
with the files in the page cache ("warm": a second run on the same machine) and evicted from it
("cold": ``posix_fadvise(DONTNEED)`` on each file after an ``fdatasync``, so only these files
leave the page cache, not other users'), against the ``is_file`` check the cache did before.
Also the in-memory throughput of the candidate checksums on one entry's bytes, which is why
CRC-32 was chosen. The temporary folder is removed afterwards.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from docs_section import replace_section  # noqa: E402  (bench/ is on sys.path as the script's folder)

MARK_BEGIN = "<!-- bench/cache_verify.py begin -->"
MARK_END = "<!-- bench/cache_verify.py end -->"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sample_entries(resolution: int, dtype: torch.dtype, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    side = resolution // 8
    return {
        "text": {"prompt_embeds": torch.randn(77, 2048, generator=g).to(dtype),
                 "pooled_prompt_embeds": torch.randn(1280, generator=g).to(dtype)},
        "latents": {"mean": torch.randn(4, side, side, generator=g).to(dtype),
                    "std": torch.rand(4, side, side, generator=g).to(dtype)},
    }


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (only theirs), so the next read comes from disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def hash_rates(blob: bytes, repeat: int = 200) -> dict[str, float]:
    """GB/s of each candidate checksum over ``blob`` (one thread, in memory)."""
    view = memoryview(blob)
    candidates = {
        "zlib.crc32 (chosen)": lambda: zlib.crc32(view),
        "hashlib.sha256": lambda: hashlib.sha256(view).digest(),
        "hashlib.blake2b": lambda: hashlib.blake2b(view, digest_size=16).digest(),
    }
    rates = {}
    for name, fn in candidates.items():
        seconds, _ = timed(lambda: [fn() for _ in range(repeat)])
        rates[name] = len(blob) * repeat / seconds / 1e9
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=10_000, help="entries in all, half text, half latents")
    ap.add_argument("--resolution", type=int, default=1024, help="image size in px (latents are 1/8 of it)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--dir", default=None, help="where to build the cache (default: a temporary folder)")
    ap.add_argument("--write", action="store_true", help="replace this script's section of docs/benchmarks.md")
    args = ap.parse_args()
    from runner.plugins.park.cache import EncoderCache

    work = Path(tempfile.mkdtemp(prefix="bench-cache-verify-", dir=args.dir))
    try:
        cache = EncoderCache(work)
        kinds = sample_entries(args.resolution, DTYPES[args.dtype], seed=0)
        items = []
        for i in range(args.entries):
            part = "text" if i % 2 == 0 else "latents"
            key = f"{i:064x}"
            items.append((part, key))
        fill_s, _ = timed(lambda: [cache.save(p, k, kinds[p]) for p, k in items])
        paths = [cache.path(p, k) for p, k in items]
        total = sum(p.stat().st_size for p in paths)
        sizes = {part: cache.path(*next(e for e in items if e[0] == part)).stat().st_size for part in kinds}
        threads = min(4, os.cpu_count() or 1)

        rows = []
        exists_s, _ = timed(lambda: [cache.has(p, k) for p, k in items])
        rows.append(("file exists (`is_file`, the check before this change)", "1", "warm", exists_s))
        for label, n in (("verify: read + sizes + CRC-32", 1), ("verify: read + sizes + CRC-32", threads)):
            cache.verify_many(items[:64], threads=n)  # touch the code paths once
            seconds, bad = timed(lambda n=n: cache.verify_many(items, threads=n))
            assert not bad, f"{len(bad)} entries failed verification in the benchmark: {next(iter(bad.items()))}"
            rows.append((label, str(n), "warm", seconds))
        for n in (1, threads):
            evict(paths)
            seconds, bad = timed(lambda n=n: cache.verify_many(items, threads=n))
            assert not bad
            rows.append(("verify: read + sizes + CRC-32", str(n), "cold (evicted)", seconds))
        rates = hash_rates(paths[0].read_bytes())
    finally:
        shutil.rmtree(work, ignore_errors=True)

    command = "python bench/cache_verify.py " + " ".join(sys.argv[1:])
    gb = total / 1e9
    text = "\n".join([
        MARK_BEGIN,
        "## Encoder cache: verifying every entry before training (bench/cache_verify.py)",
        "",
        f"Command: `{command.strip()}` on {platform.machine()}, {os.cpu_count()} CPU cores "
        f"(shared with other work), Python {platform.python_version()}, torch {torch.__version__}.",
        "",
        f"{args.entries} entries, half SDXL text entries (prompt_embeds 77x2048 + pooled 1280, {sizes['text']} B "
        f"per file) and half latent entries (mean + std 4x{args.resolution // 8}x{args.resolution // 8}, "
        f"{sizes['latents']} B per file), {args.dtype}: {gb:.2f} GB in all; writing them took {fill_s:.1f} s "
        f"({gb / fill_s:.2f} GB/s).",
        "",
        "| check | threads | page cache | seconds | per entry | GB/s |",
        "|---|---|---|---|---|---|",
        *[f"| {label} | {n} | {state} | {s:.2f} | {s / args.entries * 1e6:.0f} µs | "
          f"{gb / s:.2f} |" if "verify" in label else
          f"| {label} | {n} | {state} | {s:.2f} | {s / args.entries * 1e6:.0f} µs | - |" for label, n, state, s in rows],
        "",
        "Checksum throughput on one entry's bytes, in memory, one thread: "
        + ", ".join(f"{name} {r:.2f} GB/s" for name, r in rates.items()) + ".",
        MARK_END,
    ])
    print(text)
    if args.write:
        replace_section(text, MARK_BEGIN, MARK_END)


if __name__ == "__main__":
    main()
