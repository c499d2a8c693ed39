"""A frozen base built with its parameters on ``meta`` and read from its safetensors files later,
layer by layer, by whoever replaces its layers (the quantization plugins), the rest by the runner.

Why: loading the base whole in ``model.dtype`` and quantizing after would hold the whole bf16 base on
the host (Flux: 22 GiB on every rank under ``dist=fsdp``) to keep 5.9 GiB of nf4. When a quantization plugin will quantize the trained module's base and its weights
lie in safetensors files as stored (``DiffusersTrainer.weight_files``), the module is built empty
(runner/distributed/loading.py ``load_mode`` ``quantized``) and carries an :class:`UnreadWeights` in
``ModelSet.unread``. The plugin reads each layer it replaces just before replacing it
(:meth:`UnreadWeights.read_layer`), so the host holds the quantized layers so far plus one tensor in
``model.dtype``; after the plugins' ``transform_models`` phase the runner reads whatever is still
unread (:meth:`UnreadWeights.read_rest`: norms, skipped layers, biases; everything when no plugin
took the module after all). The same read and conversion as the whole load
(``tensor.to(param.dtype)``, the dtype the empty build gave the parameter, as the sharded load of
runner/distributed/loading.py reads it), so the bytes quantized are the same and so are theirs.

The adapters are drawn over the empty base with :func:`stand_in_weights`: peft casts a new adapter to
its base layer's device and dtype, and reads nothing else of a plain LoRA's base; a base on ``meta``
would send the adapters there too. DoRA reads the base weight (its magnitude), so DoRA is loaded
whole (``load_mode``).

Random init (no file) is not streamed: drawing the base layer by layer would change the values (the
generator's order), so it is built whole and quantized after, as before.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def logical_key(key: str) -> str:
    """A state key without peft's ``.base_layer`` (``a.to_q.base_layer.weight`` -> ``a.to_q.weight``):
    the key the file holds."""
    return key.replace(".base_layer.", ".")


@dataclass
class UnreadWeights:
    """Where a module's weights lie (model key -> (file, key in it)) while its parameters are on meta.

    ``read``: how a tensor is read, ``read(file, key) -> tensor`` (the planner passes one that makes a
    fake tensor of the stored shape; the real one reads the file)."""

    files: dict[str, tuple[str, str]]
    read: Callable[[str, str], torch.Tensor] | None = None
    layers_read: int = 0  # layers read by a plugin (read_layer)
    tensors_read: int = 0

    def missing(self, module: nn.Module) -> list[str]:
        """Keys of ``module``'s meta tensors that no file holds: a layout this load cannot follow."""
        return [k for k, t in _tensors(module) if t.is_meta and logical_key(k) not in self.files]

    def read_layer(self, name: str, layer: nn.Module) -> None:
        """``layer``'s own parameters (``name``: its qualified name in the module, peft's
        ``.base_layer`` included), read and converted, in place: what a plugin calls just before it
        replaces the layer."""
        self._fill(layer, name)
        self.layers_read += 1

    def read_rest(self, module: nn.Module) -> int:
        """Every tensor of ``module`` still on meta, and its persistent buffers (built real, as
        their values from the files); the number of tensors read."""
        before = self.tensors_read
        self._fill(module, "", buffers=True)
        return self.tensors_read - before

    def _fill(self, root: nn.Module, prefix: str, buffers: bool = False) -> None:
        with torch.no_grad():
            for owner, sub in root.named_modules():
                base = ".".join(p for p in (prefix, owner) if p)
                for key, t in list(sub._parameters.items()):
                    if t is not None and t.is_meta:
                        value = self._get(f"{base}.{key}" if base else key, t.dtype)
                        sub._parameters[key] = nn.Parameter(value, requires_grad=False)
                if not buffers:
                    continue
                for key, t in list(sub._buffers.items()):
                    full = logical_key(f"{base}.{key}" if base else key)
                    if t is None or key in sub._non_persistent_buffers_set or full not in self.files:
                        continue
                    value = self._get(full, t.dtype)
                    if t.is_meta:
                        sub._buffers[key] = value
                    else:
                        t.copy_(value)

    def _get(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        file, stored = self.files[logical_key(key)]
        self.tensors_read += 1
        if self.read is not None:
            return self.read(file, stored).to(dtype)
        from safetensors import safe_open

        with safe_open(file, framework="pt", device="cpu") as f:  # closed at once: no mapped page stays resident
            t = f.get_tensor(stored)
        # A tensor already in ``dtype`` is a view of the file's mapping: copied, so the mapping is released.
        return t.clone() if t.dtype == dtype else t.to(dtype)


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


@contextlib.contextmanager
def stand_in_weights(module: nn.Module) -> Iterator[None]:
    """Inside: each meta parameter of ``module`` replaced by a CPU tensor of its shape and dtype that
    holds one element (a stride-0 view); after: back on meta, new parameters (an adapter made
    inside) left as they are. For attaching LoRA to an empty base (module docstring): peft moves a
    new adapter to its base layer's device and dtype, so the adapters come out as over a loaded
    base, bit for bit. Nothing may compute with the stand-ins: they are one value repeated."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for sub in module.modules():
        for key, p in list(sub._parameters.items()):
            if p is not None and p.is_meta:
                stand_in = torch.zeros((), dtype=p.dtype).expand(p.shape)
                sub._parameters[key] = nn.Parameter(stand_in, requires_grad=p.requires_grad)
                swapped.append((sub, key, p))
    try:
        yield
    finally:
        for sub, key, p in swapped:
            sub._parameters[key] = p


def read_unread(models: Any) -> list[str]:
    """Whatever is still unread in ``models.unread`` (the runner, after ``transform_models``); the
    modules read. Each is then whole, as if it had been loaded whole."""
    done = []
    for name, unread in list(models.unread.items()):
        unread.read_rest(models[name])
        del models.unread[name]
        done.append(name)
    return done
