"""A trained LoRA as files diffusers, ComfyUI, Forge and A1111 load.

Two layouts of the same weights:

* **diffusers**: peft's own state dict (``get_peft_model_state_dict``: adapter name removed,
  ``lora_A``/``lora_B``), written by the family pipeline's ``save_lora_weights`` with the
  ``LoraConfig`` in the file's ``lora_adapter_metadata``, so ``pipe.load_lora_weights(file)``
  rebuilds the adapter with this run's rank *and* alpha (without it diffusers would assume
  alpha = rank).
* **kohya** (what A1111, Forge and ComfyUI users load): ``<prefix>_<module path with _>`` keys
  with ``lora_down``/``lora_up`` and a per-module ``.alpha``; diffusers' own
  ``convert_state_dict_to_kohya`` does the renaming. Its ``.alpha`` is the rank (it assumes
  alpha = rank), so the run's alpha is written over it. The prefix is ``lora_unet`` for SDXL's
  U-Net; for Flux it is ``lora_transformer`` with diffusers' module names, the layout ComfyUI and
  Forge map for Flux (OneTrainer's) and diffusers reads back. Not written: sd-scripts' Flux layout
  (``lora_unet_double_blocks_*`` with fused qkv), whose diffusers reader assumes the full-size
  FLUX.1 widths, so it could not be checked on the tiny models the tests build.

DoRA (``model.lora_dora``) is written in the diffusers layout alone: its ``lora_magnitude_vector``
keys are what diffusers' loader detects DoRA by. The kohya/ComfyUI equivalent (``dora_scale``) is
applied by ComfyUI with a weight norm of its own choosing (of the base weight, not of base + B@A
as peft does), so such a file could not be checked to reproduce the trained weights.

* **comfy** (ComfyUI and Forge at the trained strength, every family): the kohya file where that is
  the layout ComfyUI maps (U-Nets, Flux), else ``lora_comfy.safetensors`` in the family's ComfyUI
  layout (SD3.5, Qwen-Image, Wan, Lumina 2 with q/k/v fused; runner/export/comfy.py; Flux.2: BFL's
  names with q/k/v fused, runner/families/flux2/comfy.py).

Every file carries the same plain metadata: rank, alpha, target modules, base model, preset, step
(and kohya's ``ss_network_*`` keys, which the UIs show).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from runner.export.comfy import COMFY_EMA_FILE, COMFY_FILE, LAYOUTS, comfy_state_dict, linear_widths
from runner.export.config import ExportConfig, adapter_kind
from runner.export.lycoris import comfy_lycoris_state_dict

log = logging.getLogger(__name__)

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
KOHYA_FILE = "lora_kohya.safetensors"
# The same two files of the EMA weights (ema.enabled; runner/export/ema.py).
DIFFUSERS_EMA_FILE = "pytorch_lora_weights_ema.safetensors"
KOHYA_EMA_FILE = "lora_kohya_ema.safetensors"

# Denoiser name in the trainer's ModelSet -> kohya key prefix (see the module docstring).
KOHYA_PREFIX = {"unet": "lora_unet", "transformer": "lora_transformer"}
# Pipeline class -> kohya's ss_base_model_version, which A1111/Forge use to filter LoRAs by model.
BASE_MODEL_VERSION = {"StableDiffusionXLPipeline": "sdxl_base_v1-0", "FluxPipeline": "flux1"}


def adapter_config(module: nn.Module) -> Any:
    """The module's peft ``LoraConfig`` (its one adapter: the runner attaches ``default``)."""
    configs = getattr(module, "peft_config", None)
    if not configs:
        raise ValueError(f"{type(module).__name__} has no peft adapter; nothing to export as a LoRA")
    return configs.get("default") or next(iter(configs.values()))


def lora_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """peft's state dict of the adapter (``…to_q.lora_A.weight``), on the CPU, contiguous."""
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(module).items()}


def lora_metadata(config: Any, info: dict[str, Any]) -> dict[str, str]:
    """safetensors metadata (strings only): the adapter's shape and where it came from
    (``info``: base_model, preset, step, trainer, pipeline class name)."""
    targets = sorted(config.target_modules) if not isinstance(config.target_modules, str) else [config.target_modules]
    meta = {
        "lora_rank": str(config.r),
        "lora_alpha": str(config.lora_alpha),
        "lora_target_modules": json.dumps(targets),
        "base_model": str(info.get("base_model", "")),
        "preset": str(info.get("preset") or ""),
        "step": str(info.get("step", "")),
        "trainer": str(info.get("trainer", "")),
        "weights": str(info.get("weights", "trained")),  # "ema": the average of the trained weights (runner/ema/average.py)
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(config.r),
        "ss_network_alpha": str(config.lora_alpha),
    }
    version = info.get("base_model_version") or BASE_MODEL_VERSION.get(str(info.get("pipeline", "")))
    if version:
        meta["ss_base_model_version"] = version
    return meta


