"""The ComfyUI LoRA file applied as ComfyUI's loader applies it gives the runner's fused weights.

Families: Lumina 2 (q/k/v fused into NextDiT's qkv), Z-Image (diffusers' names, ComfyUI's z_image_to_diffusers
key map), HunyuanVideo 1.5 (q/k/v fused into its qkv), HiDream-I1, LTX-2, Wan 2.2 TI2V-5B, T2V A14B and I2V A14B,
FLUX.2 dev and klein (BFL's fused qkv), Krea 2, Qwen-Image 2.1 (gate_layer + proj fused into gate_up), Qwen-Image-Edit,
Flux.1 Kontext and Chroma (the kohya file, patching slices of BFL's fused qkv / linear1 as ComfyUI's flux_to_diffusers
maps them). For each family, ComfyUI's own model (its weight names and which diffusers rows each holds, below as
data from ComfyUI's model code) is built from the tiny diffusers denoiser's weights; the exported
``lora_comfy.safetensors`` is then applied by ComfyUI's rule (``comfy/lora.py`` ``model_lora_keys_unet``:
``diffusion_model.<weight name less .weight>`` is the key; ``comfy/weight_adapter/lora.py``: ``W +=
strength * alpha / rank * up @ down``, rank = the down's rows; strength 1.0) and compared with the same
ComfyUI model built from peft's merged weights (``base + get_delta_weight``). Every key of the file must
be one ComfyUI loads (it logs "lora key not loaded" and drops the rest).
"""
from __future__ import annotations

import re

import pytest
import torch
from accelerate.utils import set_seed
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file

from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.export.comfy import COMFY_FILE
from runner.export.config import ExportConfig
from runner.export.lora import DIFFUSERS_FILE, KOHYA_FILE, write_lora_files
from runner.resolved import resolve

pytestmark = pytest.mark.usefixtures("one_thread")

RANK, ALPHA = 4, 8.0
LORA = ["model.train=lora", f"model.lora_rank={RANK}", f"model.lora_alpha={ALPHA}"]

# ComfyUI's Lumina 2 model (comfy/ldm/lumina/model.py, NextDiT): weight name -> the diffusers
# Lumina2Transformer2DModel weights whose rows it holds, in order (JointAttention.qkv is split q, k, v
# in its forward; the rest are one linear each; diffusers' convert_lumina2_to_diffusers is the inverse).
_B = r"(?P<b>(?:layers|noise_refiner|context_refiner)\.\d+)"
NEXTDIT = (
    (_B + r"\.attention\.qkv", ("{b}.attn.to_q", "{b}.attn.to_k", "{b}.attn.to_v")),
    (_B + r"\.attention\.out", ("{b}.attn.to_out.0",)),
    (_B + r"\.feed_forward\.w(?P<i>[123])", ("{b}.feed_forward.linear_{i}",)),
    (_B + r"\.adaLN_modulation\.1", ("{b}.norm1.linear",)),
    (r"cap_embedder\.1", ("time_caption_embed.caption_embedder.1",)),
    (r"t_embedder\.mlp\.0", ("time_caption_embed.timestep_embedder.linear_1",)),
    (r"t_embedder\.mlp\.2", ("time_caption_embed.timestep_embedder.linear_2",)),
    (r"final_layer\.adaLN_modulation\.1", ("norm_out.linear_1",)),
    (r"final_layer\.linear", ("norm_out.linear_2",)),
    (r"x_embedder", ("x_embedder",)),
)
# Blocks and names of ComfyUI's NextDiT at the tiny config (3 layers, 1 refiner of each kind; the
# context refiner has no adaLN modulation, as in ComfyUI's JointTransformerBlock(modulation=False)).
NEXTDIT_NAMES = (
    [f"{b}.{w}" for b in ("layers.0", "layers.1", "layers.2", "noise_refiner.0")
     for w in ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
               "adaLN_modulation.1")]
    + [f"context_refiner.0.{w}" for w in ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2",
                                          "feed_forward.w3")]
    + ["cap_embedder.1", "t_embedder.mlp.0", "t_embedder.mlp.2", "final_layer.adaLN_modulation.1",
       "final_layer.linear", "x_embedder"]
)

