"""An exponential moving average of the trained weights (``ema.enabled=true``).

What is averaged: exactly the trained parameters (``ModelSet.named_trainable_parameters``): the
denoiser in a full fine-tune, the adapters with ``model.train=lora``, for any trainer, managed
or hosted. Nothing frozen is copied.

The update, after an optimizer step that was applied (a step skipped as non-finite, or by the
fp16 grad scaler, changed no weight and is not averaged in; an OOM retry redoes only forward
and backward, so a step is averaged in once)::

    ema <- d_k * ema + (1 - d_k) * weights          (torch.lerp(ema, weights, 1 - d_k))
    d_k  = min(ema.decay, (1 + k) / (10 + k))       k = 0, 1, ...: updates done before this one
    d_k  = ema.decay                                with ema.warmup=false

The schedule: at the start of training (step 0) the copy is the weights; with ``ema.start=S >
0`` it is set to the weights again after optimizer step S (the average starts there, with its
warm-up from k=0); it is then updated after steps S + every, S + 2*every, ... (``ema.every``).
The warm-up counts updates, not optimizer steps, so it is the same for every ``ema.every``; the
average's time constant is about ``every / (1 - decay)`` optimizer steps.

Where the copy lives (``ema.device``):

* ``device``: beside each trained weight: on the accelerator for resident weights, and on the
  host for the weights a memory plugin keeps there (``offload=stream`` blocks), so an update
  never moves a weight between devices;
* ``cpu``: in host RAM, all of it (what lets a full SDXL fine-tune keep an EMA on a 24 GB card).
  Each update copies the trained weights to the host in their own dtype (no device temporary)
  and averages there on the CPU: ``ema.every`` amortises that cost.

Precision (``ema.dtype``, resolved in runner/resolved.py): float32 by default, whatever the
trained weights' dtype: with decay 0.9999 an update moves the average by 1e-4 of the difference,
below bfloat16's resolution (2^-8 relative), so a bfloat16 average of bfloat16 weights would
stop moving. ``ema.dtype=bfloat16`` (allowed only with ``model.train_dtype=bfloat16``) halves
the copy for users who accept that (with a smaller decay it is usable).

Memory: the copy (trained parameter count x 4 bytes in float32) on the device or the host, which
the planner counts (category ``ema``; ``Plan.ema``), and temporaries of at most ``CHUNK_BYTES``
while updating (weights cast to the EMA dtype, or staged on the host). Sampling with the EMA
weights (``sample.use_ema``) backs the trained weights up in host RAM for the pass.

Checkpoints: ``ema.safetensors`` beside ``trainable.safetensors`` (same names, the EMA dtype; the
update count and settings in its metadata), so a resume continues the average bit for bit.
Resume may turn EMA on (it starts from the resumed weights), off (the checkpoint keeps its copy),
or change its device, dtype, decay and schedule: none of them changes the trained weights or the
optimizer state (runner/state/resume.py).

Sharded weights (``dist=fsdp``: each trained parameter is an FSDP2 DTensor holding this rank's
dim-0 shard): the copy is kept per rank as plain tensors the shape of the local shards, so it is
sharded exactly like the weights (a 1/N share per rank) and every update is a local lerp, with no
gather. Swapping it in (:meth:`EMA.applied`) copies each rank's shard into its parameter's shard;
the FSDP units are resharded before and after (``reshard``), so that no unit still holds weights
gathered before the swap. In a checkpoint the copy is part of the sharded DCP checkpoint (key
``ema``, runner/ema/shards.py; every rank writes its own shards, nothing is gathered) beside
``ema.json`` (the names, shapes and metadata). Either format resumes into either kind of run, in
any world size: runner/ema/shards.py.

Why our own and not a library's (measured on the CPU by bench/ema_update.py, docs/benchmarks.md):
diffusers' ``EMAModel`` keeps its shadow on the parameters' device and in their dtype (its
``step`` subtracts the parameters from the shadow, so a host shadow of device weights fails), its
foreach path allocates a temporary as large as all averaged parameters, it was the slowest on
the CPU, and its state is a pickled dict; ``torch.optim.swa_utils.AveragedModel`` deep-copies the
whole module (a LoRA's frozen base included), keeps the copy in the module's dtype, and with a
host copy first moves every parameter to the host at once (a host temporary the size of the
model). Its in-place foreach lerp is what this module does too, per chunk grouped by device and
dtype (``torch._foreach_lerp_`` through runner/compat.py: one fused kernel per chunk on a GPU),
so temporaries stay within :data:`CHUNK_BYTES` while the copy can be float32 on the host for
bf16 device weights, and the checkpoint is safetensors.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, ContextManager

import torch
from torch import nn

from runner.compat import foreach_lerp_
from runner.ema.files import FILE, SHARDED_META, is_sharded_param, local
from runner.errors import UserError

log = logging.getLogger("runner")

FORMAT = 1
CHUNK_BYTES = 64 * 2**20  # EMA bytes averaged per foreach call: bounds the update's temporaries
CATEGORY = "ema"  # the live-bytes tracker's category of the copy (runner/memory/live_bytes_views.py)


class NoEMA:
    """``ema.enabled=false``: every call of the loop, the sampler and the checkpoints does nothing."""

    enabled = False
    updates = 0

    def update(self, step: int, applied: bool) -> None:
        pass

    def applied(self) -> ContextManager[None]:
        return nullcontext()

    def write_checkpoint(self, folder: Path) -> list[str]:
        return []

    def shards(self) -> dict[str, torch.Tensor]:
        return {}

    def tensors(self) -> list[torch.Tensor]:
        return []


class EMA:
    """The average of ``named_params`` (see the module docstring); ``on_host``: ``ema.device=cpu``."""

    enabled = True

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], *, decay: float, warmup: bool = True,
                 every: int = 1, start: int = 0, on_host: bool = False, dtype: torch.dtype = torch.float32,
                 host: torch.device | str = "cpu", chunk_bytes: int = CHUNK_BYTES,
                 reshard: Callable[[], None] | None = None) -> None:
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.decay, self.warmup, self.every, self.start = float(decay), bool(warmup), int(every), int(start)
        self.on_host, self.dtype, self.host = bool(on_host), dtype, torch.device(host)
        self.chunk_bytes = int(chunk_bytes)
        self.reshard = reshard or (lambda: None)  # dist=fsdp: every unit back to its shards (module docstring)
        self.updates = 0  # updates since the average started (the warm-up's k)
        self.sharded = any(is_sharded_param(p) for p in self.params)
        # the local shard's shape under dist=fsdp (each rank averages its own shard), else the parameter's
        self.shadow = [torch.empty(local(p).shape, dtype=dtype, device=self.host if self.on_host else local(p).device)
                       for p in self.params]
        self.copy_weights()

    # ---- the average -------------------------------------------------------------------------
    def decay_at(self, k: int) -> float:
        """The decay of the k-th update (k = 0, 1, ...)."""
        return min(self.decay, (1 + k) / (10 + k)) if self.warmup else self.decay

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) is an update step of the schedule."""
        return step > self.start and (step - self.start) % self.every == 0

    def update(self, step: int, applied: bool) -> None:
        """After optimizer step ``step``; ``applied``: whether that step changed the weights."""
        if step == self.start:  # the average starts here, from the weights as they are
            self.copy_weights()
            self.updates = 0
            return
        if applied and self.due(step):
            self.average(1.0 - self.decay_at(self.updates))
            self.updates += 1

    def _source(self, p: torch.Tensor, shadow: torch.Tensor) -> torch.Tensor:
        """``p`` where and as ``shadow`` is: moved in its own dtype first (a device-side cast to
        float32 would allocate a float32 temporary on the device), then cast."""
        t = local(p).detach()
        if t.device != shadow.device:
            t = t.to(shadow.device)
        return t if t.dtype == shadow.dtype else t.to(shadow.dtype)

    def _chunks(self) -> Iterator[list[int]]:
        """Indices of up to ``chunk_bytes`` of shadows of one device and dtype (a foreach call each)."""
        chunk: list[int] = []
        size, key = 0, None
        for i, s in enumerate(self.shadow):
            k = (s.device, s.dtype)
            n = s.numel() * s.element_size()
            if chunk and (k != key or size + n > self.chunk_bytes):
                yield chunk
                chunk, size = [], 0
            chunk.append(i)
            size, key = size + n, k
        if chunk:
            yield chunk

    @torch.no_grad()
    def average(self, weight: float) -> None:
        """``ema <- lerp(ema, weights, weight)`` for every trained parameter, chunk by chunk."""
        for idx in self._chunks():
            shadows = [self.shadow[i] for i in idx]
            sources = [self._source(self.params[i], self.shadow[i]) for i in idx]
            foreach_lerp_(shadows, sources, weight)
            del sources

    @torch.no_grad()
    def copy_weights(self) -> None:
        """The copy := the trained weights (the start of the average)."""
        for idx in self._chunks():
            for i in idx:
                self.shadow[i].copy_(self._source(self.params[i], self.shadow[i]))

    def tensors(self) -> list[torch.Tensor]:
        return list(self.shadow)

    def nbytes(self) -> dict[str, int]:
        """Bytes of the copy per device type (``cpu``, ``cuda``, ``meta`` in the planner)."""
        out: dict[str, int] = {}
        for s in self.shadow:
            out[s.device.type] = out.get(s.device.type, 0) + s.numel() * s.element_size()
        return out

    # ---- using the average -------------------------------------------------------------------
    @contextmanager
    def applied(self) -> Iterator[None]:
        """The trained parameters hold the EMA weights inside the block, and exactly their own
        values again after it (backed up on the host in their own dtype: host RAM of the
        trained weights' size while the block runs; under dist=fsdp this rank's shards only)."""
        self.reshard()  # no FSDP unit keeps weights gathered before the swap
        with torch.no_grad():
            backup = [local(p).detach().to(self.host, copy=True) for p in self.params]
            for p, s in zip(self.params, self.shadow):
                local(p).copy_(s)
        try:
            yield
        finally:
            self.reshard()  # ... nor the EMA weights gathered inside the block
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    local(p).copy_(b)

    # ---- checkpoints -------------------------------------------------------------------------
    def metadata(self) -> dict[str, str]:
        return {"format": str(FORMAT), "updates": str(self.updates), "dtype": str(self.dtype).replace("torch.", ""),
                "decay": repr(self.decay), "warmup": str(self.warmup), "every": str(self.every),
                "start": str(self.start)}

    def write_checkpoint(self, folder: Path) -> list[str]:
        """``folder/ema.safetensors`` (names of the trained parameters); the files written. Sharded
        (dist=fsdp, rank 0): ``ema.json`` only; every rank's shards go with the DCP checkpoint (:meth:`shards`)."""
        from safetensors.torch import save_file

        if self.sharded:
            from runner.ema.shards import write_sharded_meta

            return write_sharded_meta(self, folder / SHARDED_META)
        tensors = {n: s.detach().to("cpu").contiguous() for n, s in zip(self.names, self.shadow)}
        save_file(tensors, str(folder / FILE), metadata=self.metadata())
        return [FILE]

    def shards(self) -> dict[str, torch.Tensor]:
        """Sharded (dist=fsdp): the copy as DTensors placed like the parameters (views, no copy), by
        parameter name, for the DCP checkpoint; else nothing (the copy goes in ``ema.safetensors``)."""
        if not self.sharded:
            return {}
        from runner.ema.shards import placed_like

        return {n: placed_like(s, p) for n, s, p in zip(self.names, self.shadow, self.params)}

    @torch.no_grad()
    def load_checkpoint(self, ckpt: Path) -> bool:
        """Continue the average saved in ``ckpt`` (False, and the copy stays the weights, when it has none).
        Either format (``ema.safetensors`` or a sharded checkpoint's), into whole or sharded parameters."""
        from runner.ema.shards import read_saved_ema

        found = read_saved_ema(ckpt)
        if found is None:
            return False
        path, shapes, meta, tensors = found
        mine = {n: tuple(p.shape) for n, p in zip(self.names, self.params)}  # global shapes
        missing, unexpected = sorted(set(mine) - set(shapes)), sorted(set(shapes) - set(mine))
        wrong = [n for n in mine.keys() & shapes.keys() if shapes[n] != mine[n]]
        if missing or unexpected or wrong:
            raise UserError(
                f"Checkpoint file {path} does not match this run's trained parameters ({len(missing)} missing, e.g. "
                f"{missing[:2]}; {len(unexpected)} unexpected, e.g. {unexpected[:2]}; {len(wrong)} of another shape). "
                "Resume with the settings it was saved with, or set ema.enabled=false to resume without it.")
        from runner.ema.shards import load_into

        load_into(self, ckpt, meta, tensors)
        self.updates = int(meta.get("updates", 0))
        saved = meta.get("dtype")
        if saved and saved != str(self.dtype).replace("torch.", ""):
            log.warning("ema: the checkpoint's average is %s, this run keeps it in %s (ema.dtype)", saved,
                        str(self.dtype).replace("torch.", ""))
        return True


