"""The values of ``model.train`` (torch-free, so config checks stay fast): one place for what is an adapter.

``full`` trains the denoiser's own weights; every other value attaches a peft adapter to it and
trains that alone, the base frozen (runner/families/common/loading.py ``attach_lora``): ``lora`` (with
``model.lora_dora`` for DoRA), ``lokr`` (Kronecker factors) and ``loha`` (Hadamard product of two
low-rank pairs). All three read ``model.lora_rank``, ``model.lora_alpha`` and ``model.lora_targets``.
"""
from __future__ import annotations

from typing import Any

from runner.constants import ADAPTERS, TRAIN_MODES, is_adapter  # noqa: F401  (re-exported)
from runner.errors import UserError

DEFAULT_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # model.lora_targets' default: diffusers' attention projections

# Quantized bases each adapter was checked to train over (tests/runner/test_adapter_quantization.py).
# LoRA: every quantization (its forward adds lora_B(lora_A(x)) to any base layer's output). LoKr and
# LoHa build their delta and add F.linear(x, delta) to the base's output, which works over the int8
# and fp8 layers; over nf4 the planner cannot simulate peft's LyCORIS layer (the step stops on a
# shape error in the 4-bit simulation), so it is refused rather than run unplanned. DoRA reads the
# base weight itself every forward (its norm) through peft's dequantize_module_weight, which knows
# none of the runner's int8 / fp8 layers (int8 crashes; fp8 would take the norm of the stored fp8
# values whatever the layer's scale): refused over every quantization.
QUANTIZED_BASES: dict[str, tuple[str, ...]] = {"lokr": ("int8", "fp8"), "loha": ("int8", "fp8"), "dora": ()}


def lora_alpha(model_cfg: Any) -> float:
    """The adapter's alpha: ``model.lora_rank`` x ``model.lora_alpha_per_rank`` when that is set (a sweep
    over rank keeps the scale alpha/rank), else ``model.lora_alpha``."""
    per_rank = model_cfg.get("lora_alpha_per_rank")
    return float(model_cfg.lora_rank) * float(per_rank) if per_rank is not None else float(model_cfg.lora_alpha)


def check_adapter_quantization(train: str, dora: bool, quantization: list[str]) -> None:
    """Before step 1: the adapter works over every selected quantization, else a UserError naming both."""
    adapter = "dora" if dora and train == "lora" else train
    if adapter not in QUANTIZED_BASES:
        return
    setting = "model.lora_dora=true" if adapter == "dora" else f"model.train={train}"
    for name in quantization:
        valid = QUANTIZED_BASES[adapter]
        if name not in valid:
            over = f"quantization={'|'.join(valid)} or none" if valid else "no quantization"
            raise UserError(
                f"{setting} with quantization={name}: this adapter was not checked to train over a {name} base "
                f"(runner/adapters.py says why), so the run is refused before it starts. Use {over}, or "
                "model.train=lora (plain LoRA trains over every quantization).")