# One linear per diffusers module under the same name (identity).
IDENTITY = ((r"(?P<n>.+)", ("{n}",)),)
# ComfyUI's HiDream model (comfy/ldm/hidream/model.py) has diffusers' module names (HiDreamBlock.block,
# HiDreamAttention.to_q ... to_out_t, MOEFeedForwardSwiGLU.experts.N.w1, TextProjection.linear), one linear each;
# a few of its weights, which the tiny model must have too.
HIDREAM = IDENTITY
HIDREAM_NAMES = ("double_stream_blocks.0.block.attn1.to_q_t", "double_stream_blocks.1.block.attn1.to_out_t",
                 "single_stream_blocks.1.block.attn1.to_out", "double_stream_blocks.0.block.ff_i.experts.3.w2",
                 "single_stream_blocks.0.block.ff_i.shared_experts.w1", "caption_projection.4.linear")

# ComfyUI's Wan model (comfy/ldm/wan/model.py, the original Wan layout): one linear each; the attention's.
WAN = (
    (r"blocks\.(?P<i>\d+)\.self_attn\.(?P<p>[qkv])", ("blocks.{i}.attn1.to_{p}",)),
    (r"blocks\.(?P<i>\d+)\.self_attn\.o", ("blocks.{i}.attn1.to_out.0",)),
    (r"blocks\.(?P<i>\d+)\.cross_attn\.(?P<p>[qkv])", ("blocks.{i}.attn2.to_{p}",)),
    (r"blocks\.(?P<i>\d+)\.cross_attn\.o", ("blocks.{i}.attn2.to_out.0",)),
)


def wan_names(module) -> list[str]:
    return [f"blocks.{i}.{a}.{p}" for i in range(len(module.blocks)) for a in ("self_attn", "cross_attn")
            for p in "qkvo"]


# ComfyUI's FLUX.2 model (BFL's layout, comfy/ldm/flux/model.py): the image stream's attention of each
# double block is one qkv linear (rows q, k, v) and a proj.
FLUX2 = (
    (r"double_blocks\.(?P<i>\d+)\.img_attn\.qkv", ("transformer_blocks.{i}.attn.to_q", "transformer_blocks.{i}.attn.to_k",
                                                     "transformer_blocks.{i}.attn.to_v")),
    (r"double_blocks\.(?P<i>\d+)\.img_attn\.proj", ("transformer_blocks.{i}.attn.to_out.0",)),
)


def flux2_names(module) -> list[str]:
    return [f"double_blocks.{i}.img_attn.{w}" for i in range(len(module.transformer_blocks)) for w in ("qkv", "proj")]


# ComfyUI's Flux model (BFL's layout; Kontext and Chroma load as Flux models): the default targets' weights.
# Each double block's image qkv is one linear (rows q, k, v), each single block's linear1 holds q, k, v then
# the MLP's input; the kohya file's lora_transformer_<diffusers name> keys patch slices of them
# (comfy/utils.py flux_to_diffusers: (weight, (dim 0, offset, hidden size))).
FLUX = (
    (r"double_blocks\.(?P<i>\d+)\.img_attn\.qkv", ("transformer_blocks.{i}.attn.to_q", "transformer_blocks.{i}.attn.to_k",
                                                     "transformer_blocks.{i}.attn.to_v")),
    (r"double_blocks\.(?P<i>\d+)\.img_attn\.proj", ("transformer_blocks.{i}.attn.to_out.0",)),
    (r"single_blocks\.(?P<i>\d+)\.linear1", ("single_transformer_blocks.{i}.attn.to_q", "single_transformer_blocks.{i}.attn.to_k",
                                               "single_transformer_blocks.{i}.attn.to_v", "single_transformer_blocks.{i}.proj_mlp")),
)


def flux_names(module) -> list[str]:
    return ([f"double_blocks.{i}.img_attn.{w}" for i in range(len(module.transformer_blocks)) for w in ("qkv", "proj")]
            + [f"single_blocks.{i}.linear1" for i in range(len(module.single_transformer_blocks))])


def flux_keys(module) -> dict:
    """ComfyUI's flux_to_diffusers keys for the kohya (OneTrainer) prefix, the default targets' modules."""
    h = module.config.num_attention_heads * module.config.attention_head_dim
    keys: dict = {}
    for i in range(len(module.transformer_blocks)):
        for j, p in enumerate("qkv"):
            keys[f"lora_transformer_transformer_blocks_{i}_attn_to_{p}"] = (
                f"diffusion_model.double_blocks.{i}.img_attn.qkv.weight", (0, j * h, h))
        keys[f"lora_transformer_transformer_blocks_{i}_attn_to_out_0"] = f"diffusion_model.double_blocks.{i}.img_attn.proj.weight"
    for i in range(len(module.single_transformer_blocks)):
        for j, p in enumerate("qkv"):
            keys[f"lora_transformer_single_transformer_blocks_{i}_attn_to_{p}"] = (
                f"diffusion_model.single_blocks.{i}.linear1.weight", (0, j * h, h))
    return keys


