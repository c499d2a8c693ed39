"""One encoder-cache entry on disk: a safetensors file that carries a checksum of its own tensors.

Why a checksum: a cache entry is input the run did not compute itself. A few flipped or
overwritten bytes in an embedding still load as a valid tensor, and the run trains on garbage
(NaN losses from step 3 in the fault injector's case) without any error. safetensors itself only
checks that the header parses and that the offsets fit the file; it says nothing about the data.

What is checked (:func:`verify_entry`), reading only, so a cache on read-only media can be used:

* the 8-byte header length and the JSON header are readable;
* the metadata names this format (``FORMAT``), the entry's part and key (an entry of an older
  format, without a checksum, is invalid and gets re-encoded);
* every tensor's byte range has the size its dtype and shape need, the ranges tile the data
  region with no gap, and the data region ends exactly at the end of the file (a truncated or
  extended file fails here, before any hashing);
* the CRC-32 over every tensor's name, dtype, shape and bytes, in name order, equals the one
  stored in the metadata.

Why CRC-32 (``zlib.crc32``): it is the cheapest hash in the standard library on this machine
(2.7 GB/s on one core, against 1.7 GB/s for sha256 and 0.7 GB/s for blake2b; bench/cache_verify.py)
and releases the GIL, so a thread pool verifies several files at once. It detects every burst
error of up to 32 bits and misses a random corruption with probability 2**-32, which is enough
against disk and copy faults; it is no defence against someone who rewrites an entry on purpose
(such a person can write any tensors with a matching checksum anyway).

How the checksum is made on write: the tensors are serialized by safetensors, the checksum is
computed from that serialization's header and bytes by the same function that verifies, and the
header is rewritten with the checksum in its metadata (the data region is unchanged: offsets are
relative to it). One definition of what is summed serves both sides, whatever dtype names
safetensors uses.
"""
from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch

from runner.files import fix_fd_mode

FORMAT = "runner-encoder-cache/2"  # /1 had no checksum: its entries are re-encoded
CHECKSUM_KEY = "crc32"
HEADER_LIMIT = 100 << 20  # safetensors' own cap on a header's size

# Bytes per element of every dtype name the safetensors format defines.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class BadEntry(ValueError):
    """An entry that cannot be trusted; the message says why in a few words."""


def parse(blob: bytes | memoryview) -> tuple[dict[str, Any], dict[str, str], memoryview]:
    """(tensor descriptors, metadata, data region) of a safetensors file's bytes, with the sizes checked.

    Raises :class:`BadEntry` for an empty, truncated or malformed file.
    """
    view = memoryview(blob)
    if len(view) == 0:
        raise BadEntry("empty file")
    if len(view) < 8:
        raise BadEntry(f"truncated: {len(view)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", view[:8])
    if n > HEADER_LIMIT or 8 + n > len(view):
        raise BadEntry(f"truncated: the header says it is {n} bytes long, the file has {len(view) - 8} after the length")
    try:
        header = json.loads(bytes(view[8:8 + n]))
    except (UnicodeDecodeError, ValueError) as e:
        raise BadEntry(f"unreadable header ({e})") from None
    if not isinstance(header, dict):
        raise BadEntry("unreadable header (not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    data = view[8 + n:]
    end = 0
    try:
        ranges = sorted((tuple(d["data_offsets"]), name, d) for name, d in header.items())
        for (lo, hi), name, d in ranges:
            size = DTYPE_BYTES.get(d["dtype"])
            if size is None:
                raise BadEntry(f"tensor {name!r} has an unknown dtype {d['dtype']!r}")
            if lo != end or hi - lo != size * math.prod(d["shape"]):
                raise BadEntry(f"tensor {name!r}: bytes {lo}..{hi} do not follow {end} or do not fit "
                               f"{d['dtype']} {d['shape']}")
            end = hi
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, BadEntry):
            raise
        raise BadEntry(f"unreadable header ({type(e).__name__}: {e})") from None
    if end != len(data):
        raise BadEntry(f"truncated or padded: the tensors take {end} bytes, the file has {len(data)} after the header")
    return header, meta, data


def checksum(header: dict[str, Any], data: memoryview) -> str:
    """CRC-32 of every tensor's name, dtype, shape and bytes, in name order, as 8 hex digits."""
    crc = 0
    for name in sorted(header):
        d = header[name]
        lo, hi = d["data_offsets"]
        crc = zlib.crc32(f"{name}\0{d['dtype']}\0{list(d['shape'])}\0".encode(), crc)
        crc = zlib.crc32(data[lo:hi], crc)
    return f"{crc:08x}"


def verify_bytes(blob: bytes | memoryview, part: str, key: str) -> None:
    """Raise :class:`BadEntry` unless ``blob`` is a complete, intact entry of this format for (part, key)."""
    header, meta, data = parse(blob)
    if meta.get("format") != FORMAT:
        raise BadEntry(f"format {meta.get('format')!r}, not {FORMAT!r} (written by an older version, no checksum)")
    if meta.get("part") != part or meta.get("key") != key:
        raise BadEntry(f"holds part {meta.get('part')!r} key {meta.get('key')!r}, not this one")
    stored, actual = meta.get(CHECKSUM_KEY), checksum(header, data)
    if stored != actual:
        raise BadEntry(f"checksum mismatch: stored {stored}, computed {actual} from the tensors")


def verify_entry(path: Path, part: str, key: str) -> str | None:
    """Why the entry at ``path`` is unusable ("missing", "checksum mismatch ...") or None when it is intact.

    Opens the file read-only and reads it whole: the cost is one read and one CRC pass over the
    entry's bytes (bench/cache_verify.py measures it).
    """
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    try:
        verify_bytes(blob, part, key)
    except BadEntry as e:
        return str(e)
    return None


def entry_bytes(tensors: dict[str, torch.Tensor], part: str, key: str) -> bytes:
    """The bytes of one entry file: ``tensors`` serialized by safetensors, with format, part, key and checksum."""
    from safetensors.torch import save

    blob = save(tensors, metadata={"format": FORMAT, "part": part, "key": key})
    header, meta, data = parse(blob)
    meta[CHECKSUM_KEY] = checksum(header, data)
    # Sorted keys: the same tensors give the same bytes (safetensors' own metadata order varies
    # between calls), so two runs writing one entry at once write identical files.
    ordered = {"__metadata__": dict(sorted(meta.items())), **dict(sorted(header.items()))}
    head = json.dumps(ordered, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors aligns the data region to 8 bytes
    return struct.pack("<Q", len(head)) + head + bytes(data)


def write_entry(final: Path, tensors: dict[str, torch.Tensor], part: str, key: str) -> None:
    """Write one entry atomically: a temporary file in the same folder, then ``os.replace``.

    A crash, a full disk or a second run filling the same cache never leaves a half-written entry
    under the final name; a reader that opened the old file keeps reading the old one.
    """
    blob = entry_bytes(tensors, part, key)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=final.parent)
    try:
        fix_fd_mode(fd)  # 0644 under umask 022, not mkstemp's 0600: a cache may be shared (runner/files.py)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
