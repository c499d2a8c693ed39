"""What the quantization plugins share: which modules and Linear layers they touch, and how.

Registers no plugin (``plugins/quantization/bnb.py`` registers ``nf4`` and ``int8``, ``plugins/quantization/fp8.py``
registers ``fp8``). The three differ only in what one ``nn.Linear`` becomes; everything else
(choosing modules and layers, leaving LoRA adapters alone, the conflicts checked at validation,
the run-log line) is here so that the three behave the same way.

Which layers
------------
Only plain ``nn.Linear`` layers are quantized: bitsandbytes has no 4/8-bit convolution, and
keeping fp8 to the same set means the three options differ in precision, not in coverage. Norm
layers, convolutions and embeddings are therefore never touched, and a skip pattern naming one
of them has no effect. On top of that, layers whose *logical* name (the name with peft's
``.base_layer`` removed, so ``...attn1.to_q`` whether or not it carries a LoRA) matches a
``skip`` regular expression (``re.search``) stay as they are. The defaults
(:data:`DEFAULT_SKIP`) keep the small, precision-sensitive layers at the edges of a denoiser in
their original dtype, as the diffusers/kohya/SimpleTuner recipes do:

* the timestep and pooled-text conditioning MLPs (U-Net ``time_embedding``/``add_embedding``,
  Flux ``time_text_embed``), whose output modulates every block;
* a DiT's input and output projections (Flux ``x_embedder``, ``context_embedder``,
  ``proj_out``, ``norm_out``) and a top-level ``proj_in``;
* CLIP's ``text_projection`` (SDXL's pooled embedding).

They hold well under 1% of the parameters of SDXL and Flux. A module's own
``_keep_in_fp32_modules_strict`` (and ``_keep_in_fp32_modules`` when computing in float16) is
honoured as well, the rule transformers applies when it quantizes (T5's ``wo`` overflows in
float16).

Which modules
-------------
``modules: []`` (the default) means every module that holds frozen base weights: each frozen
module except the VAE (convolutions, which would not be quantized anyway, and the module most
sensitive to precision; cache its latents instead) and each trained module that carries a LoRA
adapter (its base layers; the adapter stays in ``model.train_dtype``). A fully fine-tuned module is
left out of the automatic list; naming it explicitly is a configuration error, because
quantized weights cannot be trained.

LoRA, and why quantization comes after it
-----------------------------------------
The trainer attaches LoRA inside ``build_models``, before any plugin phase, so this plugin runs
on a model that already has peft ``lora.Linear`` wrappers. It replaces the ``base_layer`` inside
each wrapper (and every other selected ``nn.Linear``) and never the adapter's own
``lora_A``/``lora_B``. peft's generic ``lora.Linear.forward`` is ``base_layer(x) +
lora_B(lora_A(x)) * scaling``, which works over any base layer, so training is unchanged. The
trade-off: peft's ``merge()`` reads the base weight as a dense matrix and is not available
over a quantized base (peft's bitsandbytes-specific LoRA classes, used when LoRA is injected
*after* quantization, would dequantize for it). The runner never merges during training, and
its checkpoints hold the adapter weights only. Quantizing before LoRA would need the trainer to
build in two halves around a plugin phase, for a merge nobody calls.

Replacement is in place and cannot be undone (as diffusers' layerwise casting refuses to be
undone): the original weights are freed, which is the point.

A base still in its files
-------------------------
When the run built a module with its weights still in their safetensors files (``ModelSet.unread``:
a LoRA base from a file, runner/meta_weights.py), :meth:`LinearQuantization.transform_models`
passes its reader to the twin functions, and :func:`replace_layers` reads each selected layer just
before replacing it: the host holds the layers quantized so far and one tensor in ``model.dtype``,
never the whole base. The plugin knows nothing of where the weights are or of the distribution: it
gets a callable from the run's models. The bytes are the same as quantizing a whole-loaded base
(the same tensor reaches the same code).
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager

import torch
from torch import nn

from runner.compat import is_fake
from runner.errors import UserError, valid_list
from runner.float32_rules import keep_unquantized
from runner.plugin import Plugin
from runner.plugins.schemas import (  # noqa: F401
    DEFAULT_SKIP,
    QuantTargetsConfig,
    check_quantization,
    compile_patterns,
)

if TYPE_CHECKING:
    from runner.context import RunContext
    from runner.trainer import ModelSet

log = logging.getLogger("runner")

COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


# ---- choosing layers ---------------------------------------------------------------------------
@dataclass
class LinearTarget:
    """One ``nn.Linear`` chosen for replacement: ``parent.<attr>`` is the layer."""

    name: str  # qualified name inside the root module (with peft's ``.base_layer``)
    parent: nn.Module
    attr: str
    layer: nn.Linear


@dataclass
class Selection:
    targets: list[LinearTarget] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # logical names kept by a skip pattern / keep-fp32 rule
    trainable: list[str] = field(default_factory=list)  # Linear layers whose weight is trained: not quantizable


def logical_name(name: str) -> str:
    """``a.to_q.base_layer`` -> ``a.to_q``: the name a layer has with or without a LoRA wrapper."""
    return name.replace(".base_layer", "")


def keep_patterns(module: nn.Module, compute_dtype: torch.dtype) -> list[str]:
    """Names the model itself keeps in float32 (transformers' and diffusers' rules,
    :func:`runner.float32_rules.keep_unquantized`: Wan's time embedder stays unquantized)."""
    return sorted(keep_unquantized(module, compute_dtype))


def _adapter_module_ids(root: nn.Module) -> set[int]:
    """ids of every module inside a peft adapter (``lora_A``, ``lora_B``, ...), base layers excluded."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return set()
    ids: set[int] = set()
    for m in root.modules():
        if isinstance(m, BaseTunerLayer):
            for child_name, child in m.named_children():
                if child_name != "base_layer":
                    ids.update(id(x) for x in child.modules())
    return ids


def select_linear_layers(root: nn.Module, skip: Sequence[str] = DEFAULT_SKIP, keep: Sequence[str] = ()) -> Selection:
    """The ``nn.Linear`` layers of ``root`` to quantize, the ones skipped, and trained ones.

    Exactly ``nn.Linear``: subclasses (a bitsandbytes layer, already quantized) and peft's
    wrappers are not candidates; the wrapper's ``base_layer`` is. Adapter layers never are.
    """
    patterns = compile_patterns(skip)
    adapters = _adapter_module_ids(root)
    sel = Selection()
    for parent_name, parent in root.named_modules():
        if id(parent) in adapters:
            continue
        for attr, layer in parent.named_children():
            if type(layer) is not nn.Linear or id(layer) in adapters:
                continue
            name = f"{parent_name}.{attr}" if parent_name else attr
            logical = logical_name(name)
            if any(p.search(logical) for p in patterns) or any(f".{k}." in f".{logical}." for k in keep):
                sel.skipped.append(logical)
            elif any(p.requires_grad for p in layer.parameters()):  # a trained bias counts too
                sel.trainable.append(logical)
            else:
                sel.targets.append(LinearTarget(name, parent, attr, layer))
    return sel


# ---- bytes ------------------------------------------------------------------------------------
def _quant_state_tensors(qs: Any) -> list[torch.Tensor]:
    out = [getattr(qs, k, None) for k in ("absmax", "code", "offset")]
    state2 = getattr(qs, "state2", None)
    if state2 is not None:
        out += [getattr(state2, "absmax", None), getattr(state2, "code", None)]
    return [t for t in out if isinstance(t, torch.Tensor)]


def weight_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every tensor holding ``module``'s weights, including bitsandbytes' quantization state.

    bitsandbytes keeps a 4-bit layer's ``absmax``/``code`` (and the nested statistics of double
    quantization) on a ``QuantState`` object and an 8-bit layer's row scales ``SCB`` on the
    parameter or on ``layer.state``, not as module buffers; ``module.parameters()`` alone would
    miss them. Pass the result to ``LiveBytesTracker.track`` (it counts each storage once).
    """
    out: list[torch.Tensor] = []
    for m in module.modules():
        out += [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        w = getattr(m, "weight", None)
        qs = getattr(w, "quant_state", None)
        if qs is not None:
            out += _quant_state_tensors(qs)
        for holder in (w, getattr(m, "state", None)):
            for k in ("CB", "SCB"):
                t = getattr(holder, k, None) if holder is not None else None
                if isinstance(t, torch.Tensor):
                    out.append(t)
    return out


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (works for meta and fake tensors too)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if s._cdata in seen:
            continue
        seen.add(s._cdata)
        total += int(s.nbytes())
    return total


# ---- simulation helpers --------------------------------------------------------------------------
def simulated(t: torch.Tensor) -> bool:
    """True for tensors without real data: the planner's meta and fake tensors."""
    return t.is_meta or is_fake(t)


def alloc_mode(like: torch.Tensor) -> ContextManager[Any]:
    """The fake mode ``like`` belongs to (so factory calls make fake tensors), or a no-op."""
    mode = getattr(like, "fake_mode", None)
    return mode if mode is not None else nullcontext()


def empty_like_device(like: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor on ``like``'s device, fake if ``like`` is fake: never real memory."""
    if not simulated(like):
        raise RuntimeError(
            "A simulated quantized layer only handles meta or fake tensors (the planner's); it got a real "
            f"tensor on {like.device}. Quantize real models with simulate=False."
        )
    with alloc_mode(like):
        return torch.empty(tuple(shape), dtype=dtype, device=like.device)


# ---- results --------------------------------------------------------------------------------
@dataclass
class QuantizationResult:
    """What one call of a quantization twin did to one module."""

    layers: list[str] = field(default_factory=list)  # qualified names of the replaced layers
    skipped: list[str] = field(default_factory=list)
    weight_bytes_before: int = 0  # the replaced layers' weights (biases are kept as they are)
    weight_bytes_after: int = 0  # ... and what holds them now (packed data, scales, statistics)

    def describe(self) -> str:
        mib = 2**20
        return (
            f"{len(self.layers)} Linear layers, weights {self.weight_bytes_before / mib:.2f} MiB -> "
            f"{self.weight_bytes_after / mib:.2f} MiB ({len(self.skipped)} kept by skip patterns)"
        )


def replace_layers(
    root: nn.Module,
    sel: Selection,
    make: Callable[[LinearTarget], nn.Module],
    result: QuantizationResult | None = None,
    read: Callable[[str, nn.Module], None] | None = None,
) -> QuantizationResult:
    """Replace each selected layer by ``make(target)``, one at a time, recording bytes.

    One at a time, and each original layer is released as soon as it is replaced (the targets
    are consumed from ``sel``), so the peak is the model plus one layer's temporaries, never the
    original and the quantized model side by side. ``read(name, layer)``: for a module built with
    its weights still in their files (``ModelSet.unread``, runner/meta_weights.py), reads the
    layer's weights just before it is replaced, so the host never holds more than one of them
    unquantized; the layer is then what a whole load would have given.
    """
    result = result or QuantizationResult()
    result.skipped = list(sel.skipped)
    targets, sel.targets = sel.targets, []
    targets.reverse()
    while targets:
        t = targets.pop()
        if read is not None:
            read(t.name, t.layer)
        result.weight_bytes_before += storage_bytes([t.layer.weight])
        new = make(t)
        new.train(t.layer.training)
        setattr(t.parent, t.attr, new)
        result.layers.append(t.name)
        bias = getattr(new, "bias", None)
        result.weight_bytes_after += storage_bytes(x for x in weight_tensors(new) if x is not bias)
        del t, new, bias  # the last references to the original layer
    return result


# ---- the shared plugin ------------------------------------------------------------------------
def resolve_compute_dtype(value: str | None, run: Any, key: str) -> torch.dtype:
    """``None`` follows the run's frozen-weight dtype (``model.dtype``, as resolved)."""
    if value is None:
        return run.frozen_dtype
    try:
        return COMPUTE_DTYPES[str(value)]
    except KeyError:
        raise UserError(f"{key}={value!r} is not valid. Valid values: {valid_list(str(value), COMPUTE_DTYPES)}.") from None


def plain_config(node: Any) -> dict[str, Any]:
    """A plugin's config node as a JSON-able dict (for cache signatures)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    return dict(vars(node)) if hasattr(node, "__dict__") else {}


class LinearQuantization(Plugin):
    """Base of the quantization plugins: choose modules and layers, then ``quantize`` each module."""

    kind = "quantization"
    conflicts = {("quantize", "quantize"): "a module's Linear layers can be replaced by one quantization only"}
    # Claims after offload: park claims the encoders it will drop, and the default targets skip them.
    after = ("offload",)

    # -- what a subclass provides --------------------------------------------------------------
    def compute_dtype(self) -> torch.dtype:
        """The dtype the layers compute in (decides the keep-in-fp32 rule)."""
        return resolve_compute_dtype(getattr(self.config, "compute_dtype", None), self.run, self.setting("compute_dtype"))

    def quantize(self, module: nn.Module, skip: Sequence[str], keep: Sequence[str], ctx: RunContext,
                 read: Callable[[str, nn.Module], None] | None = None) -> QuantizationResult:
        """Quantize ``module``'s selected layers; ``read``: see :func:`replace_layers`."""
        raise NotImplementedError

    # -- validation ----------------------------------------------------------------------------
    def validate(self) -> None:
        resolved = self.compute_dtype()  # raises on an invalid name
        precision = self.run.precision
        half = {torch.float16, torch.bfloat16}
        if hasattr(self.config, "compute_dtype") and precision in PRECISION_DTYPES and resolved in half:
            want = PRECISION_DTYPES[precision]
            if resolved != COMPUTE_DTYPES[want]:
                explicit = self.config.compute_dtype
                have = str(resolved).replace("torch.", "")
                source = (f"{self.setting('compute_dtype')}={explicit}" if explicit is not None else
                          f"model.dtype={have} ({self.setting('compute_dtype')} follows it when unset)")
                raise UserError(
                    f"{source} conflicts with train.mixed_precision={precision}: the quantized layers would compute "
                    f"in {have} inside {precision} autocast, casting every activation in and out and, for float16, "
                    f"risking overflow. Set {self.setting('compute_dtype')}={want} (float32 is also accepted)."
                )

    def encoder_signature(self, modules: frozenset[str] | None = None) -> dict[str, Any] | None:
        """Its settings, for parts computed by a module it quantized (those compute other values)."""
        quantized = set(getattr(self, "results", {}) or {})
        if modules is not None and not (quantized & modules):
            return None
        return plain_config(self.config)

    # -- the phases -----------------------------------------------------------------------------
    def target_modules(self, models: ModelSet, dropped: set[str] = frozenset()) -> list[str]:
        """``modules`` when set; otherwise every module with frozen base weights (a frozen module or
        a LoRA's base) but the VAE and the modules another plugin drops (cached encoders)."""
        requested = [str(m) for m in self.config.modules]
        if requested:
            return self.known_modules(models, requested)
        names = []
        for name, module in models.items():
            if is_vae(name, module) or name in dropped:
                continue
            if name in models.trained and not _adapter_module_ids(module):
                log.info("quantization: %s is fully trained; left unquantized (use model.train=lora to quantize its base)", name)
                continue
            names.append(name)
        if not names:
            log.info("quantization=%s: nothing to do: no module has frozen base weights to quantize", self.name)
        return names

    def claim_modules(self, ctx: RunContext) -> None:
        self.targets = self.target_modules(ctx.models, ctx.facts.claimed("drop"))
        for name in self.targets:
            ctx.claim(name, "quantize", self.key)

    def transform_models(self, ctx: RunContext) -> None:
        cdt = self.compute_dtype()
        done: dict[str, QuantizationResult] = {}
        targets = getattr(self, "targets", None)
        for name in targets if targets is not None else self.target_modules(ctx.models):
            module = ctx.models[name]
            keep = keep_patterns(module, cdt)
            trainable = select_linear_layers(module, self.config.skip, keep).trainable  # keeps no layer alive
            if trainable:
                raise UserError(
                    f"quantization={self.name} would quantize '{name}', whose weights are trained"
                    f"{' (model.train=full)' if self.run.train_mode == 'full' else ''} "
                    f"({len(trainable)} Linear layers, e.g. {trainable[0]}); quantized weights cannot be "
                    f"trained. Use model.train=lora, or leave '{name}' out of {self.setting('modules')}."
                )
            unread = ctx.models.unread.get(name)  # built on meta: each layer read as it is quantized
            if unread is None:
                result = self.quantize(module, self.config.skip, keep, ctx)
            elif "read" in inspect.signature(self.quantize).parameters:
                result = self.quantize(module, self.config.skip, keep, ctx, read=unread.read_layer)
            else:  # a subclass (another package's) that takes no reader: the base read whole first, as before
                unread.read_rest(module)
                del ctx.models.unread[name]
                unread = None
                result = self.quantize(module, self.config.skip, keep, ctx)
            done[name] = result
            log.info("quantization=%s: %s: %s%s%s", self.name, name, result.describe(),
                     "" if unread is None else ", each layer read from its file just before it was quantized",
                     " (simulated)" if ctx.simulate else "")
        self.results = done
        ctx.facts.quantized.update({name: len(r.layers) for name, r in done.items()})
        ctx.notes["quantized layers"] = sum(len(r.layers) for r in done.values())
        ctx.notes["quantized weight bytes"] = sum(r.weight_bytes_after for r in done.values())


def is_vae(name: str, module: nn.Module) -> bool:
    return name == "vae" or type(module).__module__.startswith("diffusers.models.autoencoders")
