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


@dataclass
class ProdigyConfig:
    """``optimizer=prodigy``: prodigyopt's Prodigy, Adam with its own step-size estimate ``d``.

    ``lr`` is not a learning rate: it multiplies the step size Prodigy estimates, and its authors' value
    is 1.0 (the default here; tune ``d_coef`` instead). A value below 0.1 is warned about at startup,
    since it is almost always an AdamW learning rate carried over (runner/optim/build.py).
    """

    name: str = "prodigy"
    lr: float = 1.0
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    beta3: float | None = None  # None: sqrt(beta2)
    eps: float = 1e-8
    decouple: bool = True  # AdamW-style decoupled weight decay
    use_bias_correction: bool = False
    safeguard_warmup: bool = False  # recommended with an LR warmup (train.lr_warmup_steps)
    d0: float = 1e-6
    d_coef: float = 1.0
    growth_rate: float = float("inf")
    slice_p: int = 1  # >1 estimates d on every slice_p-th element (less state, an approximation)
    fused_backward: bool = False  # refused: d is estimated over all parameters at once (runner/optim/fused.py)


@dataclass
class AdamWScheduleFreeConfig:
    """``optimizer=adamw_schedulefree``: schedulefree's AdamWScheduleFree (no LR schedule needed).

    The weights trained (y) are not the weights evaluated (x): the runner switches the optimizer to
    eval mode for samples, validation, checkpoints and the export (runner/optim/modes.py).
    """

    name: str = "adamw_schedulefree"
    lr: float = 1e-4
    weight_decay: float = 1e-2
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0  # its own linear warmup (use this, not train.lr_warmup_steps)
    r: float = 0.0
    weight_lr_power: float = 2.0
    fused_backward: bool = False  # refused: its step counts and weights one step of all parameters


@dataclass
class LionConfig:
    """``optimizer=lion``: bitsandbytes' Lion (Lion32bit), one float32 moment (4 B/param).

    Lion's update is a sign, so its step is as large as ``lr`` on every element: use 3-10x AdamW's
    learning rate divided, and weight decay multiplied, by the same factor (the defaults: 1e-5, 0.1).
    """

    name: str = "lion"
    lr: float = 1e-5
    weight_decay: float = 1e-1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    fused_backward: bool = False  # step each parameter inside backward and free its gradient at once (runner/optim/fused.py)


@dataclass
class Lion8bitConfig(LionConfig):
    """``optimizer=lion8bit``: bitsandbytes' Lion8bit, one blockwise 8-bit moment (~1 B/param)."""

    name: str = "lion8bit"
    min_8bit_size: int = 4096  # tensors with fewer elements keep a 32-bit moment (bitsandbytes' default)


@dataclass
class CAMEConfig:
    """``optimizer=came``: came-pytorch's CAME, Adafactor's factored moments plus a confidence term."""

    name: str = "came"
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999, 0.9999])  # (update, squared grad, instability)
    eps: list[float] = field(default_factory=lambda: [1e-30, 1e-16])  # (squared grad, instability) regularisers
    clip_threshold: float = 1.0
    fused_backward: bool = False  # step each parameter inside backward and free its gradient at once (runner/optim/fused.py)


OPTIMIZER_CONFIGS: dict[str, type] = {
    "adamw": AdamWConfig,
    "adamw8bit": AdamW8bitConfig,
    "paged_adamw8bit": PagedAdamW8bitConfig,
    "adafactor": AdafactorConfig,
    "prodigy": ProdigyConfig,
    "adamw_schedulefree": AdamWScheduleFreeConfig,
    "lion": LionConfig,
    "lion8bit": Lion8bitConfig,
    "came": CAMEConfig,
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
        default = OPTIMIZER_CONFIGS[name]().betas  # two for the Adam family and Lion, three for CAME
        if len(betas) != len(default) or not all(0.0 <= float(b) < 1.0 for b in betas):
            count = {2: "two", 3: "three"}.get(len(default), str(len(default)))
            raise UserError(f"optimizer.betas={betas} is not valid for optimizer={name}: give {count} numbers in [0, 1), "
                            f"e.g. {default}.")
    _check_ranges(name, node)


# Each optimizer number's valid range, from its constructor's own checks and its authors' documented use:
# (test, what is valid). A value outside it would end in a traceback inside the constructor, or in a run
# that cannot learn (Prodigy's d_coef=0 keeps the step at 0).
def _positive(v: float) -> bool:
    return v > 0


def _non_negative(v: float) -> bool:
    return v >= 0


def _unit(v: float) -> bool:
    return 0 <= v < 1


RANGES: dict[str, tuple[Any, str]] = {
    "lr": (_positive, "above 0"),
    "weight_decay": (_non_negative, "0 or more"),
    "eps": (_positive, "above 0"),
    "d0": (_positive, "above 0"),
    "d_coef": (_positive, "above 0 (it multiplies the estimated step size; 0 would never learn)"),
    "growth_rate": (_positive, "above 0"),
    "slice_p": (lambda v: v >= 1 and float(v).is_integer(), "a whole number, 1 or more"),
    "warmup_steps": (lambda v: v >= 0 and float(v).is_integer(), "a whole number, 0 or more"),
    "clip_threshold": (_positive, "above 0"),
    "decay_rate": (lambda v: -1 <= v < 0, "in [-1, 0)"),
    "beta1": (_unit, "in [0, 1), or null for no first moment"),
    "beta3": (_unit, "in [0, 1), or null for sqrt(beta2)"),
    "r": (_non_negative, "0 or more"),
    "weight_lr_power": (_non_negative, "0 or more"),
    "min_8bit_size": (lambda v: v >= 0 and float(v).is_integer(), "a whole number, 0 or more"),
}


def _check_ranges(name: str, node: Any) -> None:
    """Every number of ``optimizer`` in its range (RANGES); a list (Adafactor's, CAME's ``eps``) has the default's length."""
    default = OPTIMIZER_CONFIGS[name]()
    for key, (ok, valid) in RANGES.items():
        if key not in node or node[key] is None:
            continue
        value, want = node[key], getattr(default, key)
        if isinstance(want, list):
            values = list(value) if OmegaConf.is_list(value) or isinstance(value, (list, tuple)) else None
            if values is None or len(values) != len(want):
                raise UserError(f"optimizer.{key}={value} is not valid for optimizer={name}: give {len(want)} numbers, "
                                f"each {valid}, e.g. {want}.")
        else:
            values = [value]
        for v in values:
            if not ok(float(v)):
                raise UserError(f"optimizer.{key}={value} is not valid for optimizer={name}: it must be {valid} "
                                f"(default {want}).")
