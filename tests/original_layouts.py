"""Write diffusers modules as the original single-file checkpoints people download (test helper).

Not a test module: tests and bench/load_memory.py import it. The mappings are written here from
the documented original key layouts (Stability's generative-models / A1111 layout for SDXL, as in
diffusers' scripts/convert_diffusers_to_original_sdxl.py; OpenCLIP's text tower; Black Forest
Labs' flux repository), independently of the forward conversion under test
(runner/families/common/single_file.py, which uses diffusers' converters), so a round trip that gives
back the source weights checks both.

Every function works on ``meta`` tensors too (the bench writes a full-size header from shapes).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import torch

# ---- SDXL U-Net ---------------------------------------------------------------------------------
_RESNET = [("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("norm2", "out_layers.0"), ("conv2", "out_layers.3"),
           ("time_emb_proj", "emb_layers.1"), ("conv_shortcut", "skip_connection")]


def unet_prefix_map(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(diffusers prefix, original prefix) pairs of a UNet2DConditionModel config."""
    n, per = len(config["block_out_channels"]), int(config["layers_per_block"])
    pairs = [("time_embedding.linear_1.", "time_embed.0."), ("time_embedding.linear_2.", "time_embed.2."),
             ("add_embedding.linear_1.", "label_emb.0.0."), ("add_embedding.linear_2.", "label_emb.0.2."),
             ("conv_in.", "input_blocks.0.0."), ("conv_norm_out.", "out.0."), ("conv_out.", "out.2."),
             ("mid_block.resnets.0.", "middle_block.0."), ("mid_block.attentions.0.", "middle_block.1."),
             ("mid_block.resnets.1.", "middle_block.2.")]
    for i in range(n):
        for j in range(per):
            pairs.append((f"down_blocks.{i}.resnets.{j}.", f"input_blocks.{(per + 1) * i + j + 1}.0."))
            pairs.append((f"down_blocks.{i}.attentions.{j}.", f"input_blocks.{(per + 1) * i + j + 1}.1."))
        if i < n - 1:
            pairs.append((f"down_blocks.{i}.downsamplers.0.conv.", f"input_blocks.{(per + 1) * (i + 1)}.0.op."))
        up_has_attention = "CrossAttn" in config["up_block_types"][i]
        for j in range(per + 1):
            pairs.append((f"up_blocks.{i}.resnets.{j}.", f"output_blocks.{(per + 1) * i + j}.0."))
            pairs.append((f"up_blocks.{i}.attentions.{j}.", f"output_blocks.{(per + 1) * i + j}.1."))
        if i < n - 1:
            pairs.append((f"up_blocks.{i}.upsamplers.0.", f"output_blocks.{(per + 1) * i + per}.{2 if up_has_attention else 1}."))
    return pairs


