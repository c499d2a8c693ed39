"""Tiled VAE, attention backend and attention slicing (``tiling=vae`` and ``tiling=attention``).

One plugin with fields rather than one option per feature, because a kind takes a single option
per run and these are used together (a 1024 px run wants a tiled VAE *and* a lean attention).
``tiling=vae`` and ``tiling=attention`` are the same plugin and take the same fields; they only
differ in their defaults (``vae_tiling`` on or off), so ``tiling=attention
tiling.attention=flash`` reads as what it does.

**Tiled VAE** (``vae_tiling``, ``vae_tile_size``, ``vae_tile_overlap``, ``vae_slicing``).
diffusers' ``AutoencoderKL`` already implements tiled encode and decode with blended seams
(``enable_tiling``: overlapping tiles, linear cross-fade over the overlap in both directions),
and its tile size and overlap are plain attributes (``tile_sample_min_size``,
``tile_latent_min_size``, ``tile_overlap_factor``), so we set those instead of writing our own.
We take the tile size and overlap in pixels and check them, because diffusers accepts values
that silently misalign tiles (a stride that is not a multiple of the VAE's factor shifts the
latent tiles against the pixel tiles). Images no larger than one tile are encoded whole.
Trade-off: each tile is normalised (GroupNorm) and attended over on its own, so results differ
from whole-image encoding; tests/plugins/test_tiling.py bounds the difference. Peak activation memory
of encode and decode drops from whole-image to one-tile size (measured there at 1024 px).
``vae_slicing`` runs the VAE one sample at a time (``enable_slicing``): exact, less memory
with batches > 1.

**Attention backend** (``attention``: ``default | math | flash | efficient | cudnn``). The
choice is applied with ``torch.nn.attention.sdpa_kernel`` around every diffusers attention
module (U-Net, Flux transformer, VAE mid-block), not process-wide around the step: the
recomputation of a checkpointed block in backward runs outside the step, and a different
kernel there would save different tensors than the forward did. Modules of ``transformers``
text encoders are left on PyTorch's default choice (the T5 relative-position bias is an
attention mask, which the flash kernel does not take). PyTorch's CPU build has the math and
flash kernels (flash is its default on CPU); efficient and cuDNN attention are CUDA-only, and
flash/cuDNN on CUDA take only fp16/bf16 inputs: both are UserErrors at validation.
``diffusers``' ``set_attention_backend`` is not used: it reaches only the processors built on
its dispatcher (Flux), not the U-Net's ``AttnProcessor2_0``.

**Attention slicing** (``attention_slice``: ``null | auto | max | <int>``): diffusers'
``set_attention_slice`` on models that have it (the SDXL U-Net; not the Flux transformer: a
UserError). It computes attention with explicit softmax (the math kernel) over slices of the
batch x heads dimension, so the peak of one attention's score matrix is one slice's. Use it
where no fused kernel is available (old GPUs, or fp32 on CUDA without the efficient kernel);
with a fused kernel (flash, efficient) the score matrix is never materialised, which beats
slicing. In training, the softmax output of every slice is still saved for backward, so the
saving is in the transient peak, not in the saved activations.

Applied in ``transform_models``, i.e. before ``offload=park`` (``place_models``) runs its
encoder-cache pre-pass, so that pre-pass already encodes tiled; the park cache key includes the
tiling config. Everything is undone in ``teardown``.
"""
from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from runner.errors import UserError
from runner.plugin import Plugin
from runner.plugins.schemas import (  # noqa: F401  (re-exported)
    ATTENTION_BACKENDS,
    AttentionConfig,
    TilingConfig,
    check_tiling,
    parse_slice,
)
from runner.registry import register_plugin

if TYPE_CHECKING:
    from runner.context import RunContext

log = logging.getLogger("runner")

CPU_BACKENDS = ("default", "math", "flash")
HALF_ONLY_BACKENDS = ("flash", "cudnn")


# ---- checks ----------------------------------------------------------------------------------
def check_config(c: Any, run: Any = None) -> None:
    """Values diffusers or PyTorch would reject late or accept wrongly, and the kernels the run's target
    cannot use; UserErrors naming keys. The settings' own checks are in runner/plugins/schemas.py."""
    check_tiling(c)
    if run is not None:
        check_against_run(c, run)


def check_against_run(c: Any, run: Any) -> None:
    """The attention kernel against the run's target and precision (the node's own checks: schemas.py)."""
    if run.target == "cpu" and c.attention not in CPU_BACKENDS:
        raise UserError(
            f"tiling.{c.name}.attention={c.attention} is a CUDA-only kernel and this run is for the CPU "
            f"(train.device=cpu, or auto without a GPU). On CPU use tiling.{c.name}.attention=default, flash or math."
        )
    if run.target == "cuda" and c.attention in HALF_ONLY_BACKENDS and run.precision == "no":
        raise UserError(
            f"tiling.{c.name}.attention={c.attention} takes only float16/bfloat16 inputs, but train.mixed_precision=no "
            "keeps attention in float32. Set train.mixed_precision=bf16 (or fp16), or use "
            f"tiling.{c.name}.attention=efficient, which takes float32."
        )