# ComfyUI's HunyuanVideo model as it loads HunyuanVideo 1.5 (comfy/ldm/hunyuan_video/model.py: Flux's DoubleStreamBlock,
# one qkv linear per stream, rows q, k, v; its token refiner's SelfAttentionRef.qkv likewise; the rest one linear each).
_HB, _HT = r"double_blocks\.(?P<i>\d+)", "transformer_blocks.{i}"
_HR, _HD = r"txt_in\.individual_token_refiner\.blocks\.(?P<i>\d+)", "context_embedder.token_refiner.refiner_blocks.{i}"
HUNYUAN_VIDEO = (
    (_HB + r"\.img_attn\.qkv", tuple(f"{_HT}.attn.to_{p}" for p in "qkv")),
    (_HB + r"\.txt_attn\.qkv", tuple(f"{_HT}.attn.add_{p}_proj" for p in "qkv")),
    (_HB + r"\.img_attn\.proj", (f"{_HT}.attn.to_out.0",)),
    (_HB + r"\.txt_attn\.proj", (f"{_HT}.attn.to_add_out",)),
    (_HB + r"\.img_mlp\.0", (f"{_HT}.ff.net.0.proj",)),
    (_HB + r"\.img_mlp\.2", (f"{_HT}.ff.net.2",)),
    (_HB + r"\.txt_mlp\.0", (f"{_HT}.ff_context.net.0.proj",)),
    (_HB + r"\.txt_mlp\.2", (f"{_HT}.ff_context.net.2",)),
    (_HB + r"\.img_mod\.lin", (f"{_HT}.norm1.linear",)),
    (_HB + r"\.txt_mod\.lin", (f"{_HT}.norm1_context.linear",)),
    (_HR + r"\.self_attn\.qkv", tuple(f"{_HD}.attn.to_{p}" for p in "qkv")),
    (_HR + r"\.self_attn\.proj", (f"{_HD}.attn.to_out.0",)),
    (_HR + r"\.mlp\.0", (f"{_HD}.ff.net.0.proj",)),
    (_HR + r"\.mlp\.2", (f"{_HD}.ff.net.2",)),
    (_HR + r"\.adaLN_modulation\.1", (f"{_HD}.norm_out.linear",)),
)
HV15_TARGETS = "[to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,ff.net.0.proj,ff.net.2,norm1.linear]"


def hunyuan_video_names(module) -> list[str]:
    double = [f"double_blocks.{i}.{s}_{w}" for i in range(len(module.transformer_blocks)) for s in ("img", "txt")
              for w in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2", "mod.lin")]
    refiner = [f"txt_in.individual_token_refiner.blocks.{i}.{w}"
               for i in range(len(module.context_embedder.token_refiner.refiner_blocks))
               for w in ("self_attn.qkv", "self_attn.proj", "mlp.0", "mlp.2", "adaLN_modulation.1")]
    return double + refiner
# ComfyUI's Z-Image model (its Lumina 2 NextDiT, comfy/ldm/lumina/model.py): q/k/v are one attention.qkv (rows q, k, v,
# each dim wide), to_out.0 is attention.out, the grouped embedder / final layer drop diffusers' "all_"/"2-1" names.
_ZB = r"(?P<b>(?:layers|noise_refiner|context_refiner)\.\d+)"
Z_IMAGE = (
    (_ZB + r"\.attention\.qkv", tuple(f"{{b}}.attention.to_{p}" for p in "qkv")),
    (_ZB + r"\.attention\.out", ("{b}.attention.to_out.0",)),
    (r"final_layer\.(?P<r>.+)", ("all_final_layer.2-1.{r}",)),
    (r"x_embedder", ("all_x_embedder.2-1",)),
    (r"(?P<n>.+)", ("{n}",)),
)
_Z_TOP = {"final_layer.linear": "all_final_layer.2-1.linear", "x_embedder": "all_x_embedder.2-1",
          "final_layer.adaLN_modulation.1": "all_final_layer.2-1.adaLN_modulation.1",
          **{n: n for n in ("cap_embedder.1", "t_embedder.mlp.0", "t_embedder.mlp.2")}}


def z_image_blocks(module) -> list[tuple[str, bool]]:
    """(block, has adaLN modulation): the context refiner has none."""
    return ([(f"layers.{i}", True) for i in range(len(module.layers))]
            + [(f"noise_refiner.{i}", True) for i in range(len(module.noise_refiner))]
            + [(f"context_refiner.{i}", False) for i in range(len(module.context_refiner))])


def z_image_names(module) -> list[str]:
    return [f"{b}.{w}" for b, ada in z_image_blocks(module)
            for w in ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
                      *(("adaLN_modulation.0",) if ada else ()))] + list(_Z_TOP)


