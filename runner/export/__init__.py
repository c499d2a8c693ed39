"""Exports: a trained run's weights in the files other tools load.

``checkpoints/step-N/trainable.safetensors`` is the runner's own resume format: parameter names as
they are in memory (peft's adapter name ``default`` included), no LoRA rank or alpha. diffusers,
ComfyUI and A1111 cannot use it. An export writes, beside it, in ``checkpoints/step-N/export/``:

* ``model.train=lora`` (``export.lora_format``): ``pytorch_lora_weights.safetensors`` in diffusers
  format (``pipe.load_lora_weights``), and/or ``lora_kohya.safetensors`` in the kohya layout
  (``lora_unet_*``/``lora_transformer_*`` keys with ``.alpha``) that ComfyUI, Forge and A1111 load,
  and/or, where the kohya file is not ComfyUI's layout of the family (SD3.5, Qwen-Image, Wan),
  ``lora_comfy.safetensors`` (runner/export/comfy.py);
* ``model.train=full`` (``export.full_format``): ``diffusers/``, a pipeline folder
  (``DiffusionPipeline.from_pretrained``), and/or one safetensors file in the original layout
  (runner/export/single_file.py): SDXL's whole checkpoint ``checkpoint.safetensors`` (A1111, Forge,
  ComfyUI ``checkpoints``) or Flux's transformer ``diffusion_model.safetensors`` (ComfyUI
  ``diffusion_models``);
* with an EMA of the weights (``ema.enabled``): the same files of the average, ``*_ema.safetensors``
  or ``diffusers_ema/`` (runner/export/ema.py);
* ``export.json``: what was exported, from which step, base model and preset.

Beside the checkpoint, not in a separate folder, so that an export is pruned with its checkpoint
and never outlives or mismatches the weights it came from. The end of a run exports its final
checkpoint (``export.enabled``); ``mode=export train.resume=<checkpoint or run dir>`` exports any
saved one afterwards (runner/export/checkpoint.py).
"""
from runner.export.config import FULL_FORMATS, LORA_FORMATS, ExportConfig

__all__ = ["ExportConfig", "FULL_FORMATS", "LORA_FORMATS"]
