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
* **z_image** (Z-Image): the same dotted ``diffusion_model.<diffusers name>`` layout. ComfyUI loads
  Z-Image as its Lumina 2 NextDiT (fused ``attention.qkv``, ``attention.out``) and maps diffusers'
  names onto it (``comfy/utils.py`` ``z_image_to_diffusers``: ``to_q``/``to_k``/``to_v`` onto slices
  of ``qkv``, ``to_out.0`` onto ``out``), so diffusers' names are the keys; diffusers reads the
  file back (``_convert_non_diffusers_z_image_lora_to_diffusers``).
* **lumina2** (Lumina 2): ``diffusion_model.<original NextDiT name>`` (:data:`LUMINA2_RENAMES`:
  ``attention.out``, ``feed_forward.w1``...), the names ComfyUI's Lumina 2 model has. Its q/k/v are
  one fused ``attention.qkv`` there, which this layout does not write: a LoRA on ``to_q``/``to_k``/
  ``to_v`` is refused for the ComfyUI file before step 1 (``export.lora_format=diffusers`` trains it).
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

COMFY_FILE = "lora_comfy.safetensors"
COMFY_EMA_FILE = "lora_comfy_ema.safetensors"


@dataclass(frozen=True)
class ComfyLayout:
    """How one family's LoRA modules are keyed in its ComfyUI file.

    ``style``: ``kohya`` (``<prefix>_<name with _>.lora_down.weight``/``.lora_up.weight``) or
    ``dotted`` (``<prefix>.<name>.lora_A.weight``/``.lora_B.weight``); both with ``.alpha``.
    ``renames``: ``(regex over the diffusers module name, replacement)``, the first full match
    wins; ``None`` keeps diffusers' names (the family's ComfyUI names are diffusers' own).
    ``separate``: whether it is its own file (``lora_comfy.safetensors``) or the kohya file.
    ``scale_in_b``: no ``.alpha`` keys, ``alpha / rank`` folded into B (a reader that refuses ``.alpha``).
    """

    style: str
    prefix: str
    renames: tuple[tuple[str, str], ...] | None = None
    separate: bool = True
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

# Trainer.comfy_layout -> its layout (see the module docstring).
LAYOUTS: dict[str, ComfyLayout] = {
    "kohya": ComfyLayout("kohya", "", separate=False),  # the prefix is the kohya file's (runner/export/lora.py)
    "sd3": ComfyLayout("kohya", "lora_transformer"),
    "qwen_image": ComfyLayout("dotted", "diffusion_model"),
    "wan": ComfyLayout("dotted", "diffusion_model", WAN_RENAMES),
    "z_image": ComfyLayout("dotted", "diffusion_model"),
    "lumina2": ComfyLayout("dotted", "diffusion_model", LUMINA2_RENAMES),
    "krea2": ComfyLayout("dotted", "diffusion_model", KREA2_RENAMES, scale_in_b=True),
    # BFL's names, q/k/v fused and the scale in B: written by runner/families/flux2/comfy.py, not comfy_state_dict
    "flux2": ComfyLayout("flux2", "diffusion_model", FLUX2_NAMES),
}


def comfy_module_name(layout: ComfyLayout, name: str) -> str | None:
    """ComfyUI's name of the diffusers module ``name`` (``None``: the rename table has none)."""
    if layout.renames is None:
        return name
    for pattern, replacement in layout.renames:
        if re.fullmatch(pattern, name):
            return re.sub(f"^{pattern}$", replacement, name)
    return None


def lora_modules(peft_state: dict[str, torch.Tensor]) -> list[str]:
    """The adapted modules of peft's state dict (``<module>.lora_A.weight`` keys), sorted."""
    return sorted(k[: -len(".lora_A.weight")] for k in peft_state if k.endswith(".lora_A.weight"))


def comfy_state_dict(peft_state: dict[str, torch.Tensor], layout: ComfyLayout,
                     alpha: float) -> dict[str, torch.Tensor]:
    """peft's adapter (``<module>.lora_A.weight``/``lora_B``) in ``layout``, with the run's
    ``alpha`` as every module's ``.alpha`` (a 0-dim float tensor, what ComfyUI's ``.item()`` reads)."""
    out: dict[str, torch.Tensor] = {}
    for module in lora_modules(peft_state):
        name = comfy_module_name(layout, module)
        if name is None:
            raise ValueError(f"no ComfyUI name is known for the LoRA module {module!r}")
        if layout.style == "kohya":
            key, down, up = f"{layout.prefix}_{name.replace('.', '_')}", "lora_down.weight", "lora_up.weight"
        else:
            key, down, up = f"{layout.prefix}.{name}", "lora_A.weight", "lora_B.weight"
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


def unmapped_modules(layout: ComfyLayout, names: list[str]) -> list[str]:
    """The module names (diffusers') that ``layout`` has no ComfyUI name for."""
    return [n for n in names if comfy_module_name(layout, n) is None]


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

    adapted = sorted(n for n, m in module.named_modules() if isinstance(m, BaseTunerLayer))
    missing = unmapped_modules(layout, adapted)
    if missing:
        known = ", ".join(p.replace(r"(\d+)", "N").replace("\\", "") for p, _ in layout.renames or ())
        raise UserError(
            f"model.lora_targets adapts {len(missing)} {family} module(s) that ComfyUI has no name for "
            f"(e.g. {missing[0]}), so export.lora_format={ec.lora_format} could not write the ComfyUI file. "
            f"Target modules ComfyUI knows ({known}), or set export.lora_format=diffusers."
        )