def z_image_keys(module) -> dict:
    """ComfyUI's keys for a Z-Image LoRA (comfy/lora.py model_lora_keys_unet, its Lumina2 branch over comfy/utils.py
    z_image_to_diffusers): ``diffusion_model.<diffusers name>``; to_q/to_k/to_v patch row slices (0, j x dim, dim) of
    qkv."""
    h, d = module.config.dim, "diffusion_model"
    keys: dict = {f"{d}.{n}": f"{d}.{n}.weight" for n in z_image_names(module)}  # its generic keys, and the branch's:
    keys |= {f"{d}.{diff}": f"{d}.{comfy}.weight" for comfy, diff in _Z_TOP.items()}
    for b, ada in z_image_blocks(module):
        for j, p in enumerate("qkv"):
            keys[f"{d}.{b}.attention.to_{p}"] = (f"{d}.{b}.attention.qkv.weight", (0, j * h, h))
        keys[f"{d}.{b}.attention.to_out.0"] = f"{d}.{b}.attention.out.weight"
        for w in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", *(("adaLN_modulation.0",) if ada else ())):
            keys[f"{d}.{b}.{w}"] = f"{d}.{b}.{w}.weight"
    return keys


# ComfyUI's Krea 2 model (the original krea-ai/krea-2 names; comfy/utils.py krea2_to_diffusers maps diffusers' onto
# them): one linear each.
_KA = {"wq": "to_q", "wk": "to_k", "wv": "to_v", "wo": "to_out.0", "gate": "to_gate"}
KREA2 = (
    *((rf"blocks\.(?P<i>\d+)\.attn\.{c}", (f"transformer_blocks.{{i}}.attn.{d}",)) for c, d in _KA.items()),
    (r"blocks\.(?P<i>\d+)\.mlp\.(?P<p>gate|up|down)", ("transformer_blocks.{i}.ff.{p}",)),
    *((rf"txtfusion\.(?P<k>\w+_blocks)\.(?P<i>\d+)\.attn\.{c}", (f"text_fusion.{{k}}.{{i}}.attn.{d}",))
      for c, d in _KA.items()),
    (r"txtfusion\.(?P<k>\w+_blocks)\.(?P<i>\d+)\.mlp\.(?P<p>gate|up|down)", ("text_fusion.{k}.{i}.ff.{p}",)),
)


def krea2_names(module) -> list[str]:
    blocks = [f"blocks.{i}" for i in range(len(module.transformer_blocks))] + [
        f"txtfusion.{k}.{i}" for k in ("layerwise_blocks", "refiner_blocks")
        for i in range(len(getattr(module.text_fusion, k)))]
    return [f"{b}.{w}" for b in blocks for w in (*(f"attn.{c}" for c in _KA), "mlp.gate", "mlp.up", "mlp.down")]


# ComfyUI's Qwen-Image 2.1 model: diffusers' names, but each block's gate_layer and proj are one img_mlp.gate_up
# (rows gate, then up); comfy/lora.py model_lora_keys_unet maps LoRA keys for the halves onto its row slices.
QWEN21 = ((r"(?P<b>transformer_blocks\.\d+)\.img_mlp\.gate_up", ("{b}.img_mlp.gate_layer", "{b}.img_mlp.proj")),
          *IDENTITY)


def qwen21_names(module) -> list[str]:
    return [n.replace(".gate_layer", ".gate_up") for n in sorted(weights(module, False))
            if not n.endswith(".img_mlp.proj")]


