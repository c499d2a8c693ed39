"""The ComfyUI LoRA names of HunyuanVideo 1.5 (data for runner/export/comfy.py's ``hunyuan_video15`` layout).

ComfyUI loads HunyuanVideo 1.5 as its HunyuanVideo model (comfy/model_detection.py: ``image_model``
``hunyuan_video``, with ``byt5``, ``use_cond_type_embedding`` and ``vision_in_dim``), whose dual-stream blocks are
Flux's ``DoubleStreamBlock`` (comfy/ldm/flux/layers.py): one fused ``img_attn.qkv``/``txt_attn.qkv`` linear,
``*_attn.proj``, ``*_mlp.0``/``.2`` and ``*_mod.lin``; its token refiner's blocks have a fused ``self_attn.qkv``,
``self_attn.proj``, ``mlp.0``/``.2`` and ``adaLN_modulation.1``. comfy/lora.py maps ``diffusion_model.<that model's
name>`` (its generic keys), so the file is keyed so, the q/k/v LoRAs fused into one (runner/export/comfy.py
``fuse_group``). Modulation rows need no
reordering: diffusers' converter copies ``img_mod.linear`` into ``norm1.linear`` as it is.
"""
from __future__ import annotations

_BLOCK = r"transformer_blocks\.(\d+)"
_REFINER = r"context_embedder\.token_refiner\.refiner_blocks\.(\d+)"
RENAMES: tuple[tuple[str, str], ...] = (
    (_BLOCK + r"\.attn\.to_out\.0", r"double_blocks.\1.img_attn.proj"),
    (_BLOCK + r"\.attn\.to_add_out", r"double_blocks.\1.txt_attn.proj"),
    (_BLOCK + r"\.ff\.net\.0\.proj", r"double_blocks.\1.img_mlp.0"),
    (_BLOCK + r"\.ff\.net\.2", r"double_blocks.\1.img_mlp.2"),
    (_BLOCK + r"\.ff_context\.net\.0\.proj", r"double_blocks.\1.txt_mlp.0"),
    (_BLOCK + r"\.ff_context\.net\.2", r"double_blocks.\1.txt_mlp.2"),
    (_BLOCK + r"\.norm1\.linear", r"double_blocks.\1.img_mod.lin"),
    (_BLOCK + r"\.norm1_context\.linear", r"double_blocks.\1.txt_mod.lin"),
    (_REFINER + r"\.attn\.to_out\.0", r"txt_in.individual_token_refiner.blocks.\1.self_attn.proj"),
    (_REFINER + r"\.ff\.net\.0\.proj", r"txt_in.individual_token_refiner.blocks.\1.mlp.0"),
    (_REFINER + r"\.ff\.net\.2", r"txt_in.individual_token_refiner.blocks.\1.mlp.2"),
    (_REFINER + r"\.norm_out\.linear", r"txt_in.individual_token_refiner.blocks.\1.adaLN_modulation.1"),
)
# (pattern with groups block and part, ComfyUI's fused name, a member's diffusers name, parts in row order)
FUSED: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (r"transformer_blocks\.(?P<block>\d+)\.attn\.to_(?P<part>[qkv])", r"double_blocks.\g<block>.img_attn.qkv",
     "transformer_blocks.{block}.attn.to_{part}", ("q", "k", "v")),
    (r"transformer_blocks\.(?P<block>\d+)\.attn\.add_(?P<part>[qkv])_proj", r"double_blocks.\g<block>.txt_attn.qkv",
     "transformer_blocks.{block}.attn.add_{part}_proj", ("q", "k", "v")),
    (_REFINER.replace(r"(\d+)", r"(?P<block>\d+)") + r"\.attn\.to_(?P<part>[qkv])",
     r"txt_in.individual_token_refiner.blocks.\g<block>.self_attn.qkv",
     "context_embedder.token_refiner.refiner_blocks.{block}.attn.to_{part}", ("q", "k", "v")),
)
