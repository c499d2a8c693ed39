"""``export.*``: the schema of the exports (registered in runner/config/__init__.py's RunConfig)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.errors import UserError, valid_list

LORA_FORMATS = ("diffusers", "kohya", "comfy", "both")
LYCORIS_KINDS = ("lokr", "loha")  # model.train values written in LyCORIS' tensor names (runner/export/lycoris.py)
FULL_FORMATS = ("diffusers", "single_file", "both")
# Families whose full fine-tune export.full_format=single_file|both writes as one original-layout file
# (runner/export/single_file.py): those whose original single file model.path reads, so each export is a
# file the runner reads back bit for bit. The others are refused before step 1 (check_full_format).
SINGLE_FILE_FAMILIES = ("sdxl", "flux", "sd", "sd3", "qwen_image", "wan", "z_image")  # trainer=sdxl, flux, sd15
# (variant sd15), sd35, qwen_image, wan, z_image


@dataclass
class ExportConfig:
    enabled: bool = True  # export the final checkpoint at the end of training (mode=export always exports)
    # model.train=lora: diffusers | kohya (A1111, Forge, ComfyUI: U-Nets and Flux) | comfy (ComfyUI and Forge at
    # the trained strength, every family: the kohya file where that is ComfyUI's layout, else lora_comfy.safetensors)
    # | both (diffusers + comfy)
    lora_format: str = "both"
    # model.train=full: diffusers (a pipeline folder for from_pretrained) | single_file (one safetensors file in
    # the original layout: SDXL's or SD1.5's whole checkpoint for A1111/Forge/ComfyUI, the transformer of Flux,
    # SD3.5, Qwen-Image or Wan for ComfyUI's diffusion_models) | both
    full_format: str = "diffusers"

    def wants(self, fmt: str) -> bool:
        """Whether ``lora_format`` asks for the LoRA format ``fmt`` (diffusers, kohya or comfy).

        ``both`` (the default) is diffusers + comfy; for U-Nets and Flux the comfy file is the kohya
        file, so the default writes what it wrote before ComfyUI files existed, and one ComfyUI
        file more for SD3.5, Qwen-Image and Wan (runner/export/comfy.py)."""
        return self.lora_format in (fmt, "both")

    def wants_full(self, fmt: str) -> bool:
        """Whether ``full_format`` asks for the full fine-tune format ``fmt`` (diffusers or single_file)."""
        return self.full_format in (fmt, "both")


def export_config(cfg: Any) -> ExportConfig:
    """The run's ``export`` node as a plain dataclass (defaults when the node is absent)."""
    node = cfg.get("export") if hasattr(cfg, "get") else None
    if node is None:
        return ExportConfig()
    return ExportConfig(enabled=bool(node.get("enabled", True)), lora_format=str(node.get("lora_format", "both")),
                        full_format=str(node.get("full_format", "diffusers")))


def validate_export(cfg: Any) -> None:
    """Checked before anything is built: a typo must not cost a whole run before the export fails."""
    ec = export_config(cfg)
    for key, value, valid in (("export.lora_format", ec.lora_format, LORA_FORMATS),
                              ("export.full_format", ec.full_format, FULL_FORMATS)):
        if value not in valid:
            raise UserError(f"{key}={value!r} is not valid. Valid values: {valid_list(value, valid)}.")
    model = cfg.get("model") if hasattr(cfg, "get") else None
    if model is not None and model.get("lora_dora", False) and ec.lora_format in ("kohya", "comfy"):
        raise UserError(
            f"export.lora_format={ec.lora_format} with model.lora_dora=true: the kohya/ComfyUI layout stores DoRA's "
            "magnitude as dora_scale, which ComfyUI and Forge apply with their own weight norm, not peft's, so the "
            "runner cannot check the file loads the trained weights and does not write one. Use "
            "export.lora_format=diffusers or both (both writes the diffusers file alone for DoRA)."
        )
    train = str(model.get("train", "full")) if model is not None else "full"
    if train in LYCORIS_KINDS and ec.lora_format in ("diffusers", "kohya"):
        raise UserError(
            f"export.lora_format={ec.lora_format} with model.train={train}: diffusers has no loader for a {train} "
            "adapter of the families the runner trains (its LoKr reader serves Z-Image and Flux.2 only; LoHa has "
            f"none), so no such file is written. Use export.lora_format=comfy or both (both writes the ComfyUI "
            f"file, lora_comfy.safetensors, alone for {train}).")
    if cfg.get("mode") == "export" and not cfg.train.get("resume"):
        raise UserError(
            "mode=export needs train.resume=<checkpoint>: a run directory (its newest checkpoint is exported) "
            "or one of its checkpoints/step-N directories."
        )


def check_full_format(cfg: Any, trainer: Any) -> None:
    """``export.full_format`` against the run, once the trainer is built (before step 1): a single file is
    written for a full fine-tune of a family in :data:`SINGLE_FILE_FAMILIES`; anything else is refused
    rather than found out after training."""
    ec = export_config(cfg)
    if ec.full_format == "diffusers" or ec.full_format not in FULL_FORMATS:
        return
    model = cfg.get("model") if hasattr(cfg, "get") else None
    train = str(model.get("train", "full")) if model is not None else "full"
    if train != "full":
        raise UserError(
            f"export.full_format={ec.full_format} applies to a full fine-tune, and this run is model.train={train}. "
            "A LoRA's files are chosen with export.lora_format (diffusers, kohya, comfy or both); drop "
            "export.full_format or set model.train=full."
        )
    family = str(getattr(trainer, "family", "") or "")
    if family not in SINGLE_FILE_FAMILIES:
        name = getattr(trainer, "display_name", "") or type(trainer).__name__
        raise UserError(
            f"export.full_format={ec.full_format}: no single-file export is written for {name} yet. The runner writes "
            "a single file only in an original layout that model.path reads back, so that the export is checked "
            "bit for bit, and it does so for SDXL, Flux, SD1.5 (trainer.variant=sd15, not SD2.1, whose original "
            "OpenCLIP-H has a layer the diffusers form drops), SD3.5, Qwen-Image, Wan and Z-Image only. Use "
            "export.full_format=diffusers (the pipeline folder) for this trainer."
        )


def adapter_kind(config: object) -> str:
    """``lora``, ``lokr`` or ``loha``: the kind of a peft adapter config."""
    kind = str(getattr(config, "peft_type", "LORA")).split(".")[-1].lower()
    return kind if kind in LYCORIS_KINDS else "lora"