def check_cuda_backend(backend: str, device: torch.device) -> None:
    """Kernels this GPU cannot run: a UserError before training, not a kernel error mid-step."""
    if device.type != "cuda" or backend in ("default", "math"):
        return
    major, _ = torch.cuda.get_device_capability(device)
    ok = {
        "flash": torch.backends.cuda.is_flash_attention_available() and major >= 8,
        "efficient": True,
        "cudnn": major >= 8,
    }[backend]
    if not ok:
        raise UserError(
            f"tiling.attention={backend} is not available on {torch.cuda.get_device_name(device)} "
            f"(compute capability {major}.x, flash needs 8.0+). Use tiling.attention=efficient or default."
        )


# ---- tiled VAE: twin function ----------------------------------------------------------------
# Three tiling APIs in diffusers: AutoencoderKL's (square tiles: tile_sample_min_size, its latent
# twin and an overlap factor), the causal-3D video VAEs' (AutoencoderKLWan and
# AutoencoderKLQwenImage: tile height/width and strides in pixels) and HunyuanVideo 1.5's (tile
# height/width, their latent twins and an overlap factor). All blend the overlap.
_CLASSIC_TILING = ("enable_tiling", "tile_sample_min_size", "tile_latent_min_size", "tile_overlap_factor", "use_tiling")
_STRIDED_TILING = ("enable_tiling", "tile_sample_min_height", "tile_sample_min_width", "tile_sample_stride_height",
                   "tile_sample_stride_width", "use_tiling")
_FACTOR_HW_TILING = ("enable_tiling", "tile_sample_min_height", "tile_sample_min_width", "tile_latent_min_height",
                     "tile_latent_min_width", "tile_overlap_factor", "use_tiling")


def is_tileable_vae(module: nn.Module) -> bool:
    return any(all(hasattr(module, a) for a in api) for api in (_CLASSIC_TILING, _STRIDED_TILING, _FACTOR_HW_TILING))


def vae_downsampling(vae: nn.Module) -> int:
    """Pixels per latent along a side: the video VAEs say so (``spatial_compression_ratio``: 8,
    16 for the Wan 2.2 VAE); an AutoencoderKL halves once per block but the last."""
    ratio = getattr(vae, "spatial_compression_ratio", None)
    if isinstance(ratio, int) and ratio > 0:
        return ratio
    return 2 ** (len(vae.config.block_out_channels) - 1)


def apply_vae_tiling(vae: nn.Module, tile_size: int = 512, overlap: int = 128, slicing: bool = False) -> Callable[[], None]:
    """Tile ``vae``'s encode and decode: ``tile_size`` px tiles overlapping by ``overlap`` px.

    Sets diffusers' own tiling attributes and calls ``enable_tiling``; returns a function that
    restores the previous settings. A video VAE tiles space only: in time it already works a few
    frames at a time (the encoder takes 1 + 4k frames in chunks of 4, the decoder one latent frame
    at a time, carrying a small causal cache), so its activations do not grow with the clip length.
    """
    factor = vae_downsampling(vae)
    if tile_size % factor or overlap % factor or not 0 <= overlap < tile_size:
        raise UserError(
            f"tiling.vae_tile_size={tile_size} / tiling.vae_tile_overlap={overlap} do not fit this VAE: both must "
            f"be multiples of its factor {factor} and the overlap smaller than the tile."
        )
    strided = all(hasattr(vae, a) for a in _STRIDED_TILING)
    factor_hw = not strided and all(hasattr(vae, a) for a in _FACTOR_HW_TILING)
    api = _STRIDED_TILING if strided else _FACTOR_HW_TILING if factor_hw else _CLASSIC_TILING
    saved = {a: getattr(vae, a) for a in api[1:] + ("use_slicing",)}
    if factor_hw:  # set as attributes: enable_tiling's ``x or default`` would turn an overlap of 0 into 0.25
        vae.tile_sample_min_height = vae.tile_sample_min_width = int(tile_size)
        vae.tile_latent_min_height = vae.tile_latent_min_width = int(tile_size) // factor
        vae.tile_overlap_factor = overlap / tile_size
        vae.enable_tiling()
    elif strided:
        vae.enable_tiling(tile_sample_min_height=int(tile_size), tile_sample_min_width=int(tile_size),
                          tile_sample_stride_height=int(tile_size) - int(overlap),
                          tile_sample_stride_width=int(tile_size) - int(overlap))
    else:
        vae.tile_sample_min_size = int(tile_size)
        vae.tile_latent_min_size = int(tile_size) // factor
        vae.tile_overlap_factor = overlap / tile_size
        vae.enable_tiling()
    if slicing:
        vae.enable_slicing()

    def restore() -> None:
        for a, v in saved.items():
            setattr(vae, a, v)

    return restore


