"""The LoRA file ComfyUI applies at the trained strength, for every family.

ComfyUI ignores safetensors metadata: a LoRA's strength comes only from a ``<module>.alpha``
tensor beside ``lora_up``/``lora_down`` (or ``lora_B``/``lora_A``), scale = alpha / rank. The
diffusers file has no ``.alpha`` keys, so ComfyUI applies it at alpha = rank (1.0) whatever the
run trained with. And ComfyUI names a module as *its* model does (``comfy/lora.py``
``model_lora_keys_unet``), which is not always diffusers' name. So each family gets the one
layout ComfyUI maps for it, with ``.alpha``:

* **kohya** (SDXL, SD1.5, SD2.1, Flux): the kohya file (``lora_kohya.safetensors``) *is* the
  ComfyUI file: ``lora_unet_<diffusers name>`` (ComfyUI's ``unet_to_diffusers``) or
  ``lora_transformer_<diffusers name>`` (OneTrainer's Flux layout, ``flux_to_diffusers``), with
  ``.alpha``. No second, identical file is written.
* **sd3** (SD3.5): the same ``lora_transformer_<diffusers name>`` layout (OneTrainer's, which
  ComfyUI maps through ``mmdit_to_diffusers`` onto the fused ``qkv``), as ``lora_comfy.safetensors``:
  diffusers has no reader for it, so it is not offered as the kohya file.
* **qwen_image** (Qwen-Image): ``diffusion_model.<name>.lora_A/lora_B`` + ``.alpha``; ComfyUI's
  Qwen-Image modules carry diffusers' names (its generic ``diffusion_model.*`` mapping), and
  diffusers reads the file back (``_convert_non_diffusers_qwen_lora_to_diffusers``).
* **qwen_image21** (Qwen-Image 2.1): the same, but ComfyUI's model holds each block's ``img_mlp.gate_layer`` and
  ``img_mlp.proj`` as one ``img_mlp.gate_up`` (rows gate, then up), so those two LoRAs are written as one
  (:data:`QWEN21_FUSED`, as Lumina 2's q/k/v below).
* **z_image** (Z-Image): the same dotted ``diffusion_model.<diffusers name>`` layout. ComfyUI loads
  Z-Image as its Lumina 2 NextDiT (fused ``attention.qkv``, ``attention.out``) and maps diffusers'
  names onto it (``comfy/utils.py`` ``z_image_to_diffusers``: ``to_q``/``to_k``/``to_v`` onto slices
  of ``qkv``, ``to_out.0`` onto ``out``), so diffusers' names are the keys; diffusers reads the
  file back (``_convert_non_diffusers_z_image_lora_to_diffusers``).
* **lumina2** (Lumina 2): ``diffusion_model.<original NextDiT name>`` (:data:`LUMINA2_RENAMES`:
  ``attention.out``, ``feed_forward.w1``...), the names ComfyUI's Lumina 2 model has. Its q/k/v are
  one fused ``attention.qkv`` there (rows q, k, v; k and v narrower under GQA), so the three LoRAs are
  written as one (:data:`LUMINA2_FUSED`, :func:`fuse_group`): down weights stacked, up weights
  block-diagonal, rank the sum, ``.alpha`` scaled by the same factor so alpha / rank is the run's.
  Exact: ``B A`` is the three updates stacked, the rows of an unadapted part zero.
* **hunyuan_video15** (HunyuanVideo 1.5): ``diffusion_model.<ComfyUI HunyuanVideo name>``, q/k/v fused into
  ``img_attn.qkv``/``txt_attn.qkv``/the refiner's ``self_attn.qkv`` as Lumina 2's
  (runner/families/hunyuan_video15/comfy.py).
* **ltx2** (LTX-2): ``diffusion_model.<original LTX-2 name>.lora_A/lora_B``, the scale in B (diffusers' reader of
  that layout keeps no ``.alpha``): block modules keep diffusers' names, the top-level ones are renamed by
  :data:`LTX2_RENAMES` (``proj_in`` -> ``patchify_proj``, ``time_embed`` -> ``adaln_single`` ...).
* **wan** (Wan 2.1/2.2): ``diffusion_model.<original Wan name>.lora_A/lora_B`` + ``.alpha``:
  ComfyUI knows only the original module names (``blocks.N.self_attn.q``, ``cross_attn.o``,
  ``ffn.0`` ...), so diffusers' names are renamed by :data:`WAN_RENAMES` (the inverse of
  diffusers' ``_convert_non_diffusers_wan_lora_to_diffusers``, which reads the file back).

The layouts are data (:data:`LAYOUTS`): a family is a prefix, a key style and a rename table.
Trade-off: a module the rename table does not know has no ComfyUI name; rather than guess one, the
run is refused before step 1 (:func:`check_comfy_targets`) with the targets that would work.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from runner.errors import UserError
from runner.export.config import export_config
from runner.families.flux2.comfy import FLUX2_NAMES
from runner.families.hunyuan_video15 import comfy as hv15

COMFY_FILE = "lora_comfy.safetensors"
COMFY_EMA_FILE = "lora_comfy_ema.safetensors"


@dataclass(frozen=True)
class FusedGroup:
    """Diffusers' linears that ComfyUI's model has as one, their output rows stacked in ``parts`` order.

    ``pattern``: a regex over a member's diffusers name with named groups ``block`` and ``part``;
    ``target``: the fused module's ComfyUI name (a ``re.sub`` replacement); ``member``: a member's
    diffusers name from ``{block}`` and ``{part}``.
    """

    pattern: str
    target: str
    member: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class ComfyLayout:
    """How one family's LoRA modules are keyed in its ComfyUI file.

    ``style``: ``kohya`` (``<prefix>_<name with _>.lora_down.weight``/``.lora_up.weight``) or
    ``dotted`` (``<prefix>.<name>.lora_A.weight``/``.lora_B.weight``); both with ``.alpha``.
    ``renames``: ``(regex over the diffusers module name, replacement)``, the first full match
    wins; ``None`` keeps diffusers' names (the family's ComfyUI names are diffusers' own).
    ``separate``: whether it is its own file (``lora_comfy.safetensors``) or the kohya file.
    ``fused``: modules ComfyUI has as one linear (:class:`FusedGroup`), written as one LoRA.
    ``scale_in_b``: no ``.alpha`` keys, ``alpha / rank`` folded into B (a reader that refuses ``.alpha``).
    """

    style: str
    prefix: str
    renames: tuple[tuple[str, str], ...] | None = None
    separate: bool = True
    fused: tuple[FusedGroup, ...] = ()
    scale_in_b: bool = False


# Wan: diffusers' WanTransformer3DModel module -> the original Wan module ComfyUI knows
# (comfy/ldm/wan/model.py). Every Linear of the diffusers model is listed; patch_embedding (a
# Conv3d) has one name in both.
WAN_RENAMES: tuple[tuple[str, str], ...] = (
    (r"blocks\.(\d+)\.attn1\.to_q", r"blocks.\1.self_attn.q"),
    (r"blocks\.(\d+)\.attn1\.to_k", r"blocks.\1.self_attn.k"),
    (r"blocks\.(\d+)\.attn1\.to_v", r"blocks.\1.self_attn.v"),
    (r"blocks\.(\d+)\.attn1\.to_out\.0", r"blocks.\1.self_attn.o"),
    (r"blocks\.(\d+)\.attn2\.to_q", r"blocks.\1.cross_attn.q"),
    (r"blocks\.(\d+)\.attn2\.to_k", r"blocks.\1.cross_attn.k"),
    (r"blocks\.(\d+)\.attn2\.to_v", r"blocks.\1.cross_attn.v"),
    (r"blocks\.(\d+)\.attn2\.to_out\.0", r"blocks.\1.cross_attn.o"),
    (r"blocks\.(\d+)\.attn2\.add_k_proj", r"blocks.\1.cross_attn.k_img"),
    (r"blocks\.(\d+)\.attn2\.add_v_proj", r"blocks.\1.cross_attn.v_img"),
    (r"blocks\.(\d+)\.ffn\.net\.0\.proj", r"blocks.\1.ffn.0"),
    (r"blocks\.(\d+)\.ffn\.net\.2", r"blocks.\1.ffn.2"),
    (r"condition_embedder\.time_proj", "time_projection.1"),
    (r"condition_embedder\.text_embedder\.linear_1", "text_embedding.0"),
    (r"condition_embedder\.text_embedder\.linear_2", "text_embedding.2"),
    (r"condition_embedder\.time_embedder\.linear_1", "time_embedding.0"),
    (r"condition_embedder\.time_embedder\.linear_2", "time_embedding.2"),
    (r"condition_embedder\.image_embedder\.ff\.net\.0\.proj", "img_emb.proj.1"),
    (r"condition_embedder\.image_embedder\.ff\.net\.2", "img_emb.proj.3"),
    (r"proj_out", "head.head"),
    (r"patch_embedding", "patch_embedding"),
)

# Lumina 2: diffusers' Lumina2Transformer2DModel module -> the original NextDiT module ComfyUI knows
# (comfy/ldm/lumina/model.py; the inverse of diffusers' convert_lumina2_to_diffusers). q/k/v have no
# entry: ComfyUI fuses them into attention.qkv, which this layout does not write (they are refused).
_BLOCKS = r"(layers|noise_refiner|context_refiner)\.(\d+)"
LUMINA2_RENAMES: tuple[tuple[str, str], ...] = (
    (_BLOCKS + r"\.attn\.to_out\.0", r"\1.\2.attention.out"),
    (_BLOCKS + r"\.feed_forward\.linear_([123])", r"\1.\2.feed_forward.w\3"),
    (_BLOCKS + r"\.norm1\.linear", r"\1.\2.adaLN_modulation.1"),
    (r"time_caption_embed\.caption_embedder\.1", "cap_embedder.1"),
    (r"time_caption_embed\.timestep_embedder\.linear_1", "t_embedder.mlp.0"),
    (r"time_caption_embed\.timestep_embedder\.linear_2", "t_embedder.mlp.2"),
    (r"norm_out\.linear_1", "final_layer.adaLN_modulation.1"),
    (r"norm_out\.linear_2", "final_layer.linear"),
    (r"x_embedder", "x_embedder"),
)

# Lumina 2's q/k/v -> NextDiT's attention.qkv (JointAttention.qkv, split q, k, v in its forward).
LUMINA2_FUSED = (FusedGroup(r"(?P<block>(?:layers|noise_refiner|context_refiner)\.\d+)\.attn\.to_(?P<part>[qkv])",
                            r"\g<block>.attention.qkv", "{block}.attn.to_{part}", ("q", "k", "v")),)

# Krea 2: diffusers' Krea2Transformer2DModel module -> the original krea-ai/krea-2 module, which the reference
# trainer's and ComfyUI's files key under diffusion_model. (the inverse of diffusers'
# _convert_non_diffusers_krea2_lora_to_diffusers, which reads the file back and refuses .alpha keys).
_KREA2_ATTN = {"to_q": "wq", "to_k": "wk", "to_v": "wv", "to_out\\.0": "wo", "to_gate": "gate"}
KREA2_RENAMES: tuple[tuple[str, str], ...] = (
    *((rf"transformer_blocks\.(\d+)\.attn\.{d}", rf"blocks.\1.attn.{o}") for d, o in _KREA2_ATTN.items()),
    (r"transformer_blocks\.(\d+)\.ff\.(gate|up|down)", r"blocks.\1.mlp.\2"),
    *((rf"text_fusion\.(layerwise_blocks|refiner_blocks)\.(\d+)\.attn\.{d}", rf"txtfusion.\1.\2.attn.{o}")
      for d, o in _KREA2_ATTN.items()),
    (r"text_fusion\.(layerwise_blocks|refiner_blocks)\.(\d+)\.ff\.(gate|up|down)", r"txtfusion.\1.\2.mlp.\3"),
    (r"img_in", "first"),
    (r"final_layer\.linear", "last.linear"),
    (r"time_embed\.linear_1", "tmlp.0"),
    (r"time_embed\.linear_2", "tmlp.2"),
    (r"time_mod_proj", "tproj.1"),
    (r"txt_in\.linear_1", "txtmlp.1"),
    (r"txt_in\.linear_2", "txtmlp.3"),
    (r"text_fusion\.projector", "txtfusion.projector"),
)

# Qwen-Image 2.1: ComfyUI's model has each block's gate_layer and proj as one img_mlp.gate_up (rows gate, then up),
# and maps diffusion_model.<name> keys only onto its own weights (comfy/lora.py model_lora_keys_unet): one LoRA.
QWEN21_FUSED = (FusedGroup(r"(?P<block>transformer_blocks\.\d+)\.img_mlp\.(?P<part>gate_layer|proj)",
                           r"\g<block>.img_mlp.gate_up", "{block}.img_mlp.{part}", ("gate_layer", "proj")),)
# HunyuanVideo 1.5: ComfyUI's HunyuanVideo (Flux-style) names, q/k/v fused (runner/families/hunyuan_video15/comfy.py).
HV15_FUSED = tuple(FusedGroup(*g) for g in hv15.FUSED)
# LTX-2: diffusers' LTX2VideoTransformer3DModel module -> the original LTX-2 (ltx-core) module, which ComfyUI's LTX-2
# model and the reference trainer's files key under diffusion_model. (the inverse of diffusers'
# _convert_non_diffusers_ltx2_lora_to_diffusers, which reads the file back and keeps no .alpha). Block modules
# (attn1/attn2, audio_attn1/2, audio_to_video_attn, video_to_audio_attn, ff, audio_ff) carry the same names.
LTX2_RENAMES: tuple[tuple[str, str], ...] = (
    (r"proj_in", "patchify_proj"),
    (r"audio_proj_in", "audio_patchify_proj"),
    (r"(audio_)?time_embed\.(.+)", r"\1adaln_single.\2"),
    (r"av_cross_attn_video_scale_shift\.(.+)", r"av_ca_video_scale_shift_adaln_single.\1"),
    (r"av_cross_attn_video_a2v_gate\.(.+)", r"av_ca_a2v_gate_adaln_single.\1"),
    (r"av_cross_attn_audio_scale_shift\.(.+)", r"av_ca_audio_scale_shift_adaln_single.\1"),
    (r"av_cross_attn_audio_v2a_gate\.(.+)", r"av_ca_v2a_gate_adaln_single.\1"),
    (r"((?:audio_)?(?:caption_projection|proj_out)(?:\..+)?|transformer_blocks\.\d+\..+)", r"\1"),
)

# Trainer.comfy_layout -> its layout (see the module docstring).
LAYOUTS: dict[str, ComfyLayout] = {
    "kohya": ComfyLayout("kohya", "", separate=False),  # the prefix is the kohya file's (runner/export/lora.py)
    "sd3": ComfyLayout("kohya", "lora_transformer"),
    "qwen_image": ComfyLayout("dotted", "diffusion_model"),
    "qwen_image21": ComfyLayout("dotted", "diffusion_model", fused=QWEN21_FUSED),
    "wan": ComfyLayout("dotted", "diffusion_model", WAN_RENAMES),
    "z_image": ComfyLayout("dotted", "diffusion_model"),
    "hidream": ComfyLayout("dotted", "diffusion_model"),  # ComfyUI's HiDream modules carry diffusers' names
    "lumina2": ComfyLayout("dotted", "diffusion_model", LUMINA2_RENAMES, fused=LUMINA2_FUSED),
    "krea2": ComfyLayout("dotted", "diffusion_model", KREA2_RENAMES, scale_in_b=True),
    "hunyuan_video15": ComfyLayout("dotted", "diffusion_model", hv15.RENAMES, fused=HV15_FUSED),
    "ltx2": ComfyLayout("dotted", "diffusion_model", LTX2_RENAMES, scale_in_b=True),
    # BFL's names, q/k/v fused and the scale in B: written by runner/families/flux2/comfy.py, not comfy_state_dict
    "flux2": ComfyLayout("flux2", "diffusion_model", FLUX2_NAMES),
}


def comfy_module_name(layout: ComfyLayout, name: str) -> str | None:
    """ComfyUI's name of the diffusers module ``name`` (``None``: the rename table has none).
    A member of a fused group is named by its fused module, which the LoRA writer alone can fill."""
    for group in layout.fused:
        if re.fullmatch(group.pattern, name):
            return re.sub(f"^{group.pattern}$", group.target, name)
    if layout.renames is None:
        return name
    for pattern, replacement in layout.renames:
        if re.fullmatch(pattern, name):
            return re.sub(f"^{pattern}$", replacement, name)
    return None


def lora_modules(peft_state: dict[str, torch.Tensor]) -> list[str]:
    """The adapted modules of peft's state dict (``<module>.lora_A.weight`` keys), sorted."""
    return sorted(k[: -len(".lora_A.weight")] for k in peft_state if k.endswith(".lora_A.weight"))


