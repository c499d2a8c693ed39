"""Single-file checkpoints in the layouts people download: A1111/ComfyUI SDXL and SD1.5, BFL/ComfyUI Flux,
and the denoiser alone as ComfyUI's diffusion_models hold it (SD3.5, Wan, Z-Image).

``model.path=/models/sd_xl_base_1.0.safetensors`` holds every SDXL module in Stability's original
layout (``model.diffusion_model.*`` U-Net, ``first_stage_model.*`` VAE,
``conditioner.embedders.0.transformer.*`` CLIP-L, ``conditioner.embedders.1.model.*`` OpenCLIP
bigG); ``flux1-dev.safetensors`` holds Flux's transformer in Black Forest Labs' layout
(``double_blocks.*``, ``single_blocks.*``, ...; ComfyUI's all-in-one files add ``vae.*`` and
``text_encoders.clip_l/t5xxl.transformer.*``); ``v1-5-pruned-emaonly.safetensors`` holds SD1.5's
U-Net, VAE and CLIP-L (``cond_stage_model.transformer.*``). A layout is recognised from the header's key names
(:func:`detect_layout`), and each module found in the file is converted to diffusers' names:

* with diffusers' own single-file conversion functions (``convert_ldm_unet_checkpoint``,
  ``convert_ldm_vae_checkpoint``, ``convert_ldm_clip_checkpoint``, ``convert_open_clip_checkpoint``,
  ``convert_sd3_t5_checkpoint_to_diffusers``), given the architecture of ``model.size`` from
  runner/families/common/model_configs.py: never ``from_single_file``, which fetches configs from the hub;
* Flux's transformer with :func:`convert_flux_transformer`, our own: diffusers'
  ``convert_flux_transformer_checkpoint_to_diffusers`` hard-codes FLUX.1's width (3072), so it
  cannot convert the tiny model the tests build; ours takes the width from the config and is
  checked against diffusers' on the full-size layout (tests/runner/families/test_model_sources.py).

Loading stays lazy and dtype-converting (what keeps a 12 B model's host RAM in check): the
header is read first and the conversion is run on ``meta`` tensors of the header's shapes, so a
wrong file or size fails before any weight is read; then each module's tensors are read one by
one, converted to the run's dtype as they are read, and adopted by a module built on ``meta``
(``load_state_dict(assign=True)``). The file is reopened every 256 MiB of data
(runner/families/common/safetensors_read.py),
because safetensors maps it whole and the pages read stay in the process's RSS until it is
closed. Peak host RAM: about the modules' bytes in the target dtype plus one chunk
(bench/load_memory.py measures it on a full-size SDXL file).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from runner.families.flux2.single_file import FLUX2_ROOTS, convert_flux2_transformer, is_flux2


# ---- converters -------------------------------------------------------------------------------
def _strip_text_model(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers >= 5.6 builds ``CLIPTextModel`` without the ``text_model.`` wrapper."""
    if hasattr(model, "text_model"):
        return state
    return {k.removeprefix("text_model."): v for k, v in state.items()}


def convert_unet(state: dict, config: dict, model: nn.Module) -> dict:
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    return convert_ldm_unet_checkpoint(state, config)


def convert_vae(state: dict, config: dict, model: nn.Module) -> dict:
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    return convert_ldm_vae_checkpoint(state, config)


def clip_converter(prefix: str) -> Callable[[dict, dict, nn.Module], dict]:
    def convert(state: dict, config: dict, model: nn.Module) -> dict:
        from diffusers.loaders.single_file_utils import convert_ldm_clip_checkpoint

        return _strip_text_model(model, convert_ldm_clip_checkpoint(state, remove_prefix=prefix))

    return convert


def open_clip_converter(prefix: str) -> Callable[[dict, dict, nn.Module], dict]:
    def convert(state: dict, config: dict, model: nn.Module) -> dict:
        from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint

        return convert_open_clip_checkpoint(model, state, prefix=prefix)

    return convert


def convert_t5(state: dict, config: dict, model: nn.Module) -> dict:
    """ComfyUI's t5xxl files store the embedding once, as ``shared.weight``; T5 ties it to the
    encoder's ``embed_tokens`` (re-tied after loading, see runner/families/common/single_file_load.py)."""
    from diffusers.loaders.single_file_utils import (
        convert_sd3_t5_checkpoint_to_diffusers,
    )

    out = convert_sd3_t5_checkpoint_to_diffusers(state)
    if "shared.weight" in out and "encoder.embed_tokens.weight" not in out:
        out["encoder.embed_tokens.weight"] = out["shared.weight"]
    return out


