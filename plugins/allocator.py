"""CUDA caching-allocator settings, memory cap and TF32 (``allocator=default``).

Why: training diffusion models with varying shapes (aspect-ratio buckets, micro-batch splits
after an OOM) fragments the caching allocator; a step that needs 20 GiB can fail on a 24 GiB
card with 6 GiB "reserved but unallocated". ``expandable_segments`` lets segments grow in place
instead of carving fixed blocks, which removes most of that fragmentation at no speed cost.
``max_split_size_mb`` (do not split blocks larger than this) and
``garbage_collection_threshold`` (reclaim cached blocks before hitting the limit) are the older,
coarser tools for the same problem; leave them unset unless a fragmentation report asks.

Trade-offs and caveats:

* Allocator settings are read once, when CUDA initialises. The plugin therefore runs in
  ``configure_process``, before anything touches CUDA; if CUDA is already initialised it warns
  that the setting cannot take effect any more.
* ``expandable_segments`` breaks CUDA IPC: memory in expandable segments cannot be shared with
  another process through ``torch.multiprocessing`` (a DataLoader worker that returns CUDA
  tensors, or a multi-process producer/consumer). Keep loader workers on CPU tensors (the
  runner's loader does) or set ``allocator.default.expandable_segments=false``.
* An explicit ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) in the environment wins
  key by key over this config; the log says which keys it overrode.
* ``cap_to_budget`` uses ``torch.cuda.set_per_process_memory_fraction`` so a large card behaves
  like one of ``budget_gb``: an allocation beyond it raises OOM, which is how you test that a
  preset fits a smaller card without owning one. The cap counts PyTorch allocations only
  (not the CUDA context, ~0.3-0.5 GiB, or other libraries' memory).
* TF32 (``tf32``) makes fp32 matmuls/convolutions on Ampere+ use TensorFloat-32 (10-bit
  mantissa): several times faster, slightly less precise; irrelevant under bf16 autocast for
  the autocast ops. Set through ``torch.set_float32_matmul_precision`` and
  ``torch.backends.cudnn.allow_tf32``, which keep PyTorch's legacy and new TF32 APIs consistent
  (mixing ``matmul.fp32_precision`` with ``matmul.allow_tf32`` raises on read in torch >= 2.9).

On a machine without CUDA (or with ``train.device=cpu``) all of this is a no-op apart from the
environment variable, and the log says so in one line.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from runner.plugin import Plugin
from runner.plugins.schemas import MIN_SPLIT_MB, AllocatorConfig, check_allocator, check_cap_budget  # noqa: F401  (re-exported)
from runner.registry import register_plugin

if TYPE_CHECKING:
    from runner.context import RunContext

log = logging.getLogger("runner")

ENV = "PYTORCH_CUDA_ALLOC_CONF"
ENV_NEW = "PYTORCH_ALLOC_CONF"  # the device-generic name of newer PyTorch; read before ENV


@dataclass
class AllocatorResult:
    """What :func:`apply_allocator_settings` did, for the log and the run report."""

    env_var: str
    alloc_conf: str  # the final value of env_var ("" = not set)
    user_keys: list[str] = field(default_factory=list)  # keys whose value came from the user's env
    cuda: bool = False  # a CUDA device is used
    took_effect: bool = True  # False when CUDA was initialised before we set the variable
    memory_fraction: Optional[float] = None
    tf32: Optional[bool] = None  # None: not touched (CPU)


# ---- the twin functions ------------------------------------------------------------------------
def check_config(cfg: Any, budget_gb: Optional[float] = None) -> None:
    """Raise UserError naming the key for values PyTorch would reject (or reject late), ``cap_to_budget``
    without a budget included (runner/plugins/schemas.py has the node-only part)."""
    check_allocator(cfg, budget_gb=budget_gb, check_budget=True)


def allocator_conf_string(cfg: Any) -> str:
    """The PYTORCH_CUDA_ALLOC_CONF value for ``cfg``, e.g. ``"expandable_segments:True"``.

    Only settings that differ from PyTorch's defaults are written, so an empty string means
    "nothing to set".
    """
    parts = []
    if cfg.expandable_segments:
        parts.append("expandable_segments:True")
    if cfg.max_split_size_mb is not None:
        parts.append(f"max_split_size_mb:{int(cfg.max_split_size_mb)}")
    if cfg.garbage_collection_threshold is not None:
        parts.append(f"garbage_collection_threshold:{float(cfg.garbage_collection_threshold):g}")
    return ",".join(parts)


def _parse(conf: str) -> dict[str, str]:
    """``"a:1,b:[x:y]"`` -> ordered {key: value}; brackets (roundup_power2_divisions) kept whole."""
    items: dict[str, str] = {}
    depth, start = 0, 0
    pieces = []
    for i, ch in enumerate(conf):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            pieces.append(conf[start:i])
            start = i + 1
    pieces.append(conf[start:])
    for piece in pieces:
        piece = piece.strip()
        if not piece:
            continue
        key, _, value = piece.partition(":")
        items[key.strip()] = value.strip()
    return items


def merge_alloc_conf(ours: str, user: str) -> tuple[str, list[str]]:
    """Merge our settings into the user's; the user's explicit keys win.

    Returns the merged string (user's keys first, in their order) and the keys where the user's
    value replaced ours.
    """
    mine, theirs = _parse(ours), _parse(user)
    overridden = [k for k in mine if k in theirs and theirs[k] != mine[k]]
    merged = dict(theirs)
    for k, v in mine.items():
        merged.setdefault(k, v)
    return ",".join(f"{k}:{v}" if v else k for k, v in merged.items()), overridden


def apply_allocator_settings(
    cfg: Any, budget_gb: Optional[float] = None, device: torch.device | str | None = None
) -> AllocatorResult:
    """Set PYTORCH_CUDA_ALLOC_CONF (merged with the user's), the memory cap and TF32.

    Call before anything initialises CUDA. ``device`` is the training device (default: cuda
    when available); on CPU only the environment variable is written.
    """
    check_config(cfg, budget_gb)
    ours = allocator_conf_string(cfg)
    env_var = ENV_NEW if os.environ.get(ENV_NEW) else ENV
    user = os.environ.get(env_var, "")
    merged, overridden = merge_alloc_conf(ours, user)
    result = AllocatorResult(env_var=env_var, alloc_conf=merged, user_keys=sorted(_parse(user)))
    for key in overridden:
        log.info(
            "allocator: %s from the environment sets %s:%s, which wins over allocator.default.%s (%s)",
            env_var, key, _parse(user)[key], key, _parse(ours)[key],
        )
    if merged and merged != user:
        if torch.cuda.is_initialized():
            result.took_effect = False
            log.warning(
                "allocator: CUDA is already initialised, so %s=%s (allocator.default.expandable_segments / "
                "max_split_size_mb / garbage_collection_threshold) cannot take effect any more; "
                "set it in the environment before starting Python, or keep CUDA untouched until the runner starts.",
                env_var, merged,
            )
        os.environ[env_var] = merged

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result.cuda = dev.type == "cuda" and torch.cuda.is_available()
    if not result.cuda:
        log.info(
            "allocator: no CUDA device; %s=%s, memory cap and TF32 are no-ops on CPU", env_var, merged or "(unset)"
        )
        return result

    if cfg.cap_to_budget:
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        fraction = float(budget_gb) * 2**30 / total
        if fraction > 1.0:
            log.warning(
                "allocator: budget_gb=%s is more than this card has (%.1f GiB); the cap is the whole card",
                budget_gb, total / 2**30,
            )
            fraction = 1.0
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        result.memory_fraction = fraction
        log.info("allocator: capped cuda:%d at %.2f GiB (%.1f%% of %.1f GiB)", index, fraction * total / 2**30,
                 100 * fraction, total / 2**30)

    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = bool(cfg.tf32)
    result.tf32 = bool(cfg.tf32)
    log.info("allocator: %s=%s, TF32 %s", env_var, merged or "(unset)", "on" if cfg.tf32 else "off")
    return result


# ---- the plugin --------------------------------------------------------------------------------
@register_plugin
class DefaultAllocator(Plugin):
    kind = "allocator"
    name = "default"
    Config = AllocatorConfig

    def validate(self) -> None:
        check_cap_budget(self.config, budget_gb=self.run.budget_gb)

    def configure_process(self, ctx: RunContext) -> None:
        result = apply_allocator_settings(self.config, self.run.budget_gb, ctx.device)
        self.result = result
        ctx.notes["allocator conf"] = f"{result.env_var}={result.alloc_conf or '(unset)'}"
        if result.memory_fraction is not None:
            ctx.notes["memory cap fraction"] = round(result.memory_fraction, 4)