# ComfyUI's LTX-2 model (the original ltx-core names; diffusers' _convert_non_diffusers_ltx2_lora_to_diffusers is
# the inverse): the block linears carry diffusers' names, the top-level ones below are renamed.
LTX2 = (
    (r"patchify_proj", ("proj_in",)),
    (r"audio_patchify_proj", ("audio_proj_in",)),
    (r"(?P<a>audio_)?adaln_single\.(?P<r>.+)", ("{a}time_embed.{r}",)),
    (r"(?P<n>.+)", ("{n}",)),
)


def ltx2_names(module) -> list[str]:
    """ComfyUI's names of the tiny LTX-2 transformer's block linears, attention and feed-forward of both streams."""
    return sorted(n for n in weights(module, False) if n.startswith("transformer_blocks."))


# case -> (run overrides, ComfyUI's model table, its weight names: a list, a function of the diffusers
# denoiser, or None = every linear of the diffusers model[, ComfyUI's LoRA key map of the denoiser[, the file]])
CASES = {
    # the default targets (q, k, v, out): one fused qkv LoRA per block
    "lumina2": (["trainer=lumina2"], NEXTDIT, NEXTDIT_NAMES),
    # k left out (its rows stay zero; under GQA k and v are narrower than q), feed-forward and modulation too
    "lumina2_qv_ffn": (["trainer=lumina2", "model.lora_targets=[to_q,to_v,feed_forward.linear_1,norm1.linear]"],
                       NEXTDIT, NEXTDIT_NAMES),
    "hidream": (["trainer=hidream", "model.lora_targets=[to_q,to_k,to_v,to_out,to_q_t,to_out_t,w1]"], HIDREAM, None),
    # the default targets; Wan 2.2 TI2V-5B, and one expert of Wan 2.2 I2V A14B (each expert's file is one of these)
    "wan22_5b": (["trainer=wan", "trainer.variant=2.2-5b"], WAN, wan_names),
    "wan22_i2v_a14b": (["trainer=wan", "trainer.variant=i2v-2.2-a14b", "trainer.experts=high", "data.frames=5"], WAN,
                       wan_names),
    # Wan 2.2 T2V A14B, one expert (the low-noise one; each expert's file is one of these)
    "wan22_a14b": (["trainer=wan", "trainer.variant=2.2-a14b", "trainer.experts=low"], WAN, wan_names),
    # FLUX.2 dev and klein: q/k/v fused into BFL's qkv, the scale in B and no .alpha (ComfyUI applies it as stored)
    "flux2_klein": (["trainer=flux2_klein"], FLUX2, flux2_names),
    "flux2": (["trainer=flux2"], FLUX2, flux2_names),
    # LTX-2: LoRAs on every attention of both streams and the audio-video cross attentions, the scale in B
    "ltx2": (["trainer=ltx2", "model.lora_targets=[to_q,to_k,to_v,to_out.0,proj_in,audio_proj_in]"], LTX2,
             lambda m: ltx2_names(m) + ["patchify_proj", "audio_patchify_proj"]),
    # Qwen-Image-Edit: ComfyUI loads it as its Qwen-Image model, whose modules carry diffusers' names
    "qwen_image_edit": (["trainer=qwen_image_edit", "data.references=1"], IDENTITY, lambda m: sorted(weights(m, False))),
    # Flux.1 Kontext and Chroma: the kohya file (lora_kohya.safetensors) is their ComfyUI file
    "flux_kontext": (["trainer=flux_kontext", "data.references=1"], FLUX, flux_names, flux_keys, KOHYA_FILE),
    "chroma": (["trainer=chroma"], FLUX, flux_names, flux_keys, KOHYA_FILE),
    # HunyuanVideo 1.5: both streams' q/k/v fused into ComfyUI's qkv, the MLPs and modulations of blocks and refiner
    "hunyuan_video15": (["trainer=hunyuan_video15", f"model.lora_targets={HV15_TARGETS}"], HUNYUAN_VIDEO,
                        hunyuan_video_names),
    # Krea 2: the original krea-2 names, the scale in B; every attention of the blocks and the text fusion's
    "krea2": (["trainer=krea2"], KREA2, krea2_names),
    # Qwen-Image 2.1: the default targets (attention), then the MLP ComfyUI fuses (gate_layer and proj into gate_up)
    "qwen_image21": (["trainer=qwen_image21"], QWEN21, qwen21_names),
    "qwen_image21_mlp": (["trainer=qwen_image21", "model.lora_targets=[to_q,gate_layer,proj,img_mlp.out]"], QWEN21,
                         qwen21_names),
    # Z-Image: diffusers' names, which ComfyUI maps onto its NextDiT (q/k/v onto slices of the fused qkv)
    "z_image": (["trainer=z_image"], Z_IMAGE, z_image_names, z_image_keys),
    # k and out (q, v rows stay zero), feed-forward, modulations, embedders and the final layer (the final layer's
    # adaLN_modulation.0 is a SiLU, so the blocks' are named whole)
    "z_image_ffn": (["trainer=z_image", "model.lora_targets=[to_k,to_out.0,w2,layers.1.adaLN_modulation.0,"
                     "noise_refiner.0.adaLN_modulation.0,all_x_embedder.2-1,all_final_layer.2-1.linear,"
                     "all_final_layer.2-1.adaLN_modulation.1,cap_embedder.1,t_embedder.mlp.2]"],
                    Z_IMAGE, z_image_names, z_image_keys),
}