# ---- attention backend: twin function --------------------------------------------------------
def _sdpa_backends(name: str) -> list[Any]:
    from torch.nn.attention import SDPBackend

    return [{
        "math": SDPBackend.MATH,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[name]]


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """diffusers attention modules (``Attention`` and the newer ``AttentionModuleMixin`` ones)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return [m for m in model.modules() if isinstance(m, (Attention, AttentionModuleMixin))]


def apply_attention_backend(models: list[nn.Module], backend: str) -> Callable[[], None]:
    """Run every diffusers attention module under ``models`` with SDPA kernel ``backend``.

    ``default`` changes nothing. The module's ``forward`` is wrapped (an instance attribute, as
    the checkpoint plugin does), so a checkpointed block's recomputation uses the same kernel as
    its forward. Returns a function that restores the previous forwards.
    """
    if backend == "default":
        return lambda: None
    from torch.nn.attention import sdpa_kernel

    kernels = _sdpa_backends(backend)
    wrapped: list[tuple[weakref.ref, Any]] = []
    for model in models:
        for module in attention_modules(model):
            previous = module.__dict__.get("forward")
            ref, cls_forward = weakref.ref(module), type(module).forward

            def forward(*args: Any, _ref: Any = ref, _prev: Any = previous, _cls: Any = cls_forward, **kwargs: Any) -> Any:
                with sdpa_kernel(kernels):
                    return _prev(*args, **kwargs) if _prev is not None else _cls(_ref(), *args, **kwargs)

            module.forward = forward
            wrapped.append((ref, previous))

    def restore() -> None:
        for ref, previous in reversed(wrapped):
            module = ref()
            if module is None:
                continue
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous

    return restore


# ---- attention slicing: twin function --------------------------------------------------------
def apply_attention_slicing(model: nn.Module, slice_size: str | int) -> Callable[[], None]:
    """diffusers ``set_attention_slice`` on ``model``; returns a function restoring its processors."""
    saved = dict(model.attn_processors)
    try:
        model.set_attention_slice(slice_size)
    except ValueError as e:
        raise UserError(f"tiling.attention_slice={slice_size!r} does not fit {type(model).__name__}: {e}") from None
    return lambda: model.set_attn_processor(saved)


# ---- the plugin ------------------------------------------------------------------------------
@register_plugin
class VaeTiling(Plugin):
    kind = "tiling"
    name = "vae"
    Config = TilingConfig

    def validate(self) -> None:
        check_against_run(self.config, self.run)

    def encoder_signature(self, modules: frozenset[str] | None = None) -> dict[str, Any] | None:
        """A tiled VAE encodes slightly different latents (blended tile seams): its tile settings key
        the parts the VAE computes, and no other part."""
        c = self.config
        if modules is not None and not (set(getattr(self, "tiled", ())) & modules):
            return None
        return {"vae_tiling": bool(c.vae_tiling), "tile": int(c.vae_tile_size), "overlap": int(c.vae_tile_overlap)}

    def transform_models(self, ctx: RunContext) -> None:
        c, models = self.config, ctx.models

        def record(module: nn.Module, restore: Callable[[], None]) -> None:  # undone by ctx.teardown
            ctx.hooks.add(module, "tiling", self.key, undo=restore)

        if c.vae_tiling or c.vae_slicing:
            vaes = [(n, m) for n, m in models.items() if is_tileable_vae(m)]
            if not vaes:
                log.warning("tiling: no tileable VAE among %s; tiling.vae_tiling/vae_slicing do nothing",
                            ", ".join(models.modules) or "no modules")
            self.tiled = [name for name, _ in vaes] if c.vae_tiling else []  # the VAEs whose latents change
            for name, vae in vaes:
                if c.vae_tiling:
                    record(vae, apply_vae_tiling(vae, int(c.vae_tile_size), int(c.vae_tile_overlap), bool(c.vae_slicing)))
                    log.info("tiling: %s encodes/decodes in %d px tiles overlapping by %d px%s", name,
                             c.vae_tile_size, c.vae_tile_overlap, ", one sample at a time" if c.vae_slicing else "")
                else:
                    vae.enable_slicing()
                    record(vae, vae.disable_slicing)
                    log.info("tiling: %s runs one sample at a time (vae_slicing)", name)
        if c.attention != "default":
            check_cuda_backend(c.attention, ctx.device)
            targets = [m for _, m in models.items()]
            count = sum(len(attention_modules(m)) for m in targets)
            for m in targets:
                record(m, apply_attention_backend([m], c.attention))
            log.info("tiling: %d diffusers attention modules use the %s SDPA kernel", count, c.attention)
        size = parse_slice(c.attention_slice, f"tiling.{c.name}.attention_slice")
        if size is not None:
            sliceable = [(n, m) for n, m in models.items() if callable(getattr(m, "set_attention_slice", None))]
            if not sliceable:
                raise UserError(
                    f"tiling.{c.name}.attention_slice={c.attention_slice} needs a model with diffusers' set_attention_slice "
                    f"(e.g. the SDXL U-Net); none of {', '.join(models.modules)} has it. Remove tiling.{c.name}.attention_slice "
                    "or use tiling.attention=flash / efficient, which never materialise the attention matrix."
                )
            for name, m in sliceable:
                record(m, apply_attention_slicing(m, size))
                log.info("tiling: %s computes attention in slices (attention_slice=%s)", name, size)


@register_plugin
class AttentionTiling(VaeTiling):
    name = "attention"
    Config = AttentionConfig
