"""Loading one module of an original-layout single file, and what a trainer needs from such a file besides
its modules (the layout check before any weight is read, the tokenizers it lacks).

The layouts and their converters are in runner/families/common/single_file.py; reading in
runner/families/common/safetensors_read.py.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from runner.errors import UserError
from runner.families.common.safetensors_read import read_header, read_tensors
from runner.families.common.single_file import Layout, detect_layout

log = logging.getLogger("runner")


def _shape_report(converted: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> list[str]:
    missing = sorted(set(expected) - set(converted))
    unexpected = sorted(set(converted) - set(expected))
    wrong = sorted(k for k in set(expected) & set(converted) if tuple(expected[k]) != tuple(converted[k]))
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing keys (e.g. {', '.join(missing[:3])})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys (e.g. {', '.join(unexpected[:3])})")
    if wrong:
        k = wrong[0]
        parts.append(f"{len(wrong)} tensors of another shape (e.g. {k}: file {list(converted[k])}, "
                     f"model {list(expected[k])})")
    return parts


def _drop_buffers(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """Converted keys that are non-persistent buffers of the model (CLIP's ``position_ids``) are dropped."""
    persistent = set(model.state_dict())
    return {k: v for k, v in state.items() if k in persistent or not k.endswith("position_ids")}


def check_component(file: str, header: dict[str, tuple[tuple[int, ...], torch.dtype]], layout: Layout, name: str,
                    model: nn.Module, config: dict, source: str) -> None:
    """Convert the header's shapes on ``meta`` and compare with ``model``: a UserError naming the
    file when the keys or shapes do not match, before any tensor is read."""
    component = layout.components[name]
    meta = {k: torch.empty(header[k][0], dtype=header[k][1], device="meta") for k in component.keys(header)}
    try:
        converted = _drop_buffers(component.convert(meta, config, model), model)
    except (KeyError, IndexError, RuntimeError, ValueError) as e:
        raise UserError(
            f"model.path '{file}' looks like {layout.name} but its {name} cannot be converted ({type(e).__name__}: "
            f"{e}); is the file complete?"
        ) from None
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = _shape_report({k: tuple(v.shape) for k, v in converted.items()}, expected)
    if problems:
        hint = (" The file's tensors are larger than the model's: set model.size=full." if "model.size=tiny" in source
                else "")
        raise UserError(
            f"model.path '{file}' ({layout.name}): its {name} does not match the {type(model).__name__} of {source}: "
            f"{'; '.join(problems)}.{hint}"
        )


def load_component(file: str, header: dict[str, tuple[tuple[int, ...], torch.dtype]], layout: Layout, name: str,
                   cls: type, config: dict, dtype: torch.dtype, device: str, source: str) -> nn.Module:
    """Module ``name`` of an original-layout ``file``: built on meta, checked, then (unless
    ``device`` is meta) read lazily in ``dtype``, converted and adopted."""
    from accelerate import init_empty_weights

    from runner.families.common.loading import _instantiate, build_module, cast_module

    if torch.device(device).type == "meta":
        model = build_module(cls, config, "meta", dtype)
        check_component(file, header, layout, name, model, config, source)
        return model
    with init_empty_weights(include_buffers=False):
        model = _instantiate(cls, config)
    check_component(file, header, layout, name, model, config, source)
    keep_fp32 = dtype == torch.float16 and bool(getattr(cls, "_keep_in_fp32_modules", None))
    state = read_tensors(file, layout.components[name].keys(header), torch.float32 if keep_fp32 else dtype)
    converted = _drop_buffers(layout.components[name].convert(state, config, model), model)
    del state
    model.load_state_dict(converted, strict=True, assign=True)
    del converted
    if callable(getattr(model, "tie_weights", None)):  # assign=True replaced tied parameters one by one
        model.tie_weights()
    return cast_module(model, dtype)


# ---- what a trainer needs from an original file besides its modules -------------------------------
def open_single_file(trainer: Any, file: str) -> tuple[Layout | None, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """Read the header, recognise the layout, refuse another family's file, and check that the
    tokenizers its text encoders need are at hand, all before any weight is read. Returns the
    layout (None: diffusers' key layout) and the header."""
    from runner.families.common.loading import SAFETENSORS_ACCEPTED

    header = read_header(file)
    layout = detect_layout(list(header))
    trainer.layout, trainer.header = layout, header
    if layout is None:
        return None, header
    if layout.family != trainer.family:
        raise UserError(
            f"model.path '{file}' is in {layout.name}, which is not a {trainer.family} checkpoint; choose the "
            f"trainer of its family (trainer=...) or a {trainer.family} file. Accepted: {SAFETENSORS_ACCEPTED}."
        )
    unread = sorted({p for k in header for p in layout.unread if k.startswith(p)})
    if unread:
        raise UserError(
            f"model.path '{file}' is in {layout.name} and also holds {', '.join(p + '*' for p in unread)}, which the "
            f"runner does not read from such a file yet (it would train on random ones instead). Give the "
            f"{trainer.denoiser} alone (ComfyUI's diffusion_models file) or a diffusers folder."
        )
    found = [n for n in trainer.module_classes() if trainer.file_provides(n)]
    log.info("model.path: %s in %s (%s)", ", ".join(found), layout.name, file)
    for name in found:
        if name.startswith("text_encoder"):
            trainer.tokenizer(name.replace("text_encoder", "tokenizer"))
    return layout, header


def reference_tokenizer(trainer: Any, name: str) -> Any:
    """An original single file holds no tokenizers: ``trainer.reference_repo``'s ``name/`` from the
    local hub cache. Without it a full-size encoder is refused (byte-level ids would be meaningless
    to it); a tiny one keeps the generated tokenizer, which is what it was built with."""
    import os

    from runner.families.common.hub import cached_subfolder, fetch_command
    from runner.families.common.tokenizers import load_folder_tokenizer

    folder = cached_subfolder(trainer.reference_repo, name) if trainer.reference_repo else None
    if folder is not None:
        return load_folder_tokenizer(os.path.dirname(folder), name)
    if trainer.size == "tiny":
        return trainer.default_tokenizer(name)
    tokenizers = tuple(f"{n}/*" for n in ("tokenizer", "tokenizer_2")
                       if trainer.file_provides(n.replace("tokenizer", "text_encoder")))
    raise UserError(
        f"model.path '{trainer.source[1]}' holds the text encoders but not their tokenizers, and "
        f"{trainer.reference_repo}'s {name}/ is not in the local Hugging Face cache. Fetch the tokenizers (a few MB) "
        f"with `{fetch_command(trainer.reference_repo, include=tokenizers)}`, or give a diffusers folder instead."
    )