def _add_metadata(path: Path, extra: dict[str, str]) -> None:
    """Rewrite ``path`` with ``extra`` merged into its metadata. safetensors cannot edit a header
    in place; a LoRA is megabytes, so reading it back once costs nothing."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**meta, **extra})


def write_diffusers_lora(pipeline_class: type, denoiser: str, module: nn.Module, folder: Path,
                         info: dict[str, Any], file_name: str = DIFFUSERS_FILE) -> Path:
    """``folder/pytorch_lora_weights.safetensors`` via ``pipeline_class.save_lora_weights``
    (a classmethod: no pipeline, so no frozen module, is needed); ``info`` as in :func:`lora_metadata`."""
    config = adapter_config(module)
    saver = pipeline_class
    if not hasattr(saver, "save_lora_weights"):  # a pipeline without a LoRA loader (HunyuanVideo 1.5 in 0.42.1):
        # the transformer-only layout every such loader writes (transformer.<peft key>, the adapter config in the
        # metadata), which the denoiser's own load_lora_adapter(prefix="transformer") reads
        from diffusers.loaders.lora_pipeline import HunyuanVideoLoraLoaderMixin as saver
    saver.save_lora_weights(
        str(folder),
        **{f"{denoiser}_lora_layers": lora_state_dict(module),
           f"{denoiser}_lora_adapter_metadata": config.to_dict()},
        weight_name=file_name,
        safe_serialization=True,
    )
    path = folder / file_name
    _add_metadata(path, lora_metadata(config, info))
    return path


def kohya_state_dict(peft_state: dict[str, torch.Tensor], prefix: str, alpha: float) -> dict[str, torch.Tensor]:
    """peft keys -> kohya keys with ``prefix`` (``lora_unet``, ``lora_transformer``) and the run's alpha.

    diffusers' converter knows the ``unet`` prefix only; every key is fed in under it and the
    prefix swapped afterwards (module paths of the SDXL U-Net and the Flux transformer never
    contain ``unet``, so the converter's ``replace`` touches the prefix alone).
    """
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya

    converted = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in peft_state.items()})
    out: dict[str, torch.Tensor] = {}
    for key, value in converted.items():
        if not key.startswith("lora_unet_"):  # the converter's contract, relied on below
            raise ValueError(f"diffusers' kohya converter returned an unexpected key {key!r}")
        key = prefix + key[len("lora_unet"):]
        if key.endswith(".alpha"):
            value = torch.tensor(float(alpha))
        out[key] = value.contiguous()
    return out


def write_kohya_lora(denoiser: str, module: nn.Module, folder: Path, info: dict[str, Any],
                     file_name: str = KOHYA_FILE) -> Path:
    """``folder/lora_kohya.safetensors``: the kohya layout for ComfyUI (models/loras), Forge and
    A1111 (models/Lora)."""
    if denoiser not in KOHYA_PREFIX:
        raise ValueError(f"no kohya key prefix is known for a denoiser named {denoiser!r}")
    config = adapter_config(module)
    state = kohya_state_dict(lora_state_dict(module), KOHYA_PREFIX[denoiser], float(config.lora_alpha))
    path = folder / file_name
    save_file(state, str(path), metadata={"format": "pt", **lora_metadata(config, info)})
    return path


def write_comfy_lora(layout_name: str, module: nn.Module, folder: Path, info: dict[str, Any],
                     file_name: str = COMFY_FILE) -> Path:
    """``folder/lora_comfy.safetensors``: the family's ComfyUI layout with ``.alpha`` (runner/export/comfy.py)."""
    config = adapter_config(module)
    if LAYOUTS[layout_name].style == "flux2":  # BFL's fused qkv (runner/families/flux2/comfy.py)
        from runner.families.flux2.comfy import flux2_comfy_state_dict

        state = flux2_comfy_state_dict(lora_state_dict(module), float(config.lora_alpha), int(config.r))
    else:
        state = comfy_state_dict(lora_state_dict(module), LAYOUTS[layout_name], float(config.lora_alpha),
                                 linear_widths(module))
    path = folder / file_name
    save_file(state, str(path), metadata={"format": "pt", **lora_metadata(config, info)})
    return path


def write_lycoris_file(kind: str, denoiser: str, layout_name: str, module: nn.Module, folder: Path,
                       info: dict[str, Any], file_name: str = COMFY_FILE) -> Path:
    """``folder/lora_comfy.safetensors`` of a LoKr/LoHa adapter in the family's ComfyUI layout; the
    kohya layout's prefix is the kohya file's (``lora_unet``, ``lora_transformer``)."""
    config = adapter_config(module)
    layout = LAYOUTS[layout_name]
    prefix = layout.prefix or KOHYA_PREFIX[denoiser]
    state = comfy_lycoris_state_dict(lora_state_dict(module), kind, layout, prefix, int(config.r), float(config.alpha))
    targets = sorted(config.target_modules) if not isinstance(config.target_modules, str) else [config.target_modules]
    meta = {"format": "pt", "adapter": kind, "lora_rank": str(config.r), "lora_alpha": str(config.alpha),
            "lora_target_modules": json.dumps(targets), "ss_network_module": "lycoris.kohya",
            "ss_network_args": json.dumps({"algo": kind}), "ss_network_dim": str(config.r),
            "ss_network_alpha": str(config.alpha),
            **{k: str(info.get(k, "") or "") for k in ("base_model", "preset", "step", "trainer")},
            "weights": str(info.get("weights", "trained"))}
    if kind == "lokr":
        meta["lokr_factor"] = str(config.decompose_factor)
    path = folder / file_name
    save_file(state, str(path), metadata=meta)
    return path


def write_lora_files(trainer: Any, pipeline_class: type, denoiser: str, module: nn.Module, folder: Path,
                     info: dict[str, Any], ec: ExportConfig, ema: bool = False) -> list[str]:
    """The LoRA files ``export.lora_format`` asks for, of ``module``'s adapter (``ema``: the
    ``*_ema`` names); the names written, diffusers, kohya, comfy in that order.

    The comfy format is the kohya file where the family's ComfyUI layout is kohya's
    (``trainer.comfy_layout``, default ``kohya``): one file, not two with the same bytes."""
    names = (DIFFUSERS_EMA_FILE, KOHYA_EMA_FILE, COMFY_EMA_FILE) if ema else (DIFFUSERS_FILE, KOHYA_FILE, COMFY_FILE)
    layout_name = str(getattr(trainer, "comfy_layout", "kohya"))
    separate = LAYOUTS[layout_name].separate
    kohya_ok = bool(getattr(trainer, "kohya_lora", True))
    kind = adapter_kind(adapter_config(module))
    if kind != "lora":  # LoKr, LoHa: the ComfyUI file only (runner/export/lycoris.py)
        if ec.wants("diffusers"):
            log.info("export: model.train=%s is written as the ComfyUI file only: diffusers has no loader for it "
                     "on this family", kind)
        return [write_lycoris_file(kind, denoiser, layout_name, module, folder, info, names[2]).name]
    files: list[str] = []
    if ec.wants("diffusers"):
        files.append(write_diffusers_lora(pipeline_class, denoiser, module, folder, info, file_name=names[0]).name)
    if getattr(adapter_config(module), "use_dora", False):  # export.lora_format=kohya|comfy was refused before step 1
        log.info("export: DoRA (model.lora_dora) is written as the diffusers file only: the kohya/ComfyUI "
                 "dora_scale layout is applied with another weight norm than peft's, so it could not be checked")
        return files
    if kohya_ok and (ec.wants("kohya") or (ec.wants("comfy") and not separate)):
        files.append(write_kohya_lora(denoiser, module, folder, info, file_name=names[1]).name)
    if separate and ec.wants("comfy"):
        files.append(write_comfy_lora(layout_name, module, folder, info, file_name=names[2]).name)
    if not kohya_ok and not separate and (ec.wants("kohya") or ec.wants("comfy")):
        log.info("export: no kohya-layout or ComfyUI file for %s: diffusers has no converter that reads one back "
                 "for %s and it has no ComfyUI layout (comfy_layout), so it could not be checked to load; the "
                 "diffusers file is the export", type(trainer).__qualname__, pipeline_class.__name__)
    return files
