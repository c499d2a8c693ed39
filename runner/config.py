"""Structured-config schemas for every group that is not a plugin.

Each dataclass here is the Hydra schema of one top-level key; plugin schemas live beside their
plugin. Because composition is checked against these, a misspelled key or a wrong type fails
before anything is built (see runner.validate for the friendly messages).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ModelConfig:
    size: str = "tiny"  # tiny | full
    path: Optional[str] = None  # diffusers folder or single-file .safetensors; None = random init
    dtype: str = "float32"  # storage dtype of frozen weights: float32 | bfloat16 | float16
    train: str = "full"  # full | lora (peft, on the denoiser)
    lora_rank: int = 4
    lora_alpha: float = 4.0
    lora_targets: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])


@dataclass
class DataConfig:
    path: Optional[str] = None  # folder of images + same-named .txt captions; None = built-in demo set
    resolution: int = 64
    center_crop: bool = True
    random_flip: bool = False
    missing_caption: str = "error"  # error | empty (use an empty caption)
    demo_size: int = 16  # number of images in the built-in demo set


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps
    batch_size: int = 2  # samples per optimizer step
    grad_accum: int = 1  # micro-batches per optimizer step (batch_size must divide evenly)
    mixed_precision: str = "no"  # no | bf16 | fp16
    cpu_autocast: bool = False  # also autocast on CPU (emulated, slow); by default CPU runs use float32
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    max_grad_norm: float = 1.0  # 0 disables clipping
    lr_scheduler: str = "constant"  # any name diffusers.optimization.get_scheduler accepts
    lr_warmup_steps: int = 0
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 2
    resume: Optional[str] = None  # a run directory or a checkpoint directory
    progress: bool = True


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 1e-4
    weight_decay: float = 1e-2
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class CustomTrainerConfig:
    """``trainer=custom trainer._target_=my_module.MyTrainer``: a user's trainer with free options."""

    _target_: str = MISSING
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunConfig:
    """The root schema. ``defaults`` live in conf/config.yaml."""

    trainer: Any = MISSING
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    allocator: Any = MISSING
    offload: Any = MISSING
    checkpoint: Any = MISSING
    tiling: Any = MISSING
    quantization: Any = MISSING
    budget_gb: Optional[float] = None  # device memory budget; used by allocator cap and the planner
    mode: str = "train"  # train | plugins
    preset: Optional[str] = None  # set by the preset file, for the log
    output_dir: Optional[str] = None  # default: Hydra's run directory


MODES = ("train", "plugins")
SIZES = ("tiny", "full")
DTYPES = ("float32", "bfloat16", "float16")
PRECISIONS = ("no", "bf16", "fp16")


def store_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="trainer", name="custom", node=CustomTrainerConfig)
    cs.store(group="optimizer", name="adamw", node=OptimizerConfig(name="adamw"))
