"""The light half of every built-in plugin: its config schema, its description and the checks its
settings alone decide, importable without torch.

Why a separate module: Hydra needs every plugin's schema to compose a run, ``--help`` lists them,
and a misspelled value must be answered at once. The plugin modules themselves import torch,
bitsandbytes and diffusers at the top (seconds on a busy machine), so composing against them
made ``python -m runner --help`` and every config error wait for torch. Here each plugin keeps
what validation needs; ``plugins/__init__.py`` declares them to the registry with the path of
the class that does the work, which is imported only when a run builds the plugin
(runner/registry.py). The plugin modules import their ``Config`` from here, so
``from runner.plugins.park import ParkConfig`` still works.

A check here sees only the plugin's own node (``check(node, key)``, ``key`` like
``offload.park``); what depends on the resolved run (the device, the precision) stays in the
plugin's ``validate()``, which runs once torch is imported, still before anything is built.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

from runner.errors import UserError, valid_list
from runner.plugin import PluginConfig


@dataclass(frozen=True)
class BuiltinPlugin:
    """A built-in plugin as the registry knows it before its module is imported."""

    kind: str
    name: str
    config: type
    target: str  # "module:Class" of the Plugin subclass
    check: Optional[Callable[[Any, str], None]] = None  # the node-only checks: check(node, "offload.park")

    @property
    def description(self) -> str:
        return self.config.description


# ---- allocator=default ---------------------------------------------------------------------------
MIN_SPLIT_MB = 20  # PyTorch's minimum for max_split_size_mb (its large-block size)


@dataclass
class AllocatorConfig(PluginConfig):
    """``allocator=default``: caching-allocator settings, an optional cap at ``budget_gb``, TF32."""

    description: ClassVar[str] = "expandable segments (less fragmentation), optional cap at budget_gb, TF32"
    name: str = "default"
    expandable_segments: bool = True  # grow segments in place: less fragmentation; breaks CUDA IPC
    max_split_size_mb: Optional[int] = None  # never split cached blocks larger than this (>= 20)
    garbage_collection_threshold: Optional[float] = None  # in (0, 1): reclaim cache above this fraction
    cap_to_budget: bool = False  # limit this process to budget_gb of the card (needs budget_gb)
    tf32: bool = True  # TensorFloat-32 for fp32 matmul/conv on Ampere and newer


def check_allocator(cfg: Any, key: str = "allocator.default", budget_gb: Optional[float] = None,
                    check_budget: bool = False) -> None:
    """Raise UserError naming the key for values PyTorch would reject (or reject late)."""
    gct = cfg.garbage_collection_threshold
    if gct is not None and not 0.0 < float(gct) < 1.0:
        raise UserError(
            f"{key}.garbage_collection_threshold={gct!r} is not valid: it must be a fraction strictly "
            "between 0 and 1 (e.g. 0.8), or null to leave it unset."
        )
    mss = cfg.max_split_size_mb
    if mss is not None and int(mss) < MIN_SPLIT_MB:
        raise UserError(
            f"{key}.max_split_size_mb={mss!r} is not valid: PyTorch needs at least {MIN_SPLIT_MB} (MiB), "
            "e.g. 128 or 512, or null to leave it unset."
        )
    if check_budget:
        check_cap_budget(cfg, key, budget_gb)


def check_cap_budget(cfg: Any, key: str = "allocator.default", budget_gb: Optional[float] = None) -> None:
    """``cap_to_budget`` needs a budget (the resolved run's)."""
    if cfg.cap_to_budget and budget_gb is None:
        raise UserError(
            f"{key}.cap_to_budget=true needs budget_gb: set budget_gb=<GiB> (e.g. budget_gb=24) "
            f"or {key}.cap_to_budget=false."
        )


# ---- checkpoint=blocks ---------------------------------------------------------------------------
CHECKPOINT_MODES = ("full", "every_n")


@dataclass
class CheckpointConfig(PluginConfig):
    """``checkpoint=blocks``: recompute repeated blocks in backward instead of storing activations."""

    description: ClassVar[str] = ("recompute repeated blocks in backward (mode=full|every_n): less activation memory, "
                                  "~30% more compute")
    name: str = "blocks"
    mode: str = "full"  # full: every repeated block | every_n: one block in every `every_n`
    every_n: int = 2  # used by mode=every_n
    modules: list[str] = field(default_factory=list)  # trained modules to checkpoint; empty = all trained


def check_checkpoint(config: Any, key: str = "checkpoint.blocks") -> None:
    """Raise UserError for an invalid ``checkpoint.blocks.mode`` / ``checkpoint.blocks.every_n``."""
    mode = config.mode
    if mode not in CHECKPOINT_MODES:
        raise UserError(f"{key}.mode={mode!r} is not valid. Valid values: {valid_list(str(mode), CHECKPOINT_MODES)}.")
    every_n = config.every_n
    if mode == "every_n" and (not isinstance(every_n, int) or isinstance(every_n, bool) or every_n < 1):
        raise UserError(
            f"{key}.every_n={every_n!r} is not valid: it must be an integer >= 1 "
            f"(2 = checkpoint every second block; 1 is the same as {key}.mode=full)."
        )


# ---- tiling=vae | attention ----------------------------------------------------------------------
ATTENTION_BACKENDS = ("default", "math", "flash", "efficient", "cudnn")


@dataclass
class TilingConfig(PluginConfig):
    """``tiling=vae``: tiled VAE encode/decode, plus attention backend and slicing."""

    description: ClassVar[str] = ("tiled VAE encode/decode (tile size, blended overlap), attention backend "
                                  "(math|flash|efficient|cudnn) and attention slicing")
    name: str = "vae"
    vae_tiling: bool = True  # tiled VAE encode/decode with blended seams (diffusers enable_tiling)
    vae_tile_size: int = 512  # tile side in pixels (a multiple of the VAE factor, 8)
    vae_tile_overlap: int = 128  # overlap of neighbouring tiles in pixels, blended (0 <= overlap < tile size)
    vae_slicing: bool = False  # VAE one sample at a time (exact; less memory for batches > 1)
    attention: str = "default"  # default | math | flash | efficient | cudnn (diffusers attention modules)
    attention_slice: Optional[str] = None  # null (off) | auto | max | <int>: diffusers set_attention_slice


@dataclass
class AttentionConfig(TilingConfig):
    """``tiling=attention``: the same plugin with the VAE untiled by default."""

    description: ClassVar[str] = "tiling=vae with vae_tiling off by default: attention backend and slicing only"
    name: str = "attention"
    vae_tiling: bool = False


def parse_slice(value: Any, key: str = "tiling.attention_slice") -> str | int | None:
    """``attention_slice`` as diffusers takes it: None, "auto", "max" or a positive int."""
    if value is None or value == "":
        return None
    text = str(value).strip()
    if text in ("auto", "max"):
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise UserError(
            f"{key}={value!r} is not valid: use null (off), auto (half the heads at a "
            "time), max (one head at a time) or a positive whole number of heads per slice."
        )
    return n


def check_tiling(c: Any, key: str | None = None) -> None:
    """Values diffusers or PyTorch would reject late or accept wrongly; UserErrors naming keys."""
    key = key or f"tiling.{c.name}"
    if c.attention not in ATTENTION_BACKENDS:
        raise UserError(
            f"{key}.attention={c.attention!r} is not valid. Valid values: {valid_list(str(c.attention), ATTENTION_BACKENDS)}."
        )
    parse_slice(c.attention_slice, f"{key}.attention_slice")
    if c.vae_tiling:
        size, overlap = int(c.vae_tile_size), int(c.vae_tile_overlap)
        if size <= 0 or size % 8:
            raise UserError(
                f"{key}.vae_tile_size={size} is not valid: it must be a positive multiple of 8 pixels "
                "(the VAE's downsampling factor), e.g. 512."
            )
        if overlap < 0 or overlap >= size:
            raise UserError(
                f"{key}.vae_tile_overlap={overlap} is not valid with {key}.vae_tile_size={size}: the overlap "
                f"must be at least 0 and smaller than the tile (e.g. {size // 4})."
            )
        if overlap % 8:
            raise UserError(
                f"{key}.vae_tile_overlap={overlap} is not valid: it must be a multiple of 8 pixels so that "
                f"tiles start on the latent grid (e.g. {overlap // 8 * 8 or 8})."
            )


# ---- quantization=nf4 | int8 | fp8 ---------------------------------------------------------------
DEFAULT_SKIP: tuple[str, ...] = (
    r"(^|\.)(time_embedding|add_embedding|time_text_embed)\.",
    r"^(x_embedder|context_embedder|proj_in|proj_out|norm_out)(\.|$)",
    r"(^|\.)text_projection$",
    r"(^|\.)text_fusion\.projector$",  # Krea 2: mixes the 12 tapped text layers (12 weights; bitsandbytes fails a 1-row layer)
)
"""Regular expressions (``re.search`` on the logical layer name) of layers kept unquantized."""

COMPUTE_DTYPE_NAMES = ("float32", "bfloat16", "float16")
FP8_STORAGE_DTYPE_NAMES = ("float8_e4m3fn", "float8_e5m2")


@dataclass
class QuantTargetsConfig(PluginConfig):
    """The settings every quantization plugin has: which modules, which layers to leave alone."""

    # [] = every module holding frozen base weights, VAE excepted; "name?" = name if the trainer builds one
    modules: list[str] = field(default_factory=list)
    skip: list[str] = field(default_factory=lambda: list(DEFAULT_SKIP))  # regexes (re.search) on layer names; replaces the defaults


@dataclass
class NF4Config(QuantTargetsConfig):
    """``quantization=nf4``: frozen Linear weights in 4-bit NormalFloat (QLoRA)."""

    description: ClassVar[str] = "frozen Linear weights in 4-bit NF4 (bitsandbytes, ~0.52 B/param); train with model.train=lora"
    name: str = "nf4"
    compute_dtype: Optional[str] = None  # float32 | bfloat16 | float16; None = model.dtype
    double_quant: bool = True  # quantize the absmax statistics too (0.5 + 0.016 instead of 0.5 + 0.0625 B/param)


@dataclass
class Int8Config(QuantTargetsConfig):
    """``quantization=int8``: frozen Linear weights in 8-bit (LLM.int8)."""

    description: ClassVar[str] = "frozen Linear weights in 8-bit LLM.int8 (bitsandbytes, ~1 B/param); train with model.train=lora"
    name: str = "int8"
    threshold: float = 6.0  # outlier threshold of LLM.int8's mixed decomposition (CUDA); 0 = pure int8


@dataclass
class Fp8Config(QuantTargetsConfig):
    """``quantization=fp8``: frozen Linear weights stored in fp8, upcast per layer."""

    description: ClassVar[str] = "frozen Linear weights stored in fp8 (1 B/param), upcast per layer; train with model.train=lora"
    name: str = "fp8"
    storage_dtype: str = "float8_e4m3fn"  # float8_e4m3fn | float8_e5m2
    compute_dtype: Optional[str] = None  # float32 | bfloat16 | float16; None = model.dtype


def compile_patterns(patterns: Iterable[str], key: str = "quantization.skip") -> list[re.Pattern[str]]:
    """Compile skip patterns; a bad one is a UserError naming the key and the pattern."""
    out = []
    for i, p in enumerate(patterns):
        try:
            out.append(re.compile(str(p)))
        except re.error as e:
            raise UserError(
                f"{key}[{i}]={p!r} is not a valid regular expression ({e}). Patterns are Python regular "
                r"expressions matched with re.search against layer names, e.g. 'attn2' or '^proj_out$'."
            ) from None
    return out


def check_quantization(c: Any, key: str) -> None:
    compile_patterns(c.skip, f"{key}.skip")
    value = getattr(c, "compute_dtype", None)
    if value is not None and str(value) not in COMPUTE_DTYPE_NAMES:
        raise UserError(f"{key}.compute_dtype={value!r} is not valid. Valid values: "
                        f"{valid_list(str(value), COMPUTE_DTYPE_NAMES)}.")
    threshold = getattr(c, "threshold", None)
    if threshold is not None and float(threshold) < 0:
        raise UserError(f"{key}.threshold={threshold} is not valid: it must be >= 0 "
                        "(6.0 = LLM.int8 outlier decomposition, 0 = pure int8).")
    storage = getattr(c, "storage_dtype", None)
    if storage is not None and str(storage) not in FP8_STORAGE_DTYPE_NAMES:
        raise UserError(f"{key}.storage_dtype={str(storage)!r} is not valid. Valid values: "
                        f"{valid_list(str(storage), FP8_STORAGE_DTYPE_NAMES)}.")


# ---- offload=park --------------------------------------------------------------------------------
@dataclass
class ParkConfig(PluginConfig):
    """``offload=park``: frozen modules on the host, visiting the device per call; cached outputs."""

    description: ClassVar[str] = ("frozen modules (VAE, text encoders) on the host, on the device only per call; "
                                  "latents/embeddings cached to disk, encoders dropped once cached")
    text_cache_setting: ClassVar[str] = "cache_text"
    prepass_by_block_setting: ClassVar[str] = "fill=stream"
    name: str = "park"
    cache_latents: bool = True  # cache VAE posteriors (mean, std); drop the VAE once all are cached
    cache_text: bool = True  # cache text embeddings; drop the text encoders once all are cached
    cache_dir: Optional[str] = None  # default: $XDG_CACHE_HOME or ~/.cache, /diffusion-memory-runner/latents
    encode_batch_size: Optional[int] = None  # pre-pass batch; default: the run's micro-batch (bitwise-equal results)
    pin_memory: bool = True  # pinned host copies of parked weights on CUDA (async copies in)
    # Where the encoders run to fill the cache: device (parked, one on the device per call: the pre-pass of a
    # training run), stream (each encoder's blocks parked apart: one block's weights on the device at a time,
    # for an encoder the card cannot hold whole) or host (on the CPU, e.g. for mode=cache on another machine).
    fill: str = "device"


PARK_FILLS = ("device", "stream", "host")  # offload.park.fill


def check_park(c: Any, key: str = "offload.park") -> None:
    fill = c.fill
    if fill not in PARK_FILLS:
        raise UserError(f"{key}.fill={fill!r} is not valid. Valid values: {valid_list(str(fill), PARK_FILLS)}.")
    if c.encode_batch_size is not None and int(c.encode_batch_size) < 1:
        raise UserError(
            f"{key}.encode_batch_size={c.encode_batch_size!r} is not valid: give a whole number >= 1 "
            "or leave it unset (null) to use the run's micro-batch size."
        )


# ---- offload=stream ------------------------------------------------------------------------------
@dataclass
class StreamConfig(PluginConfig):
    """``offload=stream``: repeated blocks' weights streamed from pinned host memory to the device."""

    description: ClassVar[str] = ("repeated blocks' weights in pinned host memory, streamed to the device ahead of use "
                                  "within a byte budget (offload.stream.device_budget_gb); compose with park, "
                                  "activations, optimizer")
    name: str = "stream"
    device_budget_gb: Optional[float] = None  # GiB of the streamed modules' weights on the device; null: device_fraction
    device_fraction: float = 0.5  # used when device_budget_gb is null: this share of the modules' weight bytes
    prefetch: int = 1  # blocks copied ahead of the one computing (window = prefetch + 1 blocks)
    modules: list[str] = field(default_factory=list)  # modules to stream; empty = the trained ones
    pin_memory: bool = True  # page-lock host copies (CUDA only) so copies run asynchronously


def check_stream(c: Any, key: str = "offload.stream") -> None:
    if c.device_budget_gb is not None and not c.device_budget_gb > 0:
        raise UserError(f"{key}.device_budget_gb={c.device_budget_gb!r} is not valid: give a number of GiB > 0, "
                        f"or null to use {key}.device_fraction.")
    if c.device_budget_gb is None and not 0 < c.device_fraction <= 1:
        raise UserError(f"{key}.device_fraction={c.device_fraction!r} is not valid: give a share of the weight "
                        f"bytes in (0, 1] (0.5 keeps half of them on the device), or set {key}.device_budget_gb.")
    if not isinstance(c.prefetch, int) or isinstance(c.prefetch, bool) or c.prefetch < 0:
        raise UserError(f"{key}.prefetch={c.prefetch!r} is not valid: give a whole number of blocks >= 0 "
                        "(1 copies the next block while one computes).")


# ---- offload=activations -------------------------------------------------------------------------
@dataclass
class ActivationOffloadConfig(PluginConfig):
    """``offload=activations``: saved activations go to pinned host memory during forward."""

    description: ClassVar[str] = "saved activations to pinned host memory on a side stream during forward, back in backward"
    name: str = "activations"
    min_bytes: int = 1024  # smaller saved tensors stay on the device
    use_streams: bool = True  # copy on a side stream (CUDA); false: copies on the compute stream
    max_fwd_stash: int = 5  # device tensors kept alive until their host copy has landed
    prefetch: int = 2  # in backward, tensors brought back ahead of need
    pin_memory: bool = True
    ram_warn_pct: float = 60.0  # warn when host RAM use passes this share


def check_activation_offload(c: Any, key: str = "offload.activations") -> None:
    if not isinstance(c.min_bytes, int) or c.min_bytes < 0:
        raise UserError(f"{key}.min_bytes={c.min_bytes!r} is not valid: give a whole number of bytes >= 0 (default 1024).")
    if not isinstance(c.max_fwd_stash, int) or c.max_fwd_stash < 1:
        raise UserError(f"{key}.max_fwd_stash={c.max_fwd_stash!r} is not valid: give a whole number >= 1 (default 5).")
    if not isinstance(c.prefetch, int) or c.prefetch < 0:
        raise UserError(f"{key}.prefetch={c.prefetch!r} is not valid: give a whole number >= 0 (default 2).")
    if not 0 < float(c.ram_warn_pct) <= 100:
        raise UserError(f"{key}.ram_warn_pct={c.ram_warn_pct!r} is not valid: give a percentage in (0, 100].")


# ---- offload=optimizer ---------------------------------------------------------------------------
OPTIMIZER_OFFLOAD_IMPLEMENTATIONS = ("auto", "torchao", "builtin")


@dataclass
class OptimizerOffloadConfig(PluginConfig):
    """``offload=optimizer``: optimizer state in host memory; the step on the host (default) or the device."""

    description: ClassVar[str] = ("optimizer state in host memory; the step on the host (step_on_host=true, ZeRO-offload "
                                  "style) or on the device chunk by chunk")
    name: str = "optimizer"
    step_on_host: bool = True  # false: state on the host, step on the device chunk by chunk
    offload_gradients: bool = False  # step_on_host: move gradients to the host during backward
    implementation: str = "auto"  # auto (torchao when importable and correct, else builtin) | torchao | builtin
    chunk_mb: float = 512.0  # step_on_host=false: parameters (MiB) whose state is on the device at once
    pin_memory: bool = True


def check_optimizer_offload(c: Any, key: str = "offload.optimizer") -> None:
    if c.implementation not in OPTIMIZER_OFFLOAD_IMPLEMENTATIONS:
        raise UserError(f"{key}.implementation={c.implementation!r} is not valid. "
                        f"Valid values: {valid_list(str(c.implementation), OPTIMIZER_OFFLOAD_IMPLEMENTATIONS)}.")
    if not c.chunk_mb > 0:
        raise UserError(f"{key}.chunk_mb={c.chunk_mb!r} is not valid: give the MiB of parameters stepped at once, > 0.")


# ---- the declarations ----------------------------------------------------------------------------
BUILTINS: tuple[BuiltinPlugin, ...] = (
    BuiltinPlugin("allocator", "default", AllocatorConfig, "runner.plugins.allocator:DefaultAllocator", check_allocator),
    BuiltinPlugin("checkpoint", "blocks", CheckpointConfig, "runner.plugins.checkpoint:BlockCheckpointing", check_checkpoint),
    BuiltinPlugin("tiling", "vae", TilingConfig, "runner.plugins.tiling:VaeTiling", check_tiling),
    BuiltinPlugin("tiling", "attention", AttentionConfig, "runner.plugins.tiling:AttentionTiling", check_tiling),
    BuiltinPlugin("quantization", "nf4", NF4Config, "runner.plugins.quantization.bnb:NF4Quantization", check_quantization),
    BuiltinPlugin("quantization", "int8", Int8Config, "runner.plugins.quantization.bnb:Int8Quantization", check_quantization),
    BuiltinPlugin("quantization", "fp8", Fp8Config, "runner.plugins.quantization.fp8:Fp8Storage", check_quantization),
    BuiltinPlugin("offload", "park", ParkConfig, "runner.plugins.park:Park", check_park),
    BuiltinPlugin("offload", "stream", StreamConfig, "runner.plugins.stream:StreamOffload", check_stream),
    BuiltinPlugin("offload", "activations", ActivationOffloadConfig,
                  "runner.plugins.offload_activations:ActivationOffload", check_activation_offload),
    BuiltinPlugin("offload", "optimizer", OptimizerOffloadConfig, "runner.plugins.offload_optimizer:OptimizerOffload",
                  check_optimizer_offload),
)
