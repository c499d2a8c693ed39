"""The ``optimizer`` group's schemas and the checks its settings alone decide, without torch.

Split from runner/optim/build.py (which imports torch and, for 8-bit AdamW, bitsandbytes) so that
composing a run, ``--help`` and a config error never wait for them. runner/optim/build.py takes these
schemas for its factory table and adds the checks that need the resolved run (CUDA-only options).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from runner.errors import UserError, valid_list


@dataclass
class AdamWConfig:
    """``optimizer=adamw``: torch.optim.AdamW, float32 moments (8 B/param for float32 weights)."""

    name: str = "adamw"
    lr: float = 1e-4
    weight_decay: float = 1e-2
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    fused_backward: bool = False  # step each parameter inside backward and free its gradient at once (runner/optim/fused.py)


@dataclass
class AdamW8bitConfig(AdamWConfig):
    """``optimizer=adamw8bit``: bitsandbytes AdamW with blockwise 8-bit moments (~2 B/param)."""

    name: str = "adamw8bit"
    min_8bit_size: int = 4096  # tensors with fewer elements keep 32-bit moments (bitsandbytes' default)


@dataclass
class PagedAdamW8bitConfig(AdamW8bitConfig):
    """``optimizer=paged_adamw8bit``: adamw8bit with its state in CUDA unified (pageable) memory."""

    name: str = "paged_adamw8bit"


@dataclass
class AdafactorConfig:
    """``optimizer=adafactor``: factored second moment, no first moment; fixed lr (see module doc)."""

    name: str = "adafactor"
    lr: float = 1e-4
    weight_decay: float = 0.0
    eps: list[float] = field(default_factory=lambda: [1e-30, 1e-3])  # (regulariser of the squared grad, of the RMS)
    clip_threshold: float = 1.0
    decay_rate: float = -0.8
    beta1: Optional[float] = None  # None: no first moment (the memory saving)
    scale_parameter: bool = False  # True multiplies lr by each tensor's RMS
    fused_backward: bool = False  # step each parameter inside backward and free its gradient at once (runner/optim/fused.py)

OPTIMIZER_CONFIGS: dict[str, type] = {
    "adamw": AdamWConfig,
    "adamw8bit": AdamW8bitConfig,
    "paged_adamw8bit": PagedAdamW8bitConfig,
    "adafactor": AdafactorConfig,
}


def store_optimizer_schemas() -> None:
    """Store every optimizer schema as an option of Hydra's ``optimizer`` group."""
    cs = ConfigStore.instance()
    for name, config in OPTIMIZER_CONFIGS.items():
        cs.store(group="optimizer", name=name, node=config())


def check_optimizer_config(node: Any) -> None:
    """``optimizer``'s name, that ``optimizer.name`` matches the chosen schema, and the betas."""
    name = str(node.name)
    if name not in OPTIMIZER_CONFIGS:
        raise UserError(f"optimizer.name={name!r} is not valid. Valid values: {valid_list(name, OPTIMIZER_CONFIGS)}.")
    schema = OmegaConf.get_type(node) if OmegaConf.is_config(node) else type(node)
    if schema is not None and schema is not OPTIMIZER_CONFIGS[name] and schema in OPTIMIZER_CONFIGS.values():
        chosen = next(n for n, c in OPTIMIZER_CONFIGS.items() if c is schema)
        raise UserError(
            f"optimizer.name={name} does not switch the optimizer (the optimizer group is '{chosen}'): "
            f"select it with optimizer={name}, which also brings its own settings."
        )
    if hasattr(node, "betas"):
        betas = list(node.betas)
        if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
            raise UserError(f"optimizer.betas={betas} is not valid: give two numbers in [0, 1), e.g. [0.9, 0.999].")