def fuse_group(peft_state: dict[str, torch.Tensor], group: FusedGroup, block: str, alpha: float,
               out_features: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(down, up, alpha) of the one LoRA over ``block``'s fused linear: the adapted members' downs
    stacked, their ups block-diagonal at the member's rows (an unadapted member's rows zero, its width
    from ``out_features``), alpha scaled with the rank so that alpha / rank stays the members'."""
    members = [group.member.format(block=block, part=p) for p in group.parts]
    adapted = [m for m in members if f"{m}.lora_A.weight" in peft_state]
    downs = [peft_state[f"{m}.lora_A.weight"] for m in adapted]
    ranks = {d.shape[0] for d in downs}
    if len(ranks) != 1:
        raise ValueError(f"the fused LoRA over {members} needs one rank for its parts, not {sorted(ranks)}")
    widths = []
    for m in members:
        up = peft_state.get(f"{m}.lora_B.weight")
        if up is None and m not in out_features:
            raise ValueError(f"the output width of the unadapted {m!r} is needed to fuse {members}")
        widths.append(int(up.shape[0]) if up is not None else int(out_features[m]))
    down = torch.cat(downs, dim=0)
    first = peft_state[f"{adapted[0]}.lora_B.weight"]
    up = torch.zeros(sum(widths), down.shape[0], dtype=first.dtype, device=first.device)
    col = 0
    for i, m in enumerate(members):
        if m in adapted:
            row = sum(widths[:i])
            b = peft_state[f"{m}.lora_B.weight"]
            up[row:row + widths[i], col:col + b.shape[1]] = b
            col += b.shape[1]
    return down.contiguous(), up, float(alpha) * down.shape[0] / ranks.pop()


