"""``fit.*``: the settings search of ``mode=fit`` and ``train.auto_fit`` (runner/fit/)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from runner.errors import UserError, valid_list

# Settings that change what is trained or how (the result is not the same run's): mode=fit chooses
# them only when listed in fit.allow. Everything else it may change keeps the result the same.
ALLOW: dict[str, str] = {
    "lora": "train LoRA adapters instead of the full model (model.train=lora)",
    "quantize": "store the frozen base weights in 4 or 8 bits (quantization=nf4|int8|fp8)",
    "8bit": "8-bit optimizer state (optimizer=adamw8bit)",
    "bf16_weights": "store and update the trained weights in bfloat16 (model.train_dtype=bfloat16)",
    "per_param_clipping": "fused backward with train.max_grad_norm>0, which clips each parameter by its own norm",
}


@dataclass
class FitConfig:
    """``mode=fit``: search the fastest settings that fit ``budget_gb`` (runner/fit/)."""

    allow: list[str] = field(default_factory=list)  # math-changing settings it may choose: lora, quantize, 8bit, bf16_weights, per_param_clipping
    top: int = 5  # candidates printed, fastest first
    confirm: int = 3  # most candidates confirmed with a full plan (beside the base and one checkpointing anchor)
    headroom_gb: float = 0.0  # keep this much of the budget free (allocator fragmentation, other processes)
    host_ram_gb: Optional[float] = None  # host RAM the run may use while training (offloads); None: this machine's RAM


def check_fit_config(c: Any) -> None:
    bad = [a for a in c.allow if a not in ALLOW]
    if bad:
        raise UserError(f"fit.allow={list(c.allow)}: {bad[0]!r} is not a setting mode=fit knows. "
                        f"Valid values: {valid_list(str(bad[0]), ALLOW)}.")
    if not isinstance(c.top, int) or c.top < 1:
        raise UserError(f"fit.top={c.top!r} is not valid: give a whole number >= 1.")
    if not isinstance(c.confirm, int) or c.confirm < 1:
        raise UserError(f"fit.confirm={c.confirm!r} is not valid: give a whole number >= 1.")
    if c.headroom_gb is None or c.headroom_gb < 0:
        raise UserError(f"fit.headroom_gb={c.headroom_gb!r} is not valid: give GiB >= 0.")
    if c.host_ram_gb is not None and not c.host_ram_gb > 0:
        raise UserError(f"fit.host_ram_gb={c.host_ram_gb!r} is not valid: give GiB > 0, or null for this machine's RAM.")
