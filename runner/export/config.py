"""``export.*``: the schema of the exports (registered in runner/config/__init__.py's RunConfig)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.errors import UserError, valid_list

LORA_FORMATS = ("diffusers", "kohya", "comfy", "both")
FULL_FORMATS = ("diffusers",)


@dataclass
class ExportConfig:
    enabled: bool = True  # export the final checkpoint at the end of training (mode=export always exports)
    # model.train=lora: diffusers | kohya (A1111, Forge, ComfyUI: U-Nets and Flux) | comfy (ComfyUI and Forge at
    # the trained strength, every family: the kohya file where that is ComfyUI's layout, else lora_comfy.safetensors)
    # | both (diffusers + comfy)
    lora_format: str = "both"
    full_format: str = "diffusers"  # model.train=full: diffusers (a pipeline folder for from_pretrained)

    def wants(self, fmt: str) -> bool:
        """Whether ``lora_format`` asks for the LoRA format ``fmt`` (diffusers, kohya or comfy).

        ``both`` (the default) is diffusers + comfy; for U-Nets and Flux the comfy file is the kohya
        file, so the default writes what it wrote before ComfyUI files existed, and one ComfyUI
        file more for SD3.5, Qwen-Image and Wan (runner/export/comfy.py)."""
        return self.lora_format in (fmt, "both")


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
    if train in ("lokr", "loha") and ec.lora_format in ("diffusers", "kohya"):
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
