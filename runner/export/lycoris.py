"""LoKr and LoHa adapters (``model.train=lokr|loha``) as the file ComfyUI loads.

diffusers 0.42 has no reader for either on the families the runner trains (its LoKr loader is
wired to Z-Image and Flux.2 only; LoHa has none), so no diffusers file is written and
``export.lora_format=diffusers|kohya`` is refused before step 1 (runner/export/config.py). The
ComfyUI file (``lora_comfy.safetensors``) keeps peft's tensor names, which are LyCORIS' names that
ComfyUI's ``comfy/weight_adapter/lokr.py`` and ``loha.py`` read, under the family's ComfyUI module
names (runner/export/comfy.py: the same layout and rename table as a LoRA):

* LoHa: ``<key>.hada_w1_a``, ``hada_w1_b``, ``hada_w2_a``, ``hada_w2_b`` and ``<key>.alpha``;
  ComfyUI applies ``alpha / rank * (w1_a @ w1_b) * (w2_a @ w2_b)``, peft's own delta.
* LoKr: ``<key>.lokr_w1`` (or ``lokr_w1_a``/``_b``) and ``lokr_w2`` (or ``lokr_w2_a``/``_b``);
  ComfyUI scales ``kron(w1, w2)`` by ``alpha / rank`` only when a factor is rank-decomposed and by
  1 otherwise, while peft scales by ``alpha / rank`` always. So a module with two full factors
  (small layers, where peft does not decompose) gets the scale baked into ``lokr_w1`` and no
  ``.alpha``; a decomposed one keeps its tensors and gets ``.alpha``. Either way ComfyUI computes
  peft's delta (tests/runner/export/test_lycoris.py rebuilds it by ComfyUI's rule).
"""
from __future__ import annotations

import torch

from runner.export.comfy import ComfyLayout, comfy_module_name

# model.train -> the peft tensor names of one adapted module (LyCORIS' names, which ComfyUI reads).
TENSORS: dict[str, tuple[str, ...]] = {
    "lokr": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"),
    "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"),
}


def lycoris_modules(peft_state: dict[str, torch.Tensor], kind: str) -> dict[str, dict[str, torch.Tensor]]:
    """peft's state dict (``<module>.lokr_w1``...) grouped by module: {module: {tensor name: tensor}}."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in peft_state.items():
        module, _, tensor = key.rpartition(".")
        if tensor not in TENSORS[kind]:
            raise ValueError(f"unexpected {kind} tensor {key!r} in the adapter's state dict")
        out.setdefault(module, {})[tensor] = value
    return dict(sorted(out.items()))


def comfy_lycoris_state_dict(peft_state: dict[str, torch.Tensor], kind: str, layout: ComfyLayout, prefix: str,
                             rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """peft's LoKr/LoHa tensors under ComfyUI's module keys (``prefix``: the layout's, or the kohya
    file's ``lora_unet``/``lora_transformer``), scaled so ComfyUI applies peft's delta (module docstring)."""
    out: dict[str, torch.Tensor] = {}
    for module, tensors in lycoris_modules(peft_state, kind).items():
        name = comfy_module_name(layout, module)
        if name is None:
            raise ValueError(f"no ComfyUI name is known for the {kind} module {module!r}")
        key = f"{prefix}_{name.replace('.', '_')}" if layout.style == "kohya" else f"{prefix}.{name}"
        if f"{key}.alpha" in out or any(k.startswith(f"{key}.") for k in out):
            raise ValueError(f"two {kind} modules share the ComfyUI key {key!r}")
        scaled = kind == "loha" or any(t.endswith(("_a", "_b")) for t in tensors)
        for tensor, value in tensors.items():
            if not scaled and tensor == "lokr_w1":
                value = value * (float(alpha) / int(rank))  # ComfyUI scales two full factors by 1
            out[f"{key}.{tensor}"] = value.contiguous()
        if scaled:
            out[f"{key}.alpha"] = torch.tensor(float(alpha))
    return out
