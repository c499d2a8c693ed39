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


# ModuleLists that hold a denoiser's repeated blocks, by the names diffusers' transformers use:
# DiT/PixArt/SD3/Qwen-Image ``transformer_blocks``, Flux's second list ``single_transformer_blocks``,
# Wan and other video transformers' ``blocks``.
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers")


def _declared_names(model: nn.Module) -> set[str]:
    """Class names the model (or, for a wrapper, its first submodule that declares them) lists in
    diffusers' ``_repeated_blocks`` or ``_no_split_modules``."""
    for m in model.modules():
        names = getattr(type(m), "_repeated_blocks", None) or getattr(type(m), "_no_split_modules", None)
        if names:
            return set(names)
    return set()


def find_repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost repeated blocks of a denoiser, in module (registration) order. That is
    execution order for the transformers; for a diffusers U-Net it is not (a stage registers its
    attentions before its resnets, and ``up_blocks`` before ``mid_block``), which is why
    offload=stream works out the execution order itself (``guess_execution_order``) and
    ``checkpoint.blocks.mode=every_n`` counts along this list. The first rule that finds blocks wins:

    1. a U-Net (``down_blocks``/``up_blocks``): each resnet and each attention (Transformer2DModel)
       of the down/mid/up blocks. diffusers' ``_repeated_blocks`` names only
       ``BasicTransformerBlock``, which would leave the resnets (most of a U-Net's activation
       memory) outside every block;
    2. the class names the model declares in ``_repeated_blocks`` / ``_no_split_modules`` (Flux's
       two block classes, SD3's, Wan's), where they sit in an ``nn.ModuleList`` (``_no_split_modules``
       also names one-off modules, such as PixArt's ``PatchEmbed``);
    3. the children of its block lists (:data:`BLOCK_LISTS`: a diffusers ``DiTTransformer2DModel``
       declares nothing but has ``transformer_blocks``);
    4. the children of every ``nn.ModuleList`` (any other model).

    A trainer that knows better names its blocks in ``ModelSet.blocks``; every plugin and the
    planner use those first.
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
    names = _declared_names(base)
    found = outermost(base, lambda m: type(m).__name__ in names) if names else []
    # _no_split_modules also lists one-off modules (PixArt's PatchEmbed): a block sits in a list of blocks.
    listed = {id(child) for m in base.modules() if isinstance(m, nn.ModuleList) for child in m}
    found = [m for m in found if id(m) in listed]
    if found:
        return found
    lists = {id(child) for attr in BLOCK_LISTS
             for lst in [getattr(base, attr, None)] if isinstance(lst, nn.ModuleList) for child in lst}
    if lists:
        return outermost(base, lambda m: id(m) in lists)
    in_lists = {id(child) for m in base.modules() if isinstance(m, nn.ModuleList) for child in m}
    return outermost(base, lambda m: id(m) in in_lists)
