"""Flux.2's ComfyUI LoRA file: BFL's module names under ``diffusion_model.``, q/k/v fused as BFL fuses them.

ComfyUI loads FLUX.2 checkpoints in BFL's original layout (``double_blocks.N.img_attn.qkv``,
``single_blocks.N.linear1`` ...), and keys a LoRA by ``diffusion_model.<weight name>``; diffusers reads the
same file back (``Flux2LoraLoaderMixin``: ``_convert_non_diffusers_flux2_lora_to_diffusers``, whose map is
the one below). Two things differ from a rename:

* BFL has one ``qkv`` linear where diffusers has ``to_q``, ``to_k``, ``to_v`` (``add_*_proj`` for the text
  stream). Separate adapters ``B_i A_i`` become one of rank ``r_q + r_k + r_v``: ``A = [A_q; A_k; A_v]``
  and ``B`` block-diagonal (rows of an unadapted projection zero), so ``B A`` stacks exactly the three
  updates. Trade-off: three times the rank's bytes for that module, no approximation. diffusers' reader
  gives each projection the whole ``A`` and its third of ``B``: the same product again.
* The scale ``lora_alpha / r`` is multiplied into ``B`` and no ``.alpha`` is written: diffusers' reader
  refuses ``.alpha`` keys in this layout, and ComfyUI without one applies the update as stored.
"""
from __future__ import annotations

import re

import torch

# diffusers module (regex) -> BFL name, for the modules that are one linear in both layouts.
FLUX2_RENAMES: tuple[tuple[str, str], ...] = (
    (r"transformer_blocks\.(\d+)\.attn\.to_out\.0", r"double_blocks.\1.img_attn.proj"),
    (r"transformer_blocks\.(\d+)\.attn\.to_add_out", r"double_blocks.\1.txt_attn.proj"),
    (r"transformer_blocks\.(\d+)\.ff\.linear_in", r"double_blocks.\1.img_mlp.0"),
    (r"transformer_blocks\.(\d+)\.ff\.linear_out", r"double_blocks.\1.img_mlp.2"),
    (r"transformer_blocks\.(\d+)\.ff_context\.linear_in", r"double_blocks.\1.txt_mlp.0"),
    (r"transformer_blocks\.(\d+)\.ff_context\.linear_out", r"double_blocks.\1.txt_mlp.2"),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_qkv_mlp_proj", r"single_blocks.\1.linear1"),
    (r"single_transformer_blocks\.(\d+)\.attn\.to_out", r"single_blocks.\1.linear2"),
    (r"x_embedder", "img_in"),
    (r"context_embedder", "txt_in"),
    (r"proj_out", "final_layer.linear"),
    (r"norm_out\.linear", "final_layer.adaLN_modulation.1"),
    (r"time_guidance_embed\.timestep_embedder\.linear_1", "time_in.in_layer"),
    (r"time_guidance_embed\.timestep_embedder\.linear_2", "time_in.out_layer"),
    (r"time_guidance_embed\.guidance_embedder\.linear_1", "guidance_in.in_layer"),
    (r"time_guidance_embed\.guidance_embedder\.linear_2", "guidance_in.out_layer"),
    (r"single_stream_modulation\.linear", "single_stream_modulation.lin"),
    (r"double_stream_modulation_img\.linear", "double_stream_modulation_img.lin"),
    (r"double_stream_modulation_txt\.linear", "double_stream_modulation_txt.lin"),
)
# The fused projections: diffusers' three modules -> BFL's qkv, in BFL's order (q, k, v).
QKV = {r"transformer_blocks\.(\d+)\.attn\.to_([qkv])": (r"double_blocks.\1.img_attn.qkv", ("to_q", "to_k", "to_v")),
       r"transformer_blocks\.(\d+)\.attn\.add_([qkv])_proj": (r"double_blocks.\1.txt_attn.qkv",
                                                             ("add_q_proj", "add_k_proj", "add_v_proj"))}
FLUX2_NAMES = FLUX2_RENAMES + tuple((p, n) for p, (n, _) in QKV.items())  # every module with a BFL name


def _fused(state: dict[str, torch.Tensor], block: str, parts: tuple[str, ...],
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of the fused qkv from the adapted ones among ``block.attn.<part>``."""
    present = [p for p in parts if f"{block}.attn.{p}.lora_A.weight" in state]
    a = torch.cat([state[f"{block}.attn.{p}.lora_A.weight"] for p in present], dim=0)
    out = next(state[f"{block}.attn.{p}.lora_B.weight"].shape[0] for p in present)
    b = torch.zeros(3 * out, a.shape[0], dtype=a.dtype)
    col = 0
    for p in present:
        up = state[f"{block}.attn.{p}.lora_B.weight"]
        row = parts.index(p) * out
        b[row:row + out, col:col + up.shape[1]] = up * scale
        col += up.shape[1]
    return a.contiguous(), b


def flux2_comfy_state_dict(peft_state: dict[str, torch.Tensor], alpha: float, rank: int) -> dict[str, torch.Tensor]:
    """peft's adapter as ``diffusion_model.<BFL name>.lora_A/lora_B.weight``, the scale in ``B``."""
    scale = float(alpha) / int(rank)
    out: dict[str, torch.Tensor] = {}
    modules = sorted(k[: -len(".lora_A.weight")] for k in peft_state if k.endswith(".lora_A.weight"))
    for module in modules:
        for pattern, (target, parts) in QKV.items():
            m = re.fullmatch(pattern, module)
            if m:
                key = f"diffusion_model.{re.sub(f'^{pattern}$', target, module)}"
                if f"{key}.lora_A.weight" not in out:
                    block = module.rsplit(".attn.", 1)[0]
                    out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = _fused(peft_state, block, parts, scale)
                break
        else:
            name = next((re.sub(f"^{p}$", r, module) for p, r in FLUX2_RENAMES if re.fullmatch(p, module)), None)
            if name is None:
                raise ValueError(f"no BFL name is known for the Flux.2 LoRA module {module!r}")
            out[f"diffusion_model.{name}.lora_A.weight"] = peft_state[f"{module}.lora_A.weight"].contiguous()
            out[f"diffusion_model.{name}.lora_B.weight"] = (peft_state[f"{module}.lora_B.weight"] * scale).contiguous()
    return out