def unet_to_original(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    pairs = sorted(unet_prefix_map(config), key=lambda p: -len(p[0]))
    out = {}
    for key, value in state.items():
        new = None
        for hf, sd in pairs:
            if key.startswith(hf):
                rest = key[len(hf):]
                if ".resnets." in hf:
                    for a, b in _RESNET:
                        if rest.startswith(a + "."):
                            rest = b + rest[len(a):]
                new = sd + rest
                break
        assert new is not None, key
        out["model.diffusion_model." + new] = value
    return out


# ---- VAE ----------------------------------------------------------------------------------------
def vae_to_original(state: dict[str, torch.Tensor], config: dict[str, Any], prefix: str = "first_stage_model.") -> dict:
    n = len(config["block_out_channels"])
    pairs = [("encoder.conv_norm_out.", "encoder.norm_out."), ("decoder.conv_norm_out.", "decoder.norm_out.")]
    for part in ("encoder", "decoder"):
        pairs += [(f"{part}.mid_block.resnets.{k}.", f"{part}.mid.block_{k + 1}.") for k in range(2)]
        pairs += [(f"{part}.mid_block.attentions.0.", f"{part}.mid.attn_1.")]
    for i in range(n):
        pairs.append((f"encoder.down_blocks.{i}.resnets.", f"encoder.down.{i}.block."))
        pairs.append((f"encoder.down_blocks.{i}.downsamplers.0.", f"encoder.down.{i}.downsample."))
        pairs.append((f"decoder.up_blocks.{i}.resnets.", f"decoder.up.{n - 1 - i}.block."))
        pairs.append((f"decoder.up_blocks.{i}.upsamplers.0.", f"decoder.up.{n - 1 - i}.upsample."))
    attention = {"group_norm.": "norm.", "to_q.": "q.", "to_k.": "k.", "to_v.": "v.", "to_out.0.": "proj_out."}
    out = {}
    for key, value in state.items():
        new = key
        for hf, sd in pairs:
            if key.startswith(hf):
                new = sd + key[len(hf):]
                break
        new = new.replace("conv_shortcut.", "nin_shortcut.")
        if ".mid.attn_1." in new:
            head, rest = new.split(".mid.attn_1.")
            for a, b in attention.items():
                if rest.startswith(a):
                    rest = b + rest[len(a):]
            new = f"{head}.mid.attn_1.{rest}"
            if rest.endswith("weight") and value.ndim == 2:  # linear -> 1x1 conv
                value = value.reshape(*value.shape, 1, 1)
        out[prefix + new] = value
    return out


# ---- CLIP text encoders ---------------------------------------------------------------------------
def clip_to_original(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """HF CLIP-L text model -> ``prefix`` + its ``text_model.*`` keys (transformers' own names)."""
    return {prefix + (k if k.startswith(("text_model.", "text_projection")) else "text_model." + k): v
            for k, v in state.items()}


def open_clip_to_original(state: dict[str, torch.Tensor], prefix: str = "conditioner.embedders.1.model.") -> dict:
    """HF CLIPTextModelWithProjection -> OpenCLIP's text tower (fused in_proj, transposed projection)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    names = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
             "self_attn.out_proj": "attn.out_proj"}
    for key, value in state.items():
        k = key.removeprefix("text_model.")
        if k == "embeddings.token_embedding.weight":
            out[prefix + "token_embedding.weight"] = value
        elif k == "embeddings.position_embedding.weight":
            out[prefix + "positional_embedding"] = value
        elif k.startswith("final_layer_norm."):
            out[prefix + "ln_final." + k.split(".")[-1]] = value
        elif key == "text_projection.weight":
            out[prefix + "text_projection"] = value.T.contiguous()
        elif k.startswith("encoder.layers."):
            _, _, i, rest = k.split(".", 3)
            block = f"{prefix}transformer.resblocks.{i}."
            if rest.startswith(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")):
                which, kind = rest.split(".")[1][0], rest.split(".")[-1]
                fused.setdefault(f"{block}attn.in_proj_{kind}", {})[which] = value
                continue
            for a, b in names.items():
                if rest.startswith(a + "."):
                    rest = b + rest[len(a):]
            out[block + rest] = value
        elif k.endswith("position_ids"):
            continue
        else:
            raise AssertionError(key)
    for key, qkv in fused.items():
        out[key] = torch.cat([qkv["q"], qkv["k"], qkv["v"]], dim=0)
    return out


# ---- Flux (Black Forest Labs' layout) -----------------------------------------------------------------
def flux_to_original(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    s = dict(state)

    def take(old: str, new: str) -> None:
        for suffix in ("weight", "bias"):
            if f"{old}.{suffix}" in s:
                out[f"{prefix}{new}.{suffix}"] = s.pop(f"{old}.{suffix}")

    def fuse(olds: list[str], new: str) -> None:
        for suffix in ("weight", "bias"):
            out[f"{prefix}{new}.{suffix}"] = torch.cat([s.pop(f"{o}.{suffix}") for o in olds], dim=0)

    for old, new in (("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
                     ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
                     ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
                     ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
                     ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
                     ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
                     ("context_embedder", "txt_in"), ("x_embedder", "img_in"), ("proj_out", "final_layer.linear")):
        take(old, new)
    for suffix in ("weight", "bias"):  # diffusers (scale, shift) -> BFL (shift, scale)
        scale, shift = s.pop(f"norm_out.linear.{suffix}").chunk(2, dim=0)
        out[f"{prefix}final_layer.adaLN_modulation.1.{suffix}"] = torch.cat([shift, scale], dim=0)
    blocks = sorted({int(k.split(".")[1]) for k in s if k.startswith("transformer_blocks.")})
    for i in blocks:
        b, o = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        take(b + "norm1.linear", o + "img_mod.lin")
        take(b + "norm1_context.linear", o + "txt_mod.lin")
        fuse([b + "attn.to_q", b + "attn.to_k", b + "attn.to_v"], o + "img_attn.qkv")
        fuse([b + "attn.add_q_proj", b + "attn.add_k_proj", b + "attn.add_v_proj"], o + "txt_attn.qkv")
        for new, old in (("img_attn.norm.query_norm", "attn.norm_q"), ("img_attn.norm.key_norm", "attn.norm_k"),
                         ("txt_attn.norm.query_norm", "attn.norm_added_q"), ("txt_attn.norm.key_norm", "attn.norm_added_k")):
            out[f"{prefix}{o}{new}.scale"] = s.pop(f"{b}{old}.weight")
        take(b + "ff.net.0.proj", o + "img_mlp.0")
        take(b + "ff.net.2", o + "img_mlp.2")
        take(b + "ff_context.net.0.proj", o + "txt_mlp.0")
        take(b + "ff_context.net.2", o + "txt_mlp.2")
        take(b + "attn.to_out.0", o + "img_attn.proj")
        take(b + "attn.to_add_out", o + "txt_attn.proj")
    singles = sorted({int(k.split(".")[1]) for k in s if k.startswith("single_transformer_blocks.")})
    for i in singles:
        b, o = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        take(b + "norm.linear", o + "modulation.lin")
        fuse([b + "attn.to_q", b + "attn.to_k", b + "attn.to_v", b + "proj_mlp"], o + "linear1")
        out[f"{prefix}{o}norm.query_norm.scale"] = s.pop(f"{b}attn.norm_q.weight")
        out[f"{prefix}{o}norm.key_norm.scale"] = s.pop(f"{b}attn.norm_k.weight")
        take(b + "proj_out", o + "linear2")
    assert not s, sorted(s)[:5]
    return out


# ---- whole files ----------------------------------------------------------------------------------
def sdxl_original(models: Any, configs: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """An SDXL ModelSet (unet, vae, text_encoder, text_encoder_2) as one A1111/ComfyUI state dict."""
    out = unet_to_original(models["unet"].state_dict(), configs["unet"])
    out.update(vae_to_original(models["vae"].state_dict(), configs["vae"]))
    te1 = {k: v for k, v in models["text_encoder"].state_dict().items() if not k.endswith("position_ids")}
    out.update(clip_to_original(te1, "conditioner.embedders.0.transformer."))
    out.update(open_clip_to_original(models["text_encoder_2"].state_dict()))
    return out


def write_sparse_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """A safetensors file of zeros with these (shape, dtype) tensors, written as a sparse file
    (a header, then a hole): any size in no disk space and no time. Returns the data bytes."""
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}
    header: dict[str, Any] = {}
    offset = 0
    for key in sorted(tensors):
        shape, dtype = tensors[key]
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        header[key] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        f.truncate(8 + len(head) + offset)
    return offset


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo: str, folder: Path, commit: str = COMMIT) -> Path:
    """``folder`` as the hub cache keeps a downloaded repo: blobs by sha256, a snapshot of symlinks, refs/main."""
    base = root / f"models--{repo.replace('/', '--')}"
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        blob = base / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, blob)
        link = base / "snapshots" / commit / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / "main").write_text(commit)
    return base
