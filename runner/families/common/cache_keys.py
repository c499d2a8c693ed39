"""What identifies a trainer's encode parts in the encoder cache (plugins/park/cache.py).

A cache entry may be reused only while every input of ``encode_part`` but the sample itself is
the same: the modules' dtypes and where their weights come from, the tokenizers, the data
settings the pixels depend on. :class:`CacheKeys` builds that signature for the built-in
trainers; it is a mixin of :class:`runner.families.common.base.DiffusersTrainer`, apart from it because
it only reads the trainer's sources and never builds or loads a module.
"""
from __future__ import annotations

import os
from typing import Any


def file_stats(folder: str) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime_ns) of every file under ``folder``, sorted: a cheap identity
    of local weights for cache keys (reading and hashing gigabytes of weights on every start would
    cost more than the cache saves)."""
    out = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            st = os.stat(full)
            out.append((os.path.relpath(full, folder), st.st_size, st.st_mtime_ns))
    return out


class CacheKeys:
    """Mixin of DiffusersTrainer: the cache signature of each encode part and its pieces.

    Reads the trainer's ``source``, ``cfg``, ``size`` and its module and tokenizer lookups;
    local weights are identified by their files' paths, sizes and mtimes (:func:`file_stats`).
    """

    cfg: Any
    size: str
    source: tuple[str, str] | None

    # Bump when encode_part computes something different, so that old cache entries miss.
    cache_format: int = 2  # 2: the flip is per visit, both orientations keyed apart (format 1 entries: never read)

    def module_source(self, name: str) -> dict[str, Any]:
        """Where a module's weights come from, for cache keys: its folder's files (path, size,
        mtime), or, when randomly initialised, what that init depends on (the runner seeds the
        RNG with ``train.seed`` right before ``build_models``)."""
        if self._folder_has(name):
            folder = os.path.join(self.source[1], name)
            return {"folder": folder, "files": file_stats(folder)}
        if self.file_provides(name):
            st = os.stat(self.source[1])
            return {"file": self.source[1], "size": st.st_size, "mtime_ns": st.st_mtime_ns, "module": name}
        seed = self.cfg.get("train", {}).get("seed") if hasattr(self.cfg, "get") else None
        return {
            "random_init": True,
            "seed": seed,
            "size": self.size,
            "model_path": self.source[1] if self.source else None,
            "config": self.size_configs()[name],
        }

    def tokenizer_source(self, name: str) -> dict[str, Any]:
        """What a tokenizer's output depends on, for cache keys: its class and length, and its
        folder's files (path, size, mtime) when it comes from ``model.path``, else its vocabulary
        size (a generated or reference tokenizer)."""
        tok = self.tokenizer(name)
        info: dict[str, Any] = {"class": type(tok).__name__, "model_max_length": int(tok.model_max_length)}
        if self._folder_has(name):
            folder = os.path.join(self.source[1], name)
            info["files"] = file_stats(folder)
        else:
            info["vocab_size"] = int(tok.vocab_size)
        return info

    def cache_signature(self, part: str) -> dict[str, Any]:
        """Every setting that changes ``encode_part(part)`` besides the sample itself."""
        spec = self.encode_parts()[part]
        sig: dict[str, Any] = {
            "format": self.cache_format,
            "trainer": f"{type(self).__module__}.{type(self).__qualname__}",
            "part": part,
            "modules": {
                name: {"dtype": str(self.module_dtype(name, False)).replace("torch.", ""), "source": self.module_source(name)}
                for name in spec.modules
            },
        }
        if "pixel_values" in spec.inputs:
            data = self.cfg.data
            sig["data"] = {
                "resolution": int(data.resolution),
                "center_crop": bool(data.get("center_crop", True)),
            }  # not random_flip: the orientation is per entry (plugins/park/cache.py, runner/data/flip.py)
        if "caption" in spec.inputs:
            sig["tokenizers"] = {
                m.replace("text_encoder", "tokenizer"): self.tokenizer_source(m.replace("text_encoder", "tokenizer"))
                for m in spec.modules
                if m.startswith("text_encoder")
            }
        return sig
