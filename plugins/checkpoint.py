"""Activation checkpointing of repeated blocks (``checkpoint=blocks``).

Trade-off: a checkpointed block keeps only its inputs during forward and recomputes its
internals in backward, so activation memory drops to roughly one block's worth plus the block
boundaries, for about one extra forward pass of compute (~30% more step time). ``mode=every_n``
checkpoints one block in every ``every_n``: less recompute, less saving.

We use PyTorch's *non-reentrant* checkpoint (``use_reentrant=False``): it supports keyword
arguments, inputs that do not require grad (frozen base + LoRA), ``torch.autograd.grad`` and
nested checkpoints, which the reentrant variant does not. The RNG state is saved and restored
so dropout draws the same mask in the recomputation.

Pitfall: PyTorch's recomputation check compares only shape, dtype and device of the recomputed
tensors, so a block that recomputes *different values* (non-determinism, state changed between
forward and backward) passes silently. Our tests compare values of outputs and gradients.

Blocks are taken from ``ctx.models.blocks[name]`` when the trainer provides them (it knows its
model best), else from :func:`runner.blocks.find_repeated_blocks`, the one block finder that
offload=stream and the planner use too.
"""
from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from runner.blocks import find_repeated_blocks
from runner.module_changes import mark, marked, unmark
from runner.plugin import ClaimsModules
from runner.plugins.schemas import CHECKPOINT_MODES as MODES  # noqa: F401
from runner.plugins.schemas import CheckpointConfig, check_checkpoint
from runner.registry import register_plugin

if TYPE_CHECKING:
    from runner.context import RunContext

log = logging.getLogger("runner")

MARK = "checkpoint"  # runner.module_changes mark on wrapped blocks: (the forward they had before, or None,)


# ---- the twin functions ------------------------------------------------------------------------
def _checkpointed_forward(block: nn.Module, previous: Any, determinism_check: str = "default") -> Any:
    # Hold the block weakly: a strong reference from its own __dict__ would make a cycle that
    # keeps a dropped model alive until the next GC pass.
    ref = weakref.ref(block)
    cls_forward = type(block).forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        blk = ref()
        if previous is not None:
            def run(*a: Any) -> Any:
                return previous(*a, **kwargs)
        else:
            def run(*a: Any) -> Any:
                return cls_forward(blk, *a, **kwargs)
        if blk.training and torch.is_grad_enabled():
            # kwargs travel in the closure (as torch does internally), so a block argument
            # named like a checkpoint option (context_fn, debug...) cannot be taken for one.
            return checkpoint(run, *args, use_reentrant=False, determinism_check=determinism_check)
        return run(*args)

    return forward


def apply_activation_checkpointing(blocks: list[nn.Module], every_n: int = 1,
                                   determinism_check: str = "default") -> list[nn.Module]:
    """Checkpoint blocks ``0, every_n, 2*every_n, ...`` of ``blocks``; return the wrapped ones.

    The block's ``forward`` is replaced by one that calls ``torch.utils.checkpoint.checkpoint(
    ..., use_reentrant=False)`` when grad is enabled and the block is in training mode, and the
    plain forward otherwise (inference, ``eval()``, ``no_grad``: nothing to save, nothing to
    recompute). Module hooks still run once, outside the checkpoint. Already wrapped blocks are
    left alone. Undo with :func:`remove_activation_checkpointing`. ``determinism_check``:
    torch.utils.checkpoint's check that recomputed tensors have the saved ones' shape, dtype and
    device; "none" on ``train.device=cuda_sim``, whose card tensors read ``cpu`` where autograd
    records them in forward and ``cpu:0`` where it compares them in backward (the same tensors).
    """
    if every_n < 1:
        raise ValueError(f"every_n must be >= 1, got {every_n}")
    wrapped = []
    for i, block in enumerate(blocks):
        if i % every_n or marked(block, MARK) is not None:
            continue
        previous = block.__dict__.get("forward")  # another wrapper (e.g. an offload hook) or None
        mark(block, MARK, (previous,))
        block.forward = _checkpointed_forward(block, previous, determinism_check)
        wrapped.append(block)
    return wrapped


def remove_activation_checkpointing(blocks: list[nn.Module]) -> int:
    """Restore the forward each block had before it was wrapped; returns how many were restored.

    Remove wrappers in the reverse order they were added: if another plugin wrapped ``forward``
    after us, restoring ours would drop theirs.
    """
    n = 0
    for block in blocks:
        was = unmark(block, MARK)
        if was is None:
            continue
        (previous,) = was
        if previous is None:
            block.__dict__.pop("forward", None)
        else:
            block.forward = previous
        n += 1
    return n


def check_config(config: Any) -> None:
    """Raise UserError for an invalid ``checkpoint.mode`` / ``checkpoint.every_n`` (runner/plugins/schemas.py)."""
    check_checkpoint(config)


# ---- the plugin --------------------------------------------------------------------------------
@register_plugin
class BlockCheckpointing(ClaimsModules):
    kind = "checkpoint"
    name = "blocks"
    claim_as = "checkpoint"
    Config = CheckpointConfig
    # Wrap after placement decisions and offload hooks exist, so our forward is the outer one
    # and is restored first at teardown.
    after = ("offload",)

    def wrap_execution(self, ctx: RunContext) -> None:
        models = ctx.models
        names = self.targets(ctx)
        every_n = 1 if self.config.mode == "full" else int(self.config.every_n)
        done: dict[str, list[nn.Module]] = {}
        for name in names:
            module = models[name]
            blocks = models.blocks.get(name) or find_repeated_blocks(module)
            source = "trainer" if models.blocks.get(name) else "discovered"
            if getattr(module, "is_gradient_checkpointing", False):
                log.warning("checkpoint: %s already has diffusers gradient checkpointing enabled; blocks would be recomputed twice", name)
            if not blocks:
                log.warning("checkpoint: found no repeated blocks in %s (%s); nothing checkpointed", name, type(module).__name__)
                continue
            wrapped = apply_activation_checkpointing(blocks, every_n,
                                                     "none" if self.run.simulated_card else "default")
            for block in wrapped:
                ctx.hooks.add(block, MARK, self.key, undo=lambda b=block: remove_activation_checkpointing([b]))
            done[name] = wrapped
            log.info(
                "checkpoint: %s: %d of %d %s blocks wrapped (mode=%s%s)",
                name, len(wrapped), len(blocks), source, self.config.mode,
                f", every_n={every_n}" if self.config.mode == "every_n" else "",
            )
        ctx.facts.checkpointed.update({name: len(wrapped) for name, wrapped in done.items()})
        ctx.notes["checkpointed blocks"] = sum(len(v) for v in done.values())
