"""What ``mode=fit`` may change, and how each candidate is written as command-line overrides.

A candidate is a :class:`Knobs`: one value per memory setting. The base knobs are read from the
user's composed config; a candidate differs from them only in settings the search may touch:

=====================  ==========================================  ========================
knob                   values                                       keeps the result?
=====================  ==========================================  ========================
checkpoint             none, every 2nd block, every block            yes
micro-batch            the divisors of train.batch_size              yes (gradient accumulation
                       (train.grad_accum keeps the effective batch)  sums the same gradients)
park                   cache latents/embeddings, drop the encoders   yes (cached runs give the
                                                                     same losses)
stream                 the trained module's blocks from host RAM,    yes (bit for bit on CPU)
                       at 75 / 50 / 25 % of its weights on device
activation offload     saved activations to host RAM                 yes
optimizer offload      optimizer state and step on the host          yes
fused backward         optimizer step inside backward                yes without clipping;
                                                                     with train.max_grad_norm>0
                                                                     it clips per parameter
8-bit optimizer        adamw -> adamw8bit                            no: fit.allow=[8bit]
quantization           the frozen base in nf4 / fp8 (LoRA only)     no: fit.allow=[quantize]
LoRA                   model.train=full -> lora                      no: fit.allow=[lora]
bf16 trained weights   model.train_dtype=bfloat16                    no: fit.allow=[bf16_weights]
=====================  ==========================================  ========================

Settings the user chose that change the math (an 8-bit optimizer, a quantized base, LoRA) are
kept: the search never removes them. Plugins the search does not know (a user's, tiling,
allocator) stay as the user configured them. On a CPU target the device is the host, so the
offload knobs (which only move bytes between the two) are not searched.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from runner import registry

STREAM_FRACTIONS = (0.75, 0.5, 0.25)  # of the trained module's weight bytes kept on the device
QUANTIZE = ("nf4", "fp8")
OPTIMIZER_KEYS = ("lr", "weight_decay", "betas", "eps")  # carried over when the optimizer changes


@dataclass(frozen=True)
class Knobs:
    """One configuration of the memory settings the search controls."""

    checkpoint: str  # none | every_n | full
    every_n: int
    micro: int  # micro-batch size (train.grad_accum = batch / micro)
    park: bool
    stream_gb: Optional[float]  # offload.stream.device_budget_gb; None: no streaming; -1: the base's own stream settings
    activations: bool
    optimizer_offload: bool
    fused: bool
    optimizer: str
    quantization: Optional[str]
    train: str  # full | lora
    train_dtype: str

    def changes(self, base: Knobs) -> list[str]:
        """What differs from ``base``, in words (for the table)."""
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(base, f.name), getattr(self, f.name)
            if a != b and not (f.name == "every_n" and self.checkpoint != "every_n"):
                out.append(f"{f.name}: {_show(f.name, a)} -> {_show(f.name, b)}")
        return out

    def describe(self, batch: int) -> str:
        parts = [{"none": "no checkpointing", "full": "checkpoint every block"}.get(
            self.checkpoint, f"checkpoint every {self.every_n}. block")]
        parts.append(f"micro-batch {self.micro} x {batch // self.micro}" if self.micro < batch else f"batch {batch}")
        offload = [n for n, on in (("park", self.park), ("activations", self.activations),
                                   ("optimizer", self.optimizer_offload)) if on]
        if self.stream_gb is not None:
            offload.insert(1, "stream" + (f" {self.stream_gb:g} GiB" if self.stream_gb > 0 else ""))
        if offload:
            parts.append("offload " + "+".join(offload))
        if self.fused:
            parts.append("fused backward")
        parts.append(self.optimizer)
        if self.quantization:
            parts.append(self.quantization)
        parts.append(self.train + (" bf16" if self.train_dtype == "bfloat16" else ""))
        return ", ".join(parts)


def _show(name: str, v: Any) -> str:
    if name == "stream_gb":
        return "off" if v is None else "as configured" if v < 0 else f"{v:g} GiB"
    return str(v)


def offload_knobs() -> dict[str, str]:
    """The offload plugins the search switches on and off, by the knob each declares (``Plugin.fit_knob``),
    in the order of :class:`Knobs`' fields: ``{"park": "park", "stream_gb": "stream", ...}``."""
    out = {}
    for (kind, name), entry in registry.plugin_entries().items():
        knob = entry.load().fit_knob if kind == "offload" else ""
        if knob:
            out[knob] = name
    order = [f.name for f in dataclasses.fields(Knobs)]
    return {knob: out[knob] for knob in sorted(out, key=order.index)}


def _selected(cfg: Any) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for kind, name, _ in registry.selected(cfg):
        out.setdefault(kind, []).append(name)
    return out


