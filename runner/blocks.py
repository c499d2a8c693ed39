"""The repeated blocks of a denoiser: the units that checkpointing and offload plugins work on.

One block finder for the whole runner, so that gradient checkpointing, weight streaming and the
planner agree on what a block is. A block is an *outermost* match: nothing inside a block is a
block too, so each parameter belongs to at most one.
"""
from __future__ import annotations

from collections.abc import Callable

from torch import nn


def outermost(root: nn.Module, match: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """Modules under ``root`` for which ``match`` holds, not descending into a match."""
    found: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if match(child):
                found.append(child)
            else:
                visit(child)

    visit(root)
    return found


def find_repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost repeated blocks of a denoiser, for checkpointing and offload plugins.

    For a U-Net the unit is each resnet and each attention (Transformer2DModel) of the
    down/mid/up blocks: diffusers' ``_repeated_blocks`` names only ``BasicTransformerBlock``,
    which would leave the resnets (most of a U-Net's activation memory) outside every block.
    Elsewhere the model's own ``_repeated_blocks`` (or ``_no_split_modules``) class names are used.
    """
    base = model
    if hasattr(model, "get_base_model") and not hasattr(model, "down_blocks"):
        base = model.get_base_model()
    if hasattr(base, "down_blocks") and hasattr(base, "up_blocks"):
        stages = list(base.down_blocks) + ([base.mid_block] if getattr(base, "mid_block", None) is not None else [])
        stages += list(base.up_blocks)
        wanted: set[int] = set()
        for stage in stages:
            for attr in ("resnets", "attentions"):
                for m in getattr(stage, attr, None) or []:
                    wanted.add(id(m))
        return outermost(base, lambda m: id(m) in wanted)
    names = set(getattr(type(base), "_repeated_blocks", None) or getattr(type(base), "_no_split_modules", None) or [])
    return outermost(base, lambda m: type(m).__name__ in names)