def has_ema(ckpt: Path) -> bool:
    """Whether checkpoint ``ckpt`` holds an EMA of the weights (either format)."""
    return (ckpt / FILE).is_file() or (ckpt / SHARDED_META).is_file()


def ema_info(ckpt: Path) -> dict[str, Any]:
    """The saved settings and update count of ``ckpt``'s EMA (for export.json), without its tensors."""
    from safetensors import safe_open

    if (ckpt / SHARDED_META).is_file():
        meta = json.loads((ckpt / SHARDED_META).read_text())["metadata"]
    else:
        with safe_open(str(ckpt / FILE), framework="pt", device="cpu") as f:
            meta = dict(f.metadata() or {})
    numbers = ("format", "updates", "every", "start", "decay")
    return {k: json.loads(v) if k in numbers else (v == "True") if k == "warmup" else v for k, v in meta.items()}


def build_ema(ctx: Any, checkpoint: Path | None = None) -> EMA | NoEMA:
    """The run's EMA (``ctx.cfg.ema``) over ``ctx.models``' trained parameters as the plugins placed
    them; with ``checkpoint`` (a resume), the average saved there is continued."""
    c = ctx.cfg.get("ema") if ctx.cfg is not None else None
    saved = checkpoint is not None and has_ema(checkpoint)
    if c is None or not c.enabled:
        if saved:
            log.info("ema: %s holds an EMA of the weights; this run does not continue it (ema.enabled=false); the "
                     "checkpoint keeps it", checkpoint)
        return NoEMA()
    run = ctx.run
    ema = EMA(list(ctx.models.named_trainable_parameters()), decay=float(c.decay), warmup=bool(c.warmup),
              every=int(c.every), start=int(c.start), on_host=str(c.device) == "cpu",
              dtype=run.ema_dtype or torch.float32, host=ctx.host, reshard=ctx.dist.reshard)
    if checkpoint is not None:
        if ema.load_checkpoint(checkpoint):
            log.info("ema: continuing the average of %s (%d updates so far)", checkpoint, ema.updates)
        else:
            log.info("ema: %s has no EMA of the weights; the average starts from the resumed weights", checkpoint)
    where = ", ".join(f"{n / 2**20:.1f} MiB on {d}" for d, n in ema.nbytes().items())
    log.info("ema: average of %d trained tensors in %s (%s), decay %g%s, every %d step(s)%s", len(ema.shadow),
             str(ema.dtype).replace("torch.", ""), where or "nothing", ema.decay,
             " with warm-up" if ema.warmup else "", ema.every, f", from step {ema.start}" if ema.start else "")
    for dev, n in ema.nbytes().items():
        ctx.notes[f"ema bytes on {dev}"] = n
    return ema