def base_knobs(cfg: Any) -> Knobs:
    """The knobs of the user's own config."""
    chosen = _selected(cfg)
    ckpt = "none"
    every_n = 2
    if "blocks" in chosen.get("checkpoint", []):
        node = cfg.checkpoint.blocks
        ckpt = "full" if str(node.mode) == "full" or int(node.every_n) == 1 else "every_n"
        every_n = int(node.every_n)
    offload = chosen.get("offload", [])
    plugins = offload_knobs()
    on = {knob: plugins[knob] in offload if knob in plugins else False for knob in ("park", "stream_gb", "activations",
                                                                                   "optimizer_offload")}
    stream = None
    if on["stream_gb"]:
        budget = cfg.offload[plugins["stream_gb"]].get("device_budget_gb")
        stream = float(budget) if budget is not None else -1.0
    quant = chosen.get("quantization", [])
    return Knobs(
        checkpoint=ckpt, every_n=every_n, micro=int(cfg.train.batch_size) // int(cfg.train.grad_accum),
        park=on["park"], stream_gb=stream, activations=on["activations"],
        optimizer_offload=on["optimizer_offload"], fused=bool(cfg.optimizer.get("fused_backward", False)),
        optimizer=str(cfg.optimizer.name), quantization=quant[0] if quant else None,
        train=str(cfg.model.train), train_dtype=str(cfg.model.get("train_dtype", "float32")),
    )


@dataclass(frozen=True)
class Space:
    """Which values each knob may take for this run (see the module docstring)."""

    base: Knobs
    batch: int
    allow: frozenset[str]
    on_cuda: bool
    max_grad_norm: float
    precision: str
    trained_gib: float  # the trained modules' weights, for the stream budgets
    streamable: bool  # the trained module has repeated blocks that are not bitsandbytes-quantized
    cacheable: bool  # the trainer has an encode step park can cache
    ranks: int = 1  # dist's world size: the search is per rank, each rank takes micro / ranks samples
    dist: str = "none"

    def values(self) -> dict[str, list[Any]]:
        b, allow = self.base, self.allow
        v: dict[str, list[Any]] = {
            "checkpoint": _uniq(["none", "every_n", "full", b.checkpoint]),
            "micro": sorted({m for m in range(1, self.batch + 1) if self.batch % m == 0 and m % self.ranks == 0}
                            | {b.micro}),
            "park": _uniq([b.park, True] if (self.cacheable and not b.park) else [b.park]),
            "stream_gb": [b.stream_gb],
            "activations": [b.activations],
            "optimizer_offload": [b.optimizer_offload],
            "fused": _uniq([b.fused, False, True] if self.precision != "fp16" and not _couples(b.optimizer) else [b.fused]),
            "optimizer": [b.optimizer],
            "quantization": [b.quantization],
            "train": [b.train],
            "train_dtype": [b.train_dtype],
        }
        if self.on_cuda and self.dist == "none":  # host offloads: refused under dist (runner/distributed/config.py)
            if self.streamable:
                budgets = [round(self.trained_gib * f * 2) / 2 for f in STREAM_FRACTIONS]
                v["stream_gb"] = _uniq([b.stream_gb, None, *[g for g in budgets if g > 0]])
            v["activations"] = [False, True]
            v["optimizer_offload"] = [False, True]
        if "8bit" in allow and b.optimizer == "adamw":
            v["optimizer"].append("adamw8bit")
        if "lora" in allow and b.train == "full":
            v["train"].append("lora")
        if "quantize" in allow and b.quantization is None:
            v["quantization"] += list(QUANTIZE)
        if "bf16_weights" in allow and b.train_dtype == "float32":
            v["train_dtype"].append("bfloat16")
        return v

    def valid(self, k: Knobs) -> bool:
        """Whether ``k`` is a configuration the runner accepts and the search may choose."""
        if k.fused and (k.micro != self.batch or k.optimizer_offload or (k.stream_gb is not None and k.train == "full")):
            return False  # runner/optim/fused.py refuses these
        if k.fused and not self.base.fused and self.max_grad_norm > 0 and "per_param_clipping" not in self.allow:
            return False  # fused backward would clip per parameter: a different result
        if k.quantization is not None and k.train != "lora":
            return False  # never quantize trained weights
        if k.quantization in ("nf4", "int8") and k.stream_gb is not None:
            return False  # bitsandbytes layers stay resident: streaming them moves nothing
        if k.train == "lora" and k.train_dtype != self.base.train_dtype:
            return False
        if k.checkpoint == "every_n" and k.every_n < 2:
            return False
        return True

    def candidates(self) -> Iterator[Knobs]:
        values = self.values()
        names = list(values)
        for combo in itertools.product(*(values[n] for n in names)):
            k = Knobs(every_n=self.base.every_n if self.base.checkpoint == "every_n" else 2,
                      **dict(zip(names, combo)))
            if self.valid(k):
                yield k