FLUX_ROOTS = ("double_blocks.", "single_blocks.", "img_in.", "txt_in.", "time_in.", "vector_in.", "guidance_in.",
              "final_layer.")

# Flux names as data, (diffusers, BFL), read here by :func:`convert_flux_transformer` and inverted by the
# single-file export (runner/export/single_file.py), so that both directions come from one table.
FLUX_RENAMES = (("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
                ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
                ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
                ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
                ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
                ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
                ("context_embedder", "txt_in"), ("x_embedder", "img_in"), ("proj_out", "final_layer.linear"))
FLUX_SWAPPED = (("norm_out.linear", "final_layer.adaLN_modulation.1"),)  # diffusers (scale, shift), BFL (shift, scale)
FLUX_DOUBLE_RENAMES = (("norm1.linear", "img_mod.lin"), ("norm1_context.linear", "txt_mod.lin"),
                       ("ff.net.0.proj", "img_mlp.0"), ("ff.net.2", "img_mlp.2"),
                       ("ff_context.net.0.proj", "txt_mlp.0"), ("ff_context.net.2", "txt_mlp.2"),
                       ("attn.to_out.0", "img_attn.proj"), ("attn.to_add_out", "txt_attn.proj"))
FLUX_DOUBLE_FUSED = ((("attn.to_q", "attn.to_k", "attn.to_v"), "img_attn.qkv"),
                     (("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "txt_attn.qkv"))
FLUX_DOUBLE_NORMS = (("attn.norm_q", "img_attn.norm.query_norm"), ("attn.norm_k", "img_attn.norm.key_norm"),
                     ("attn.norm_added_q", "txt_attn.norm.query_norm"),
                     ("attn.norm_added_k", "txt_attn.norm.key_norm"))  # diffusers .weight, BFL .scale
FLUX_SINGLE_RENAMES = (("norm.linear", "modulation.lin"), ("proj_out", "linear2"))
FLUX_SINGLE_FUSED = (("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), "linear1")  # q, k, v of the width, then the MLP
FLUX_SINGLE_NORMS = (("attn.norm_q", "norm.query_norm"), ("attn.norm_k", "norm.key_norm"))


def convert_flux_transformer(state: dict, config: dict, model: nn.Module) -> dict:
    """BFL's Flux layout -> diffusers' ``FluxTransformer2DModel`` names, any width.

    The mapping is diffusers' (``convert_flux_transformer_checkpoint_to_diffusers``), written as the
    ``FLUX_*`` tables above, with the attention width taken from ``config`` instead of FLUX.1's 3072
    and the fused q/k/v(/mlp) weights split into copies as each block is converted, the fused tensor
    dropped right after (the peak grows by one block, not by the model).
    """
    src = {k.removeprefix("model.diffusion_model."): v for k, v in state.items()}
    state.clear()
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    out: dict[str, torch.Tensor] = {}

    def move(new: str, old: str) -> None:
        for suffix in ("weight", "bias"):
            if f"{old}.{suffix}" in src:
                out[f"{new}.{suffix}"] = src.pop(f"{old}.{suffix}")

    def split(new: list[str], old: str, sizes: list[int] | None = None) -> None:
        for suffix in ("weight", "bias"):
            fused = src.pop(f"{old}.{suffix}")
            parts = torch.split(fused, sizes or [fused.shape[0] // len(new)] * len(new), dim=0)
            for name, piece in zip(new, parts):
                out[f"{name}.{suffix}"] = piece.clone()
            del fused, parts

    def swap_scale_shift(old: str, new: str) -> None:  # BFL: (shift, scale); diffusers: (scale, shift)
        for suffix in ("weight", "bias"):
            shift, scale = src.pop(f"{old}.{suffix}").chunk(2, dim=0)
            out[f"{new}.{suffix}"] = torch.cat([scale, shift], dim=0)

    for new, old in FLUX_RENAMES:
        move(new, old)
    for new, old in FLUX_SWAPPED:
        swap_scale_shift(old, new)
    doubles = sorted({int(k.split(".")[1]) for k in src if k.startswith("double_blocks.")})
    singles = sorted({int(k.split(".")[1]) for k in src if k.startswith("single_blocks.")})
    for i in doubles:
        b, o = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for new, old in FLUX_DOUBLE_RENAMES:
            move(b + new, o + old)
        for news, old in FLUX_DOUBLE_FUSED:
            split([b + n for n in news], o + old)
        for new, old in FLUX_DOUBLE_NORMS:
            out[f"{b}{new}.weight"] = src.pop(f"{o}{old}.scale")
    for i in singles:
        b, o = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for new, old in FLUX_SINGLE_RENAMES:
            move(b + new, o + old)
        news, old = FLUX_SINGLE_FUSED
        rows = src[o + old + ".weight"].shape[0]
        split([b + n for n in news], o + old, [inner, inner, inner, rows - 3 * inner])
        for new, old in FLUX_SINGLE_NORMS:
            out[f"{b}{new}.weight"] = src.pop(f"{o}{old}.scale")
    out.update(src)  # anything left over is reported as unexpected by the key check
    return out


SD3_ROOTS = ("joint_blocks.", "x_embedder.", "t_embedder.", "y_embedder.", "context_embedder.", "final_layer.",
             "pos_embed")


def convert_sd3_transformer(state: dict, config: dict, model: nn.Module) -> dict:
    """Stability's SD3/SD3.5 MMDiT layout -> diffusers' ``SD3Transformer2DModel`` names: diffusers'
    ``convert_sd3_transformer_checkpoint_to_diffusers``, which reads every width from the tensors."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    return convert_sd3_transformer_checkpoint_to_diffusers(state)


WAN_ROOTS = ("blocks.", "patch_embedding.", "text_embedding.", "time_embedding.", "time_projection.", "head.",
             "img_emb.")


def convert_wan_transformer(state: dict, config: dict, model: nn.Module) -> dict:
    """The original Wan 2.1/2.2 layout (``blocks.N.self_attn.q``, ``head.head``, ...) -> diffusers'
    ``WanTransformer3DModel``: diffusers' ``convert_wan_transformer_to_diffusers``, a rename chain."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers(state)


Z_IMAGE_ROOTS = ("layers.", "noise_refiner.", "context_refiner.", "x_embedder.", "final_layer.", "t_embedder.",
                 "cap_embedder.", "x_pad_token", "cap_pad_token", "norm_final.")


def convert_z_image_transformer(state: dict, config: dict, model: nn.Module) -> dict:
    """The original Z-Image layout (fused ``attention.qkv``, ``x_embedder``, ``final_layer``; ComfyUI's
    diffusion_models file) -> diffusers' ``ZImageTransformer2DModel``: diffusers'
    ``convert_z_image_transformer_checkpoint_to_diffusers``, renames and an even qkv split (any width)."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    return convert_z_image_transformer_checkpoint_to_diffusers(state)


# ---- layouts ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Component:
    """One module of a layout: which file keys are its own, and how they become diffusers names."""

    prefixes: tuple[str, ...]
    convert: Callable[[dict, dict, nn.Module], dict]

    def keys(self, file_keys: Iterable[str]) -> list[str]:
        return [k for k in file_keys if k.startswith(self.prefixes)]


@dataclass(frozen=True)
class Layout:
    """A single-file layout: its name for messages, the trainer family it is for, its modules."""

    name: str
    family: str
    components: dict[str, Component] = field(default_factory=dict)
    detect: Callable[[list[str]], bool] = lambda keys: False
    unread: tuple[str, ...] = ()  # key prefixes of modules the file may hold that are not read yet: refused


def _is_sdxl(keys: list[str]) -> bool:
    return any(k.startswith("model.diffusion_model.label_emb.") for k in keys)


def _is_sd3(keys: list[str]) -> bool:
    return any(k.removeprefix("model.diffusion_model.").startswith("joint_blocks.") for k in keys)


def _is_wan(keys: list[str]) -> bool:
    return any(k.removeprefix("model.diffusion_model.").startswith("blocks.") and ".self_attn." in k for k in keys)


def _is_z_image(keys: list[str]) -> bool:
    """Z-Image's original file: fused qkv (diffusers' has to_q) and a one-layer adaLN (Lumina 2's is ``.1``)."""
    keys = [k.removeprefix("model.diffusion_model.") for k in keys]
    return any(".attention.qkv." in k for k in keys) and any(k.startswith("layers.0.adaLN_modulation.0.") for k in keys)


def _is_lumina2(keys: list[str]) -> bool:
    """Lumina 2's original file: Z-Image's fused qkv, with a SiLU before the adaLN linear (``.1``)."""
    keys = [k.removeprefix("model.diffusion_model.") for k in keys]
    return any(".attention.qkv." in k for k in keys) and any(k.startswith("layers.0.adaLN_modulation.1.") for k in keys)


def _is_ldm_unet(keys: list[str]) -> bool:
    return any(k.startswith("model.diffusion_model.input_blocks.") for k in keys) and not _is_sdxl(keys)


def _is_chroma(keys: list[str]) -> bool:
    """Chroma's original file: Flux's double/single blocks plus its shared modulation network."""
    return any(k.removeprefix("model.diffusion_model.").startswith("distilled_guidance_layer.") for k in keys)


def _is_flux(keys: list[str]) -> bool:
    return (any(k.removeprefix("model.diffusion_model.").startswith("double_blocks.") for k in keys)
            and not _is_chroma(keys) and not is_flux2(keys))


LAYOUTS: list[Layout] = [
    Layout("the original SDXL layout (A1111/ComfyUI: model.diffusion_model.*, first_stage_model.*, "
           "conditioner.embedders.*)", "sdxl", {
               "unet": Component(("model.diffusion_model.",), convert_unet),
               "vae": Component(("first_stage_model.",), convert_vae),
               "text_encoder": Component(("conditioner.embedders.0.transformer.",),
                                         clip_converter("conditioner.embedders.0.transformer.")),
               "text_encoder_2": Component(("conditioner.embedders.1.model.",),
                                           open_clip_converter("conditioner.embedders.1.model.")),
           }, _is_sdxl),
    # Recognised so that it is not taken for Flux; not converted (runner/families/chroma/trainer.py refuses it).
    Layout("Lodestone's original Chroma layout (double_blocks.*, distilled_guidance_layer.*)", "chroma", {}, _is_chroma),
    Layout("Black Forest Labs' original FLUX.2 layout (double_blocks.*, single_stream_modulation.*)", "flux2", {
        "transformer": Component(FLUX2_ROOTS + tuple("model.diffusion_model." + r for r in FLUX2_ROOTS),
                                 convert_flux2_transformer)}, is_flux2),
    Layout("Black Forest Labs' original Flux layout (double_blocks.*, single_blocks.*)", "flux", {
        "transformer": Component(FLUX_ROOTS + tuple("model.diffusion_model." + r for r in FLUX_ROOTS),
                                 convert_flux_transformer),
        "vae": Component(("vae.",), convert_vae),
        "text_encoder": Component(("text_encoders.clip_l.transformer.",),
                                  clip_converter("text_encoders.clip_l.transformer.")),
        "text_encoder_2": Component(("text_encoders.t5xxl.transformer.",), convert_t5),
    }, _is_flux),
    # SD 1.x (A1111/ComfyUI v1-5 files); an SD 2.x file keeps OpenCLIP under cond_stage_model.model., which the
    # SD1.5 trainer's CLIP-L does not take: trainer.variant=sd21 reads no original file (family "" there).
    Layout("Stability's original SD3/SD3.5 transformer layout (joint_blocks.*; ComfyUI diffusion_models)", "sd3", {
        "transformer": Component(SD3_ROOTS + tuple("model.diffusion_model." + r for r in SD3_ROOTS),
                                 convert_sd3_transformer),
    }, _is_sd3, unread=("first_stage_model.", "text_encoders.")),
    Layout("the original Wan layout (blocks.N.self_attn.*, head.head; ComfyUI diffusion_models)", "wan", {
        "transformer": Component(WAN_ROOTS + tuple("model.diffusion_model." + r for r in WAN_ROOTS),
                                 convert_wan_transformer),
    }, _is_wan),
    Layout("the original Z-Image layout (layers.N.attention.qkv, x_embedder, final_layer; ComfyUI diffusion_models)",
           "z_image", {"transformer": Component(Z_IMAGE_ROOTS + tuple("model.diffusion_model." + r for r in Z_IMAGE_ROOTS),
                                                convert_z_image_transformer)},
           _is_z_image, unread=("vae.", "text_encoders.", "first_stage_model.")),
    # Recognised so that it is not read as diffusers' layout; not converted (runner/families/lumina2/trainer.py refuses it).
    Layout("the original Lumina 2 layout (layers.N.attention.qkv, adaLN_modulation.1)", "lumina2", {}, _is_lumina2),
    Layout("the original SD 1.x/2.x layout (model.diffusion_model.*, first_stage_model.*, "
           "cond_stage_model.transformer.*, without SDXL's label_emb)", "sd", {
               "unet": Component(("model.diffusion_model.",), convert_unet),
               "vae": Component(("first_stage_model.",), convert_vae),
               "text_encoder": Component(("cond_stage_model.transformer.",),
                                         clip_converter("cond_stage_model.transformer.")),
           }, _is_ldm_unet),
]


def detect_layout(keys: list[str]) -> Layout | None:
    """The original layout of a file with these keys, or None (diffusers' own key layout)."""
    for layout in LAYOUTS:
        if layout.detect(keys):
            return layout
    return None