def comfy_model(weights: dict[str, torch.Tensor], table, names) -> dict[str, torch.Tensor]:
    """ComfyUI's model state dict (``diffusion_model.<name>.weight``) from diffusers' weights."""
    out = {}
    for name in names:
        pattern, rows = next((p, r) for p, r in table if re.fullmatch(p, name))
        groups = re.fullmatch(pattern, name).groupdict()
        out[f"diffusion_model.{name}.weight"] = torch.cat([weights[r.format(**groups)] for r in rows], dim=0)
    return out


def apply_like_comfyui(model: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], strength: float = 1.0,
                       key_map: dict | None = None) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(patched model, the file's keys ComfyUI would not load). ``key_map``: LoRA key -> model weight, or
    (weight, (dim, offset, size)) for a slice of it (ComfyUI's flux_to_diffusers); default the generic
    ``diffusion_model.<weight less .weight>`` keys."""
    key_map = key_map or {k.removesuffix(".weight"): k for k in model}
    patched, loaded = {k: v.clone() for k, v in model.items()}, set()
    for key, target in key_map.items():
        weight, (dim, offset, size) = target if isinstance(target, tuple) else (target, (0, 0, model[target].shape[0]))
        for up_name, down_name in (("lora_B.weight", "lora_A.weight"), ("lora_up.weight", "lora_down.weight")):
            if f"{key}.{up_name}" in lora:
                up, down = lora[f"{key}.{up_name}"], lora[f"{key}.{down_name}"]
                alpha = lora[f"{key}.alpha"].item() / down.shape[0] if f"{key}.alpha" in lora else 1.0
                part = patched[weight].narrow(dim, offset, size)
                part += strength * alpha * (up @ down).reshape(part.shape)
                loaded |= {f"{key}.{up_name}", f"{key}.{down_name}", f"{key}.alpha"}
    return patched, set(lora) - loaded


def adapted(overrides: list[str]):
    """(trainer, denoiser with a random non-zero adapter) of the tiny model."""
    cfg = compose_config([*overrides, "train.device=cpu", "train.batch_size=1", "data.demo_size=2", *LORA])
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    set_seed(run.seed)
    module = prepare_models(trainer.build_models("cpu"), cfg.model, run)[trainer.denoiser]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return trainer, module


def weights(module: torch.nn.Module, merged: bool) -> dict[str, torch.Tensor]:
    """Every linear's weight by diffusers' module name; ``merged``: plus peft's delta (the fused weight)."""
    out = {}
    for name, m in module.named_modules():
        if isinstance(m, LoraLayer):
            base = m.get_base_layer().weight.detach()
            out[name] = base + m.get_delta_weight("default").detach() if merged else base
        elif isinstance(m, torch.nn.Linear) and not name.endswith(".base_layer") and ".lora_" not in name:
            out[name] = m.weight.detach()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_comfyui_applies_the_file_at_the_trained_strength(tmp_path, case):
    overrides, table, names, *keys = CASES[case]
    comfy_file = keys[1] if len(keys) > 1 else COMFY_FILE
    trainer, module = adapted(overrides)
    files = write_lora_files(trainer, trainer.pipeline_class(), trainer.denoiser, module, tmp_path, {"step": 1},
                             ExportConfig())
    assert files == [DIFFUSERS_FILE, comfy_file]
    lora = load_file(str(tmp_path / comfy_file))
    key_map = keys[0](module) if keys else None
    if names is None:
        names = sorted(weights(module, merged=False))
        assert set(HIDREAM_NAMES) <= set(names)
    elif callable(names):
        names = names(module)
    base = comfy_model(weights(module, merged=False), table, names)
    patched, not_loaded = apply_like_comfyui(base, lora, key_map=key_map)
    assert not_loaded == set()
    expected = comfy_model(weights(module, merged=True), table, names)
    changed = [k for k in base if not torch.equal(expected[k], base[k])]
    assert changed and all(not torch.equal(patched[k], base[k]) for k in changed)
    for k in base:
        torch.testing.assert_close(patched[k], expected[k], rtol=1e-5, atol=1e-6)
    # a half strength gives half the update: the scale is alpha / rank, not the file's rank
    half, _ = apply_like_comfyui(base, lora, 0.5, key_map)
    k = changed[0]
    torch.testing.assert_close(half[k] - base[k], (expected[k] - base[k]) / 2, rtol=1e-5, atol=1e-6)


def test_the_fused_lumina2_qkv_lora_is_rank_3r_with_3_alpha():
    """One ``attention.qkv`` module per block: the three downs stacked (3r rows), the up block-diagonal
    over q, k, v's rows (GQA: q wider), ``.alpha`` = 3 x alpha so alpha / rank is the run's."""
    _, module = adapted(CASES["lumina2"][0])
    from runner.export.comfy import LAYOUTS, comfy_state_dict, linear_widths
    from runner.export.lora import lora_state_dict

    sd = comfy_state_dict(lora_state_dict(module), LAYOUTS["lumina2"], ALPHA, linear_widths(module))
    key = "diffusion_model.layers.1.attention.qkv"
    a, b, alpha = sd[f"{key}.lora_A.weight"], sd[f"{key}.lora_B.weight"], sd[f"{key}.alpha"]
    q = module.layers[1].attn.to_q
    qo, ko = q.out_features, module.layers[1].attn.to_k.out_features
    assert a.shape == (3 * RANK, q.in_features) and b.shape == (qo + 2 * ko, 3 * RANK) and qo == 2 * ko
    assert alpha.item() == 3 * ALPHA and alpha.item() / a.shape[0] == ALPHA / RANK
    assert not b[:qo, RANK:].any() and not b[qo:qo + ko, :RANK].any() and not b[qo + ko:, :2 * RANK].any()
    assert not any(".to_q." in k or ".to_k." in k for k in sd)


def test_full_size_lumina2_qkv_has_comfyuis_rows():
    """Lumina-Image-2.0 on meta: q 24 heads, k and v 8 (GQA), head dim 96 -> NextDiT's qkv has
    (24 + 8 + 8) * 96 = 3840 rows; the fused up weight has them, an unadapted k included."""
    from runner.export.comfy import LAYOUTS, comfy_state_dict, linear_widths
    from runner.families.common.loading import build_module

    cfg = compose_config(["trainer=lumina2", "model.size=full", "train.device=cpu"])
    trainer = build_trainer(cfg, resolve(cfg))
    model = build_module(trainer.module_classes()["transformer"], trainer.size_configs()["transformer"], "meta",
                         torch.float32)
    widths = linear_widths(model)
    peft = {f"layers.25.attn.to_{p}.lora_{s}.weight": torch.zeros(*shape, device="meta") for p in "qv"
            for s, shape in (("A", (RANK, 2304)), ("B", (widths[f"layers.25.attn.to_{p}"], RANK)))}
    sd = comfy_state_dict(peft, LAYOUTS["lumina2"], ALPHA, widths)
    assert sd["diffusion_model.layers.25.attention.qkv.lora_B.weight"].shape == (3840, 2 * RANK)
    assert sd["diffusion_model.layers.25.attention.qkv.alpha"].item() == 2 * ALPHA


def test_a_lokr_on_lumina2_q_k_v_is_refused_for_the_comfyui_file():
    """A LoKr's Kronecker factors of q, k, v have no exact fused form: refused before step 1, naming the way out."""
    cfg = compose_config(["trainer=lumina2", "train.device=cpu", "model.train=lokr"])
    with pytest.raises(UserError, match=r"model.train=lokr adapts .* Lumina 2 module.*one fused linear .*model.train=lora"):
        build_trainer(cfg, resolve(cfg)).build_models("meta")
