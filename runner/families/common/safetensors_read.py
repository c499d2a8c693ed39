"""Reading safetensors files lazily: the header without data, and tensors in chunks converted to a dtype as read.

The file is reopened every :data:`CHUNK_BYTES` of data, because safetensors maps it whole and the pages
read stay in the process's RSS until it is closed (runner/families/common/single_file.py describes the loading).
"""
from __future__ import annotations

import torch

CHUNK_BYTES = 256 << 20  # file bytes read between two reopenings (see the module docstring)

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}



def read_header(file: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor's (shape, dtype) from the safetensors header, without reading any data."""
    import json
    import struct

    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: (tuple(v["shape"]), _SAFETENSORS_DTYPES.get(v["dtype"], torch.float32)) for k, v in header.items()}


def read_tensors(file: str, keys: list[str], dtype: torch.dtype | None,
                 chunk_bytes: int = CHUNK_BYTES) -> dict[str, torch.Tensor]:
    """``keys`` of ``file``, floating tensors converted to ``dtype`` as each is read.

    Tensors already in ``dtype`` stay views of the file's (copy-on-write) mapping, read on use;
    converted ones are new memory. The file is reopened every ``chunk_bytes``, so the mapped
    pages read for a conversion leave the process's RSS (see the module docstring).
    """
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    pending = list(keys)
    while pending:
        read = 0
        with safe_open(file, framework="pt", device="cpu") as f:
            while pending and read < chunk_bytes:
                key = pending.pop(0)
                t = f.get_tensor(key)
                read += t.numel() * t.element_size()
                out[key] = t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t
                del t
    return out