def _uniq(xs: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for x in xs:
        if x not in out:
            out.append(x)
    return out


# ---- overrides --------------------------------------------------------------------------------
def _kind_of(override: str) -> str:
    key = override.split("=", 1)[0].lstrip("+~")
    return key.split(".", 1)[0]


def _couples(optimizer: str) -> bool:
    """Whether the optimizer's update couples the parameters (prodigy, adamw_schedulefree): fused backward,
    which steps one parameter at a time, is refused for it (runner/optim/fused.py)."""
    from runner.optim.build import OPTIMIZERS

    spec = OPTIMIZERS.get(optimizer)
    return spec is not None and spec.couples_parameters is not None


def overrides_for(k: Knobs, base: Knobs, cfg: Any, user: Sequence[str]) -> list[str]:
    """The user's command line, changed so that it composes ``k`` (the winner's command line).

    For each setting that differs, the user's overrides of it are removed and the candidate's
    added: a kind's whole plugin list (``offload=[park,stream]``), a plugin's settings, the
    optimizer group with the user's rate and decay carried over.
    """
    chosen = _selected(cfg)
    out = [o for o in user]
    extra: list[str] = []

    def drop(pred: Any) -> None:
        nonlocal out
        out = [o for o in out if not pred(o)]

    if k.checkpoint != base.checkpoint or (k.checkpoint == "every_n" and k.every_n != base.every_n):
        others = [n for n in chosen.get("checkpoint", []) if n != "blocks"]
        names = others + ([] if k.checkpoint == "none" else ["blocks"])
        drop(lambda o: _kind_of(o) == "checkpoint" and (o.split("=", 1)[0].lstrip("+~") == "checkpoint"
                                                         or (k.checkpoint == "none" and ".blocks." in o)))
        extra.append(_kind_list("checkpoint", names))
        if k.checkpoint == "full":
            extra.append("checkpoint.blocks.mode=full")
        elif k.checkpoint == "every_n":
            extra += ["checkpoint.blocks.mode=every_n", f"checkpoint.blocks.every_n={k.every_n}"]
    plugins = offload_knobs()  # knob -> the offload plugin that declares it
    wanted = {name: _knob_on(k, knob) for knob, name in plugins.items()}
    had = {name: (name in chosen.get("offload", [])) for name in plugins.values()}
    if wanted != had or (k.stream_gb not in (None, -1.0) and k.stream_gb != base.stream_gb):
        others = [n for n in chosen.get("offload", []) if n not in wanted]
        names = [n for n in wanted if wanted[n]] + others
        removed = [n for n in wanted if had[n] and not wanted[n]]
        drop(lambda o: o.split("=", 1)[0].lstrip("+~") == "offload"
             or any(o.split("=", 1)[0].startswith(f"offload.{n}.") for n in removed))
        extra.append(_kind_list("offload", names))
        if k.stream_gb is not None and k.stream_gb >= 0:
            node = f"offload.{plugins['stream_gb']}"
            drop(lambda o: o.split("=", 1)[0] in (f"{node}.device_budget_gb", f"{node}.device_fraction"))
            extra.append(f"{node}.device_budget_gb={k.stream_gb:g}")
    if k.micro != base.micro:
        drop(lambda o: o.split("=", 1)[0] == "train.grad_accum")
        extra.append(f"train.grad_accum={int(cfg.train.batch_size) // k.micro}")
    if k.optimizer != base.optimizer:
        drop(lambda o: o.split("=", 1)[0].lstrip("+~") == "optimizer")
        extra.append(f"optimizer={k.optimizer}")
        for key in OPTIMIZER_KEYS:
            if key in cfg.optimizer and not any(o.split("=", 1)[0] == f"optimizer.{key}" for o in out):
                value = cfg.optimizer[key]
                extra.append(f"optimizer.{key}={_value(value)}")
    if k.fused != base.fused or (k.optimizer != base.optimizer and k.fused):
        drop(lambda o: o.split("=", 1)[0] == "optimizer.fused_backward")
        extra.append(f"optimizer.fused_backward={'true' if k.fused else 'false'}")
    if k.quantization != base.quantization:
        drop(lambda o: o.split("=", 1)[0].lstrip("+~") == "quantization")
        extra.append(f"quantization={k.quantization or 'none'}")
    if k.train != base.train:
        drop(lambda o: o.split("=", 1)[0] == "model.train")
        extra.append(f"model.train={k.train}")
    if k.train_dtype != base.train_dtype:
        drop(lambda o: o.split("=", 1)[0] == "model.train_dtype")
        extra.append(f"model.train_dtype={k.train_dtype}")
    return out + extra


def _knob_on(k: Knobs, knob: str) -> bool:
    """Whether candidate ``k`` switches on the plugin of ``knob`` (a bool knob, or a budget that is set)."""
    value = getattr(k, knob)
    return value if isinstance(value, bool) else value is not None


def _kind_list(kind: str, names: list[str]) -> str:
    if not names:
        return f"{kind}=none"
    return f"{kind}={names[0]}" if len(names) == 1 else f"{kind}=[{','.join(names)}]"


def _value(v: Any) -> str:
    if hasattr(v, "__iter__") and not isinstance(v, str):
        return "[" + ",".join(str(x) for x in v) + "]"
    return str(v)
