"""A full fine-tune as ONE safetensors file in the original layout (``export.full_format=single_file|both``).

A1111, Forge and ComfyUI load single files, not diffusers folders. This writes the inverse of what
``model.path`` reads (runner/families/common/single_file.py), so the file the export writes is a file the
runner itself reads back, bit for bit (tests/runner/export/test_single_file.py):

* **SDXL**: ``checkpoint.safetensors``, the whole checkpoint in Stability's layout: the U-Net as
  ``model.diffusion_model.*``, the VAE as ``first_stage_model.*``, CLIP-L as
  ``conditioner.embedders.0.transformer.*``, OpenCLIP bigG as ``conditioner.embedders.1.model.*``
  (A1111/Forge ``models/Stable-diffusion``, ComfyUI ``models/checkpoints``);
* **SD1.5**: ``checkpoint.safetensors``, the same with CLIP-L as ``cond_stage_model.transformer.*``
  (the layout of ``v1-5-pruned-emaonly.safetensors``; same folders);
* **Flux**: ``diffusion_model.safetensors``, the transformer alone in Black Forest Labs' layout
  (``double_blocks.N.img_attn.qkv`` with q/k/v fused, ``single_blocks.N.linear1``...), as
  ``flux1-dev.safetensors`` ships (ComfyUI ``models/diffusion_models``, Forge ``models/Stable-diffusion``);
* **SD3.5**, **Wan**, **Qwen-Image**: ``diffusion_model.safetensors``, the transformer alone as ComfyUI's
  ``models/diffusion_models`` files hold it: Stability's MMDiT names (``joint_blocks.N.x_block.attn.qkv``),
  the original Wan names (``blocks.N.self_attn.q``, ``head.head``), and for Qwen-Image diffusers' own
  names, which ComfyUI's model uses (read back by ``model.path`` as a diffusers-key file).

Why the mapping is written here, and how it stays the exact inverse: diffusers converts original ->
diffusers only (its diffusers -> original scripts are not part of the installed package). So the
fixed names come from diffusers' own table ``DIFFUSERS_TO_LDM_MAPPING`` (already diffusers ->
original), the resnet and attention renames are the inverse of the ``replace`` chains of diffusers'
``update_*_ldm_to_diffusers`` (the tables below), the block numbering follows the config; Flux
inverts the ``FLUX_*`` tables the reader converts with, Wan extends the LoRA export's ``WAN_RENAMES``,
and SD3's tables invert diffusers' converter code. Before a byte is written, the result is fed
back through the reader's own converters on ``meta`` tensors (:func:`check_inverse`): a key or shape
that would not read back into the model is an error, never a silently broken file.

Tensors are written in the dtype the models hold (the trained weights' ``model.train_dtype``, the
frozen modules' ``model.dtype``), like the diffusers folder. Not written (refused before step 1,
runner/export/config.py): SD2.1, whose original OpenCLIP-H has a 24th layer the diffusers form drops, so
no file could be checked against what ``model.path`` reads; a trainer of one's own.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runner.trainer import ModelSet

# Inverse of diffusers' update_unet_resnet_ldm_to_diffusers (its replace chain, diffusers -> original).
UNET_RESNET = (("norm1.", "in_layers.0."), ("conv1.", "in_layers.2."), ("norm2.", "out_layers.0."),
               ("conv2.", "out_layers.3."), ("time_emb_proj.", "emb_layers.1."), ("conv_shortcut.", "skip_connection."))
# Inverse of update_vae_attentions_ldm_to_diffusers; the VAE's resnets only rename conv_shortcut.
VAE_ATTENTION = (("group_norm.", "norm."), ("to_q.", "q."), ("to_k.", "k."), ("to_v.", "v."), ("to_out.0.", "proj_out."))
# Inverse of convert_open_clip_checkpoint's DIFFUSERS_TO_LDM_MAPPING["openclip"]["transformer"] renames.
OPEN_CLIP_LAYER = (("layer_norm1.", "ln_1."), ("layer_norm2.", "ln_2."), ("mlp.fc1.", "mlp.c_fc."),
                   ("mlp.fc2.", "mlp.c_proj."), ("self_attn.out_proj.", "attn.out_proj."))

SD_PREFIXES = {"unet": "model.diffusion_model.", "vae": "first_stage_model.", "text_encoder": "cond_stage_model.transformer."}
SDXL_PREFIXES = {"unet": "model.diffusion_model.", "vae": "first_stage_model.",
                 "text_encoder": "conditioner.embedders.0.transformer.", "text_encoder_2": "conditioner.embedders.1.model."}


class LazyCat:
    """Tensors fused along dim 0 (q/k/v, Flux's linear1) only when the file is written, one at a time.

    Why: in Flux and SD3 most of the weights are fused, so concatenating them up front would hold a
    second copy of nearly the whole transformer (tens of GB for a full-size model in float32). The
    shape and dtype are known without it, which is all the header and :func:`check_inverse` need."""

    def __init__(self, parts: tuple[torch.Tensor, ...]) -> None:
        self.parts = parts
        self.shape = torch.Size([sum(int(p.shape[0]) for p in parts), *parts[0].shape[1:]])
        self.dtype = parts[0].dtype

    def materialize(self) -> torch.Tensor:
        return torch.cat(self.parts, dim=0)


_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def save_lazily(state: dict[str, Any], path: Path, metadata: dict[str, str]) -> None:
    """A safetensors file of ``state`` (tensors or :class:`LazyCat`), each tensor made, moved to the CPU and
    written in turn: the header from shapes first, then the data in the header's order.

    ``safetensors.torch.save_file`` needs every tensor at once, contiguous and on the CPU; this keeps the
    extra host memory to one tensor (the models may sit on the GPU). The format: an 8-byte little-endian
    header length, the JSON header (``__metadata__``, then dtype, shape and data offsets per tensor),
    padded to 8 bytes, then the data; read back by safetensors' own reader in the tests."""
    import json
    import struct

    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    keys = sorted(state)
    for key in keys:
        value = state[key]
        size = int(torch.Size(value.shape).numel()) * torch.empty((), dtype=value.dtype).element_size()
        header[key] = {"dtype": _DTYPE_NAMES[value.dtype], "shape": list(value.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for key in keys:
            value = state[key]
            tensor = value.materialize() if isinstance(value, LazyCat) else value
            f.write(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor


def _rename(key: str, pairs: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> str | None:
    """``key`` with the first matching prefix of ``pairs`` replaced; None when none matches."""
    for new, old in pairs:
        if key.startswith(new):
            return old + key[len(new):]
    return None


def unet_prefixes(config: Any) -> list[tuple[str, str]]:
    """(diffusers prefix, original prefix) of every block of a UNet2DConditionModel, from its config:
    the numbering convert_ldm_unet_checkpoint reads (input_blocks: resnet .0, attention .1, a
    downsampler alone as .0.op; output_blocks: the upsampler .1 without attention, .2 with)."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    fixed = {**DIFFUSERS_TO_LDM_MAPPING["unet"]["layers"], **DIFFUSERS_TO_LDM_MAPPING["unet"]["addition_embed_type"]}
    pairs = sorted({(k.rsplit(".", 1)[0] + ".", v.rsplit(".", 1)[0] + ".") for k, v in fixed.items()})
    pairs += [("mid_block.resnets.0.", "middle_block.0."), ("mid_block.attentions.0.", "middle_block.1."),
              ("mid_block.resnets.1.", "middle_block.2.")]
    n, per = len(config["block_out_channels"]), int(config["layers_per_block"])
    for i in range(n):
        for j in range(per):
            pairs += [(f"down_blocks.{i}.resnets.{j}.", f"input_blocks.{(per + 1) * i + j + 1}.0."),
                      (f"down_blocks.{i}.attentions.{j}.", f"input_blocks.{(per + 1) * i + j + 1}.1.")]
        if i < n - 1:
            pairs.append((f"down_blocks.{i}.downsamplers.0.conv.", f"input_blocks.{(per + 1) * (i + 1)}.0.op."))
        for j in range(per + 1):
            pairs += [(f"up_blocks.{i}.resnets.{j}.", f"output_blocks.{(per + 1) * i + j}.0."),
                      (f"up_blocks.{i}.attentions.{j}.", f"output_blocks.{(per + 1) * i + j}.1.")]
        if i < n - 1:
            slot = 2 if "CrossAttn" in str(config["up_block_types"][i]) else 1
            pairs.append((f"up_blocks.{i}.upsamplers.0.", f"output_blocks.{(per + 1) * i + per}.{slot}."))
    return sorted(pairs, key=lambda p: -len(p[0]))  # the longest prefix first: resnets.1 before resnets.10


def unet_to_original(state: dict[str, torch.Tensor], config: Any, prefix: str) -> dict[str, torch.Tensor]:
    pairs = unet_prefixes(config)
    out = {}
    for key, value in state.items():
        for new, old in pairs:
            if key.startswith(new):
                rest = key[len(new):]
                if ".resnets." in new or new.startswith("mid_block.resnets"):
                    rest = _rename(rest, UNET_RESNET) or rest
                out[prefix + old + rest] = value
                break
        else:
            raise ValueError(f"no original U-Net name is known for {key!r}")
    return out


def vae_to_original(state: dict[str, torch.Tensor], config: Any, prefix: str) -> dict[str, torch.Tensor]:
    """AutoencoderKL -> the LDM VAE: decoder blocks numbered from the top, attention as 1x1 convs."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    n = len(config["block_out_channels"])
    pairs = [(k.rsplit(".", 1)[0] + ".", v.rsplit(".", 1)[0] + ".") for k, v in DIFFUSERS_TO_LDM_MAPPING["vae"].items()]
    for part in ("encoder", "decoder"):
        pairs += [(f"{part}.mid_block.resnets.{k}.", f"{part}.mid.block_{k + 1}.") for k in range(2)]
        pairs.append((f"{part}.mid_block.attentions.0.", f"{part}.mid.attn_1."))
    for i in range(n):
        pairs += [(f"encoder.down_blocks.{i}.resnets.", f"encoder.down.{i}.block."),
                  (f"encoder.down_blocks.{i}.downsamplers.0.", f"encoder.down.{i}.downsample."),
                  (f"decoder.up_blocks.{i}.resnets.", f"decoder.up.{n - 1 - i}.block."),
                  (f"decoder.up_blocks.{i}.upsamplers.0.", f"decoder.up.{n - 1 - i}.upsample.")]
    pairs.sort(key=lambda p: -len(p[0]))
    out = {}
    for key, value in state.items():
        new = _rename(key, pairs)
        if new is None:
            raise ValueError(f"no original VAE name is known for {key!r}")
        new = new.replace(".conv_shortcut.", ".nin_shortcut.")
        if ".mid.attn_1." in new:
            head, rest = new.split(".mid.attn_1.")
            new = f"{head}.mid.attn_1.{_rename(rest, VAE_ATTENTION) or rest}"
            if value.ndim == 2:  # the reader takes [:, :, 0, 0] of the original 1x1 conv
                value = value.reshape(*value.shape, 1, 1)
        out[prefix + new] = value
    return out


def clip_to_original(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """CLIP-L keeps transformers' names under ``prefix`` (convert_ldm_clip_checkpoint strips it);
    transformers >= 5.6 builds it without ``text_model.``, which the original file has."""
    return {prefix + (k if k.startswith(("text_model.", "text_projection")) else "text_model." + k): v
            for k, v in state.items()}


def open_clip_to_original(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """CLIPTextModelWithProjection -> OpenCLIP's text tower: q/k/v fused as ``in_proj``, the
    projection transposed (the inverse of convert_open_clip_checkpoint)."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    fixed = DIFFUSERS_TO_LDM_MAPPING["openclip"]["layers"]
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        full = key if key.startswith(("text_model.", "text_projection")) else "text_model." + key
        if full in fixed:
            out[prefix + fixed[full]] = value.T.contiguous() if fixed[full] == "text_projection" else value
        elif full.startswith("text_model.encoder.layers."):
            i, rest = full.removeprefix("text_model.encoder.layers.").split(".", 1)
            block = f"{prefix}transformer.resblocks.{i}."
            if rest.startswith(("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.")):
                _, proj, kind = rest.split(".")
                fused.setdefault(f"{block}attn.in_proj_{kind}", {})[proj[0]] = value
            else:
                out[block + (_rename(rest, OPEN_CLIP_LAYER) or rest)] = value
        elif not full.endswith("position_ids"):
            raise ValueError(f"no original OpenCLIP name is known for {key!r}")
    for key, qkv in fused.items():
        out[key] = LazyCat((qkv["q"], qkv["k"], qkv["v"]))
    return out


def flux_to_original(state: dict[str, torch.Tensor], config: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """FluxTransformer2DModel -> BFL's layout: the reader's ``FLUX_*`` tables inverted, q/k/v(/mlp) fused."""
    from runner.families.common import single_file as sf

    src, out = dict(state), {}

    def move(new: str, old: str) -> None:
        for suffix in ("weight", "bias"):
            if f"{new}.{suffix}" in src:
                out[f"{prefix}{old}.{suffix}"] = src.pop(f"{new}.{suffix}")

    def fuse(news: tuple[str, ...], old: str) -> None:
        for suffix in ("weight", "bias"):
            out[f"{prefix}{old}.{suffix}"] = LazyCat(tuple(src.pop(f"{n}.{suffix}") for n in news))

    for new, old in sf.FLUX_RENAMES:
        move(new, old)
    for new, old in sf.FLUX_SWAPPED:
        for suffix in ("weight", "bias"):
            scale, shift = src.pop(f"{new}.{suffix}").chunk(2, dim=0)
            out[f"{prefix}{old}.{suffix}"] = torch.cat([shift, scale], dim=0)
    for i in range(int(config["num_layers"])):
        b, o = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for new, old in sf.FLUX_DOUBLE_RENAMES:
            move(b + new, o + old)
        for news, old in sf.FLUX_DOUBLE_FUSED:
            fuse(tuple(b + n for n in news), o + old)
        for new, old in sf.FLUX_DOUBLE_NORMS:
            out[f"{prefix}{o}{old}.scale"] = src.pop(f"{b}{new}.weight")
    for i in range(int(config["num_single_layers"])):
        b, o = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for new, old in sf.FLUX_SINGLE_RENAMES:
            move(b + new, o + old)
        news, old = sf.FLUX_SINGLE_FUSED
        fuse(tuple(b + n for n in news), o + old)
        for new, old in sf.FLUX_SINGLE_NORMS:
            out[f"{prefix}{o}{old}.scale"] = src.pop(f"{b}{new}.weight")
    if src:
        raise ValueError(f"no original Flux name is known for {sorted(src)[:3]}")
    return out


# SD3/SD3.5, (diffusers, original): the inverse of diffusers' convert_sd3_transformer_checkpoint_to_diffusers,
# which is code, not a table, so it is written out here; check_inverse runs that converter over the result.
SD3_RENAMES = (("pos_embed.proj", "x_embedder.proj"), ("time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
               ("time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"), ("context_embedder", "context_embedder"),
               ("time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0"),
               ("time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2"), ("proj_out", "final_layer.linear"))
SD3_BLOCK_RENAMES = (("attn.norm_q", "x_block.attn.ln_q"), ("attn.norm_k", "x_block.attn.ln_k"),
                     ("attn.norm_added_q", "context_block.attn.ln_q"), ("attn.norm_added_k", "context_block.attn.ln_k"),
                     ("attn2.norm_q", "x_block.attn2.ln_q"), ("attn2.norm_k", "x_block.attn2.ln_k"),
                     ("attn.to_out.0", "x_block.attn.proj"), ("attn.to_add_out", "context_block.attn.proj"),
                     ("attn2.to_out.0", "x_block.attn2.proj"), ("norm1.linear", "x_block.adaLN_modulation.1"),
                     ("ff.net.0.proj", "x_block.mlp.fc1"), ("ff.net.2", "x_block.mlp.fc2"),
                     ("ff_context.net.0.proj", "context_block.mlp.fc1"), ("ff_context.net.2", "context_block.mlp.fc2"))
SD3_BLOCK_FUSED = ((("attn.to_q", "attn.to_k", "attn.to_v"), "x_block.attn.qkv"),
                   (("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "context_block.attn.qkv"),
                   (("attn2.to_q", "attn2.to_k", "attn2.to_v"), "x_block.attn2.qkv"))


def _shift_scale(t: torch.Tensor) -> torch.Tensor:
    """diffusers' (scale, shift) halves as the original's (shift, scale): the inverse of its swap_scale_shift."""
    scale, shift = t.chunk(2, dim=0)
    return torch.cat([shift, scale], dim=0)


def sd3_to_original(state: dict[str, torch.Tensor], config: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """SD3Transformer2DModel -> Stability's MMDiT layout (``joint_blocks.N.x_block.attn.qkv`` ...).
    The last block is context-pre-only: its context modulation is swapped like ``final_layer``'s."""
    src, out = dict(state), {}

    def move(new: str, old: str, swap: bool = False) -> None:
        for suffix in ("weight", "bias"):
            if f"{new}.{suffix}" in src:
                value = src.pop(f"{new}.{suffix}")
                out[f"{prefix}{old}.{suffix}"] = _shift_scale(value) if swap else value

    if "pos_embed.pos_embed" in src:
        out[prefix + "pos_embed"] = src.pop("pos_embed.pos_embed")
    for new, old in SD3_RENAMES:
        move(new, old)
    move("norm_out.linear", "final_layer.adaLN_modulation.1", swap=True)
    layers = int(config["num_layers"])
    for i in range(layers):
        b, o = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
        for new, old in SD3_BLOCK_RENAMES:
            move(b + new, o + old)
        move(b + "norm1_context.linear", o + "context_block.adaLN_modulation.1", swap=i == layers - 1)
        for news, old in SD3_BLOCK_FUSED:
            for suffix in ("weight", "bias"):
                if f"{b}{news[0]}.{suffix}" in src:
                    out[f"{prefix}{o}{old}.{suffix}"] = LazyCat(tuple(src.pop(f"{b}{n}.{suffix}") for n in news))
    if src:
        raise ValueError(f"no original SD3 name is known for {sorted(src)[:3]}")
    return out


def wan_renames() -> tuple[tuple[str, str], ...]:
    """(diffusers module regex, original Wan module) of every weight: the LoRA export's WAN_RENAMES (the linear
    modules, runner/export/comfy.py) and the norms; the inverse of diffusers' convert_wan_transformer_to_diffusers
    rename chain (its norm2/norm3 swap included), checked by running it in check_inverse."""
    from runner.export.comfy import WAN_RENAMES

    return WAN_RENAMES + (
        (r"blocks\.(\d+)\.attn1\.norm_q", r"blocks.\1.self_attn.norm_q"),
        (r"blocks\.(\d+)\.attn1\.norm_k", r"blocks.\1.self_attn.norm_k"),
        (r"blocks\.(\d+)\.attn2\.norm_q", r"blocks.\1.cross_attn.norm_q"),
        (r"blocks\.(\d+)\.attn2\.norm_k", r"blocks.\1.cross_attn.norm_k"),
        (r"blocks\.(\d+)\.attn2\.norm_added_k", r"blocks.\1.cross_attn.norm_k_img"),
        (r"blocks\.(\d+)\.norm2", r"blocks.\1.norm3"), (r"blocks\.(\d+)\.norm3", r"blocks.\1.norm2"),
        (r"condition_embedder\.image_embedder\.norm1", "img_emb.proj.0"),
        (r"condition_embedder\.image_embedder\.norm2", "img_emb.proj.4"),
        (r"blocks\.(\d+)\.scale_shift_table", r"blocks.\1.modulation"), (r"scale_shift_table", "head.modulation"),
    )


def wan_to_original(state: dict[str, torch.Tensor], config: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """WanTransformer3DModel -> the original Wan names (renames only: no tensor changes)."""
    import re

    renames = [(re.compile(a), b) for a, b in wan_renames()]
    out = {}
    for key, value in state.items():
        for module, param in ((key, ""), *([tuple(key.rsplit(".", 1))] if "." in key else [])):
            new = next((rx.sub(b, module) for rx, b in renames if rx.fullmatch(module)), None)
            if new is not None:
                out[prefix + new + ("." + param if param else "")] = value
                break
        else:
            raise ValueError(f"no original Wan name is known for {key!r}")
    return out


# diffusers' ZImageTransformer2DModel name -> the original Z-Image one (the inverse of diffusers'
# convert_z_image_transformer_checkpoint_to_diffusers, which reads the file back in check_inverse).
Z_IMAGE_RENAMES = (("all_x_embedder.2-1.", "x_embedder."), ("all_final_layer.2-1.", "final_layer."),
                   (".attention.to_out.0.", ".attention.out."), (".attention.norm_q.", ".attention.q_norm."),
                   (".attention.norm_k.", ".attention.k_norm."))


def z_image_to_original(state: dict[str, torch.Tensor], config: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """ZImageTransformer2DModel -> the original Z-Image layout (ComfyUI's diffusion_models file): renames,
    and each attention's to_q/to_k/to_v fused row-wise into ``attention.qkv`` (lazily, see :class:`LazyCat`)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue  # fused with to_q's below
        if ".attention.to_q." in key:
            out[prefix + key.replace(".to_q.", ".qkv.")] = LazyCat(tuple(state[key.replace(".to_q.", f".to_{x}.")]
                                                                      for x in "qkv"))
            continue
        for new, old in Z_IMAGE_RENAMES:
            key = key.replace(new, old)
        out[prefix + key] = value
    return out


# ---- families -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SingleFile:
    """What one family writes: the file, where users put it, and each module's converter."""

    file: str
    where: str
    modules: dict[str, Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]]
    diffusers_keys: bool = False  # the ecosystem's names are diffusers' own: model.path reads it as such a file

    def ema_file(self) -> str:
        return self.file.replace(".safetensors", "_ema.safetensors")


FAMILIES: dict[str, SingleFile] = {
    "sdxl": SingleFile("checkpoint.safetensors", "A1111/Forge models/Stable-diffusion, ComfyUI models/checkpoints", {
        "unet": lambda s, c: unet_to_original(s, c, SDXL_PREFIXES["unet"]),
        "vae": lambda s, c: vae_to_original(s, c, SDXL_PREFIXES["vae"]),
        "text_encoder": lambda s, c: clip_to_original(s, SDXL_PREFIXES["text_encoder"]),
        "text_encoder_2": lambda s, c: open_clip_to_original(s, SDXL_PREFIXES["text_encoder_2"]),
    }),
    "sd": SingleFile("checkpoint.safetensors", "A1111/Forge models/Stable-diffusion, ComfyUI models/checkpoints", {
        "unet": lambda s, c: unet_to_original(s, c, SD_PREFIXES["unet"]),
        "vae": lambda s, c: vae_to_original(s, c, SD_PREFIXES["vae"]),
        "text_encoder": lambda s, c: clip_to_original(s, SD_PREFIXES["text_encoder"]),
    }),
    "sd3": SingleFile("diffusion_model.safetensors", "ComfyUI models/diffusion_models, Forge models/Stable-diffusion",
                      {"transformer": sd3_to_original}),
    # ComfyUI's Qwen-Image model names its modules as diffusers does (comfy/ldm/qwen_image), and so do the
    # Comfy-Org diffusion_models files: the transformer's own state dict, no renaming.
    "qwen_image": SingleFile("diffusion_model.safetensors", "ComfyUI models/diffusion_models",
                             {"transformer": lambda s, c: dict(s)}, diffusers_keys=True),
    "wan": SingleFile("diffusion_model.safetensors", "ComfyUI models/diffusion_models", {"transformer": wan_to_original}),
    "flux": SingleFile("diffusion_model.safetensors", "ComfyUI models/diffusion_models, Forge models/Stable-diffusion",
                       {"transformer": flux_to_original}),
    "z_image": SingleFile("diffusion_model.safetensors", "ComfyUI models/diffusion_models",
                          {"transformer": z_image_to_original}),
}


def _config(module: Any) -> Any:
    return getattr(module, "config", None) or {}


def original_state_dict(family: str, models: ModelSet) -> dict[str, torch.Tensor]:
    """``models`` (the modules the family's file holds) as one original-layout state dict: views of the
    weights where names only change, :class:`LazyCat` where tensors are fused."""
    out: dict[str, torch.Tensor] = {}
    for name, convert in FAMILIES[family].modules.items():
        out.update(convert(models[name].state_dict(), _config(models[name])))
    return out


def check_inverse(family: str, models: ModelSet, state: dict[str, torch.Tensor]) -> None:
    """Convert ``state``'s shapes back with the reader's own converters (on ``meta``, no data) and
    compare with each module: a ValueError when the file would not read back into the models."""
    from runner.families.common.single_file import LAYOUTS
    from runner.families.common.single_file_load import _drop_buffers, _shape_report

    spec = FAMILIES[family]
    layout = None if spec.diffusers_keys else next(lay for lay in LAYOUTS if lay.family == family)
    for name in spec.modules:
        model = models[name]
        if layout is None:  # read back by key name (runner/families/common/loading.py: load_single_file)
            back = dict(state)
        else:
            component = layout.components[name]
            meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()
                    if k.startswith(component.prefixes)}
            back = _drop_buffers(component.convert(meta, _config(model), model), model)
        problems = _shape_report({k: tuple(v.shape) for k, v in back.items()},
                                 {k: tuple(v.shape) for k, v in model.state_dict().items()})
        if problems:
            raise ValueError(f"the single-file export of {name} would not read back: {'; '.join(problems)}")


def write_single_file(family: str, models: ModelSet, folder: Path, info: dict[str, Any], ema: bool = False) -> Path:
    """``folder/<family's file>`` (``*_ema`` with ``ema``); ``info`` becomes plain string metadata."""
    spec = FAMILIES[family]
    state = original_state_dict(family, models)
    check_inverse(family, models, state)
    meta = {"format": "pt", "weights": "ema" if ema else "trained", "layout": family, "load_in": spec.where,
            **{k: "" if info.get(k) is None else str(info[k]) for k in ("base_model", "preset", "step", "trainer",
                                                                        "pipeline")}}
    path = folder / (spec.ema_file() if ema else spec.file)
    save_lazily(state, path, meta)
    return path