def _fused_block(layout: ComfyLayout, module: str) -> tuple[FusedGroup, str] | None:
    for group in layout.fused:
        m = re.fullmatch(group.pattern, module)
        if m:
            return group, m.group("block")
    return None


def comfy_state_dict(peft_state: dict[str, torch.Tensor], layout: ComfyLayout, alpha: float,
                     out_features: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """peft's adapter (``<module>.lora_A.weight``/``lora_B``) in ``layout``, with the run's
    ``alpha`` as every module's ``.alpha`` (a 0-dim float tensor, what ComfyUI's ``.item()`` reads);
    ``out_features`` (module -> output width): an unadapted member's rows in a fused LoRA."""
    out: dict[str, torch.Tensor] = {}
    for module in lora_modules(peft_state):
        name = comfy_module_name(layout, module)
        if name is None:
            raise ValueError(f"no ComfyUI name is known for the LoRA module {module!r}")
        if layout.style == "kohya":
            key, down, up = f"{layout.prefix}_{name.replace('.', '_')}", "lora_down.weight", "lora_up.weight"
        else:
            key, down, up = f"{layout.prefix}.{name}", "lora_A.weight", "lora_B.weight"
        fused = _fused_block(layout, module)
        if fused is not None:
            if f"{key}.{down}" not in out:  # the group's first adapted member writes the whole group
                a, b, scaled = fuse_group(peft_state, *fused, alpha, out_features or {})
                out[f"{key}.{down}"], out[f"{key}.{up}"], out[f"{key}.alpha"] = a, b, torch.tensor(scaled)
            continue
        if f"{key}.{down}" in out:
            raise ValueError(f"two LoRA modules share the ComfyUI key {key!r}")
        a, b = peft_state[f"{module}.lora_A.weight"], peft_state[f"{module}.lora_B.weight"]
        out[f"{key}.{down}"] = a.contiguous()
        if layout.scale_in_b:
            out[f"{key}.{up}"] = (b * (float(alpha) / a.shape[0])).contiguous()
        else:
            out[f"{key}.{up}"] = b.contiguous()
            out[f"{key}.alpha"] = torch.tensor(float(alpha))
    return out


def unmapped_modules(layout: ComfyLayout, names: list[str], fuse: bool = True) -> list[str]:
    """The module names (diffusers') that ``layout`` has no ComfyUI name for (``fuse=False``: an
    adapter that cannot be fused, LoKr/LoHa, has none for a fused group's members either)."""
    return [n for n in names if comfy_module_name(layout, n) is None or (not fuse and _fused_block(layout, n))]


def linear_widths(module: nn.Module) -> dict[str, int]:
    """module name -> output width of every linear of ``module`` (peft's wrappers named as their base)."""
    return {n.removesuffix(".base_layer"): int(m.out_features) for n, m in module.named_modules()
            if isinstance(m, nn.Linear)}


def check_comfy_targets(cfg: object, layout_name: str, module: nn.Module, family: str) -> None:
    """Before step 1: every module ``model.lora_targets`` adapted has a ComfyUI name, when the
    export will write the ComfyUI file (else the run would train, then fail at its export)."""
    ec = export_config(cfg)
    layout = LAYOUTS.get(layout_name)
    if layout is None:
        raise ValueError(f"comfy_layout={layout_name!r} is not one of {sorted(LAYOUTS)}")
    configs = getattr(module, "peft_config", None) or {}
    if not ec.wants("comfy") or any(getattr(c, "use_dora", False) for c in configs.values()):
        return  # DoRA writes no ComfyUI file (runner/export/lora.py)
    from peft.tuners.tuners_utils import BaseTunerLayer

    from runner.export.config import adapter_kind

    adapted = sorted(n for n, m in module.named_modules() if isinstance(m, BaseTunerLayer))
    lora = all(adapter_kind(c) == "lora" for c in configs.values())
    missing = unmapped_modules(layout, adapted, fuse=lora)
    if missing and not lora and not unmapped_modules(layout, missing):  # only fused members: a LoRA would do
        raise UserError(
            f"model.train={adapter_kind(next(iter(configs.values())))} adapts {len(missing)} {family} module(s) "
            f"that ComfyUI has as one fused linear (e.g. {missing[0]}), which a Kronecker/Hadamard adapter cannot "
            f"be fused into, so export.lora_format={ec.lora_format} could not write the ComfyUI file. Leave them "
            f"out of model.lora_targets, or set model.train=lora (its q/k/v LoRAs are fused exactly)."
        )
    if missing:
        known = ", ".join(p.replace(r"(\d+)", "N").replace("\\", "") for p, _ in layout.renames or ())
        raise UserError(
            f"model.lora_targets adapts {len(missing)} {family} module(s) that ComfyUI has no name for "
            f"(e.g. {missing[0]}), so export.lora_format={ec.lora_format} could not write the ComfyUI file. "
            f"Target modules ComfyUI knows ({known}), or set export.lora_format=diffusers."
        )
