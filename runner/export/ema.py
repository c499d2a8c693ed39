"""The EMA of the trained weights, exported beside them (``ema.enabled``; runner/ema/average.py).

A checkpoint holding ``ema.safetensors`` gets, in ``checkpoints/step-N/export/``, the same files
for the average as for the trained weights:

* ``model.train=lora``: ``pytorch_lora_weights_ema.safetensors`` (diffusers) and/or
  ``lora_kohya_ema.safetensors`` (ComfyUI, Forge, A1111) and/or ``lora_comfy_ema.safetensors``
  (ComfyUI's layout of SD3.5, Qwen-Image, Wan), as ``export.lora_format`` asks;
* ``model.train=full``: ``diffusers_ema/``, a complete pipeline folder whose denoiser subfolder
  holds the EMA weights; every other file (VAE, text encoders, tokenizers, scheduler,
  ``model_index.json``) is a hard link to the file in ``diffusers/``, so it costs no disk (a copy
  where the file system has no hard links). ``DiffusionPipeline.from_pretrained(".../diffusers_ema")``
  loads it as it is; the denoiser alone is ``UNet2DConditionModel.from_pretrained(".../diffusers_ema",
  subfolder="unet")``;
  and/or (``export.full_format=single_file|both``) the family's single file of the average,
  ``checkpoint_ema.safetensors`` (SDXL, SD1.5: the EMA U-Net with the run's frozen modules) or
  ``diffusion_model_ema.safetensors`` (Flux, SD3.5, Qwen-Image, Wan) (runner/export/single_file.py).

How: the EMA tensors are copied into the trained parameters (cast to their dtype, so the export
has the trained weights' dtype, like the other files), the same writers run, and every parameter
then gets the checkpoint's trained value back from ``trainable.safetensors`` (what the models held:
the export is of that checkpoint). Both files are read a tensor at a time, so no second copy of
the weights is held in RAM. A sharded checkpoint (``dist=fsdp``) is read whole in this process
through DCP instead, its EMA (runner/ema/shards.py) and then its weights, as ``mode=export`` reads
the weights of one (a whole copy of the trained weights' size in RAM while it loads).
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from runner.ema.average import FILE, ema_info, has_ema
from runner.export.config import export_config
from runner.export.lora import write_lora_files
from runner.trainer import ModelSet

FULL_EMA_DIR = "diffusers_ema"


def _copy_file_into(params: dict[str, torch.nn.Parameter], path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f, torch.no_grad():
        names = set(f.keys())
        if names != set(params):
            raise ValueError(f"{path} holds {len(names)} tensors for {len(params)} trained parameters "
                             f"(e.g. missing {sorted(set(params) - names)[:2]})")
        for name, p in params.items():
            p.copy_(f.get_tensor(name))


@contextmanager
def ema_weights_in(models: ModelSet, ckpt: Path) -> Iterator[None]:
    """Inside the block the trained parameters hold ``ckpt``'s EMA weights; after it, its trained weights.
    A sharded checkpoint (dist=fsdp) is read whole in this process, both the EMA and the weights."""
    from runner.state.checkpoint import is_sharded

    params = dict(models.named_trainable_parameters())
    if is_sharded(ckpt):
        _copy_sharded_into(params, ckpt)
    else:
        _copy_file_into(params, ckpt / FILE)
    try:
        yield
    finally:
        if is_sharded(ckpt):
            from runner.state.checkpoint import load_trainable_weights

            load_trainable_weights(ckpt, models)
        else:
            _copy_file_into(params, ckpt / "trainable.safetensors")


def _copy_sharded_into(params: dict[str, torch.nn.Parameter], ckpt: Path) -> None:
    """The EMA of a sharded checkpoint (runner/ema/shards.py), read whole, into ``params``."""
    from runner.ema.average import SHARDED_META
    from runner.ema.shards import DTYPES, read_sharded

    dtype = DTYPES.get(json.loads((ckpt / SHARDED_META).read_text())["metadata"].get("dtype", "float32"), torch.float32)
    loaded = read_sharded(ckpt, list(params), list(params.values()), dtype)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(loaded[name])


def _link_tree(src: Path, dst: Path, skip: str) -> None:
    """Every file under ``src`` but the ``skip`` subfolder, hard-linked (else copied) to its place under ``dst``."""
    for root, _, names in os.walk(src):
        rel = Path(root).relative_to(src)
        if rel.parts and rel.parts[0] == skip:
            continue
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for n in names:
            try:
                os.link(Path(root) / n, dst / rel / n)
            except OSError:
                shutil.copy2(Path(root) / n, dst / rel / n)


def write_ema_exports(trainer: Any, models: ModelSet, ckpt: Path, folder: Path, info: dict[str, Any], cfg: Any,
                      denoiser: str, full_dir: str) -> list[str]:
    """Write the EMA files of ``ckpt`` into ``folder`` (the export being staged, whose ``full_dir``
    is written already for a full fine-tune); the names written, and ``info["ema"]``. Nothing
    when the checkpoint has no EMA."""
    if not has_ema(ckpt):
        return []
    lora = str(cfg.model.train) != "full"  # any adapter (lora, lokr, loha)
    ec = export_config(cfg)
    folder_too = not lora and ec.wants_full("diffusers")
    files: list[str] = []
    with ema_weights_in(models, ckpt):
        if lora:
            files += write_lora_files(trainer, trainer.pipeline_class(), denoiser, models[denoiser], folder,
                                      {**info, "weights": "ema"}, ec, ema=True)
        if folder_too:
            models[denoiser].save_pretrained(str(folder / FULL_EMA_DIR / denoiser), safe_serialization=True)
        if not lora and ec.wants_full("single_file"):
            from runner.export.single_file import write_single_file

            single = write_single_file(str(trainer.family), models, folder, {**info, "weights": "ema"}, ema=True)
    if folder_too:
        _link_tree(folder / full_dir, folder / FULL_EMA_DIR, skip=denoiser)
        files.append(FULL_EMA_DIR)
    if not lora and ec.wants_full("single_file"):
        files.append(single.name)
    info["ema"] = {**ema_info(ckpt), "files": files}
    return files
