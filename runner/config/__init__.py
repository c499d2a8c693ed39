"""Structured-config schemas for every group that is not a plugin.

Each dataclass here is the Hydra schema of one top-level key; plugin schemas live beside their
plugin. Because composition is checked against these, a misspelled key or a wrong type fails
before anything is built (see runner.cli.compose for the friendly messages).
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from runner import registry
from runner.adapters import DEFAULT_LORA_TARGETS
from runner.devices import DeviceConfig
from runner.distributed.config import store_dist_schemas
from runner.distributed.launch import runner_now
from runner.ema.config import EMAConfig
from runner.export.config import ExportConfig
from runner.config.fit import FitConfig
from runner.loss.config import LossConfig
from runner.output.config import LogConfig
from runner.plugin import Plugin
from runner.sampling.config import SampleConfig
from runner.sweep.config import SweepConfig
from runner.val.config import ValConfig

log = logging.getLogger("runner")



@dataclass
class ModelConfig:
    size: str = "tiny"  # tiny | full
    path: Optional[str] = None  # diffusers folder or single-file .safetensors; None = random init
    dtype: str = "float32"  # storage dtype of frozen weights: float32 | bfloat16 | float16
    train: str = "full"  # full | lora | lokr | loha (peft adapters on the denoiser; runner/adapters.py)
    train_dtype: str = "float32"  # dtype of the trained weights (full: the denoiser; lora: the adapters): float32 | bfloat16
    lora_rank: int = 4
    lora_alpha: float = 4.0
    lora_alpha_per_rank: Optional[float] = None  # set: alpha = lora_rank x this (a rank search keeps alpha/rank), not lora_alpha
    # a family may name its own (runner/families/common/base.py: lora_default_targets) where these are left as they are
    lora_targets: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    # DoRA (peft use_dora): LoRA plus a trained per-output-row magnitude; model.train=lora only. Exports the
    # diffusers file only (the kohya/ComfyUI dora_scale layout is not checked to load the same weights)
    lora_dora: bool = False
    # model.train=lokr: peft LoKrConfig decompose_factor, the split of each dimension into Kronecker factors
    # (-1: as square as possible; else a positive factor that divides it, larger factors where it does not)
    lokr_factor: int = -1


@dataclass
class DataSetConfig:
    """One entry of ``data.sets`` (runner/data/sets.py says how repeats and weights combine)."""

    path: Optional[str] = None  # folder of images + same-named captions (required)
    repeats: int = 1  # times each image appears per epoch (kohya's num_repeats)
    weight: Optional[float] = None  # chance a step's batch comes from this set (SimpleTuner's probability); all or none
    caption_ext: Optional[str] = None  # default: data.caption_ext
    resolution: Optional[int] = None  # default: data.resolution (buckets are built around it per set)
    role: str = "instance"  # instance | prior (a regularization/class set: its loss x loss.prior_weight, DreamBooth)


@dataclass
class DataConfig:
    path: Optional[str] = None  # folder of images + same-named captions; None = built-in demo set (or data.sets)
    resolution: int = 64
    center_crop: bool = True
    random_flip: bool = False
    masks: bool = False  # a loss mask per image: masks/<stem>.png, else <stem>_mask.png beside it (runner/data/masks.py)
    references: Optional[int] = None  # null: the trainer's own (an edit family's count, else 0); reference (control) images per target, edit trainers: control/<stem>.png, else <stem>_ref1.png (runner/data/references.py)
    missing_caption: str = "error"  # error | empty (use an empty caption)
    demo_size: int = 16  # number of images (clips, for a video trainer) in the built-in demo set
    demo_prior: int = 0  # images of a built-in prior (class) set beside the demo set ("a circle"...); 0 = none
    caption_ext: str = ".txt"  # extension of the caption file beside each image (kohya: --caption_extension)
    caption_dropout: float = 0.0  # probability that a visit trains with the empty caption (per visit, seeded)
    shuffle_tags: bool = False  # shuffle the comma-separated tags of a caption per visit (kohya: --shuffle_caption)
    keep_tokens: int = 0  # with shuffle_tags: leading tags kept in place (kohya: --keep_tokens)
    buckets: bool = False  # aspect-ratio buckets around data.resolution's area; each batch from one bucket
    bucket_step: int = 64  # bucket sides are multiples of this (px; kohya: --bucket_reso_steps)
    bucket_min_side: Optional[int] = None  # smallest bucket side (px); None = data.resolution / 2
    bucket_max_side: Optional[int] = None  # largest bucket side (px); None = data.resolution * 2
    sets: list[DataSetConfig] = field(default_factory=list)  # several folders: [{path, repeats, weight, caption_ext, resolution}]
    # Held-out data for the validation loss (val.*, runner/val/holdout.py); never trained on.
    val_fraction: float = 0.0  # share of the data set held out, the same images for the same data and val.seed
    val_path: Optional[str] = None  # or a separate folder in data.path's layout
    # Video trainers (trainer=wan; runner/data/video.py). An image counts as a one-frame clip.
    frames: Optional[int] = None  # frames per video sample; null = the trainer's default (wan: 9 tiny, 81 full)
    fps: Optional[float] = None  # frame rate clips are read at; null = the trainer's default (wan 2.1: 16)
    frame_sampling: str = "start"  # start | middle | random (per-sample offset) | slide (every window a sample)
    width: Optional[int] = None  # video frame width in px (multiple of 8); null = data.resolution
    height: Optional[int] = None  # video frame height in px (multiple of 8); null = data.resolution
    # An audio-video trainer (trainer=ltx2): null/true reads each clip's audio track, else the .wav beside it
    # (runner/data/audio.py); false trains video only. Any other trainer refuses true.
    audio: Optional[bool] = None


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps
    batch_size: int = 2  # samples per optimizer step
    grad_accum: int = 1  # micro-batches per optimizer step (batch_size must divide evenly)
    mixed_precision: str = "no"  # no | bf16 | fp16
    cpu_autocast: bool = False  # keep bf16/fp16 autocast and bf16 trained weights on CPU (emulated, slow); default: float32
    device: str = "auto"  # auto | cpu | cuda
    # torch threads of a run on the CPU; None = auto: the cores other processes leave free (at least 1)
    cpu_threads: Optional[int] = None
    seed: int = 0
    max_grad_norm: float = 1.0  # 0 disables clipping
    lr_scheduler: str = "constant"  # any name diffusers.optimization.get_scheduler accepts
    lr_warmup_steps: int = 0
    # Saving training state (weights, optimizer, RNG) under checkpoints/step-N, apart in name from
    # the checkpoint= plugin kind, which is activation recompute.
    save_every: int = 0  # optimizer steps between saves; 0 = only at the end
    keep_saved: int = 2  # saved steps kept on disk (the newest)
    resume: Optional[str] = None  # a run directory or a checkpoint directory
    progress: bool = True
    on_nonfinite: str = "skip"  # skip | stop: a NaN/inf loss or gradient skips the update, or stops the run
    nonfinite_patience: int = 3  # with skip: this many non-finite steps in a row stop the run (exit 4)
    # A step whose update grows the trained weights' RMS more than this many times stops the run as non-finite
    # (exit 4), saving nothing and naming the last sane checkpoint (runner/guards/weights.py); 0 = no check
    max_weight_growth: float = 10.0
    preflight: bool = True  # plan the step first (runner/plan/); refuse to start (exit 3) over budget_gb
    auto_fit: bool = False  # before training, search the fastest settings that fit (mode=fit, runner/fit/) and train with them
    compile: bool = False  # torch.compile each repeated block of the trained modules once per class (runner/compile/)
    compile_mode: str = "default"  # default | max-autotune-no-cudagraphs


@dataclass
class CustomTrainerConfig:
    """``trainer=custom trainer._target_=my_module.MyTrainer``: a user's trainer with free options."""

    _target_: str = MISSING
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ProfileConfig:
    """``profile.enabled=true``: memory timeline, largest allocations, leak check (runner/memory/profile.py).

    Costs time only on the profiled steps: every op goes through a Python dispatch mode there.
    """

    enabled: bool = False
    start: int = 1  # first profiled step (1-based, as in metrics.jsonl)
    steps: int = 5  # consecutive steps profiled; leak detection needs leak_steps + 1 of them
    top_k: int = 10  # largest live allocations kept per timeline point
    module_depth: int = 1  # module attribution depth below each model (1: unet.down_blocks.0)
    leak_steps: int = 3  # warn when live bytes at step end rose in this many consecutive steps
    leak_threshold_mb: float = 1.0  # ... each time by more than this (MiB); below it is usually a cache filling up
    snapshot: bool = True  # CUDA only: torch memory snapshot for pytorch.org/memory_viz
    snapshot_max_entries: int = 100000  # allocation events kept in the snapshot


@dataclass
class RunConfig:
    """The root schema. ``defaults`` live in conf/config.yaml."""

    trainer: Any = MISSING
    optimizer: Any = MISSING  # one schema per option (adamw, adamw8bit, ...): runner/optim/config.py
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)  # loss and noise options of the objective (runner/loss/objectives.py)
    # One node per plugin kind, holding one node per selected plugin: offload.park.cache_latents.
    allocator: Any = field(default_factory=dict)
    offload: Any = field(default_factory=dict)
    checkpoint: Any = field(default_factory=dict)
    tiling: Any = field(default_factory=dict)
    quantization: Any = field(default_factory=dict)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)  # samples during training (runner/sampling/)
    export: ExportConfig = field(default_factory=ExportConfig)  # LoRA / diffusers files beside the final checkpoint (runner/export/)
    log: LogConfig = field(default_factory=LogConfig)  # trackers (tensorboard, wandb, ...): runner/output/trackers.py
    ema: EMAConfig = field(default_factory=EMAConfig)  # moving average of the trained weights (runner/ema/average.py)
    val: ValConfig = field(default_factory=ValConfig)  # held-out validation loss (runner/val/holdout.py)
    sweep: SweepConfig = field(default_factory=SweepConfig)  # a -m sweep's objective and early stop (runner/sweep/)
    dist: Any = MISSING  # dist=none|ddp|fsdp: several processes (runner/distributed/); schemas in runner/distributed/config.py
    budget_gb: Optional[float] = None  # device memory budget; used by allocator cap and the planner
    device: DeviceConfig = field(default_factory=DeviceConfig)  # the GPU the run is for: budget default, s/step (runner/devices.py)
    fit: FitConfig = field(default_factory=FitConfig)  # mode=fit / train.auto_fit: the settings search (runner/fit/)
    mode: str = "train"  # train | plan (predict memory and s/step, exit 3 if over budget_gb) | fit (the fastest settings that fit) | export (a saved checkpoint: train.resume=...) | plugins | cache (fill the encoder cache of offload=park, then exit)
    preset: Optional[str] = None  # set by the preset file, for the log
    output_dir: Optional[str] = None  # default: Hydra's run directory


from runner.constants import (  # noqa: E402,F401  (the vocabularies live on the ground floor; re-exported)
    DTYPES,
    LR_SCHEDULERS,
    MODES,
    NONFINITE_POLICIES,
    PRECISIONS,
    SIZES,
    TRAIN_DTYPES,
)

NATIVE_RESOLUTION = {"tiny": 64, "full": 1024}  # px; full = SDXL's, Flux's and SD3.5's training resolution


def native_resolution(size: str, target: str = "", variant: str = "") -> int:
    """``data.resolution``'s default (conf/config.yaml): the size a model of ``model.size`` trains at.

    A full-size plan at the tiny default of 64 px would understate activations ~250x, so the
    resolution follows the model size unless the user sets it. At full size a trainer may register
    its own (``trainer._target_`` and ``trainer.variant``): SD1.5 trains at 512 px, SD2.1 at 768.
    """
    if str(size) == "full" and target:
        from runner import registry

        own = registry.native_resolution(str(target), str(variant or ""))
        if own:
            return own
    return NATIVE_RESOLUTION.get(str(size), NATIVE_RESOLUTION["tiny"])


def full_size_only(value: Any, size: Any) -> Any:
    """``${full_size_only:49,${model.size}}`` in a preset: its data shape at full size; at tiny size null, the
    tiny model's own (a video preset's 832x480x49 clips would make a tiny CPU run take half an hour).
    A value the user types replaces the interpolation, so it is kept at any size."""
    return value if str(size) == "full" else None


def held_out_share(objective: Any, val_path: Any) -> float:
    """``data.val_fraction``'s default: 0.1 when ``sweep.objective`` names val_loss (it needs held-out data) and
    no ``data.val_path`` is given, else 0 (nothing held out)."""
    names = [objective] if isinstance(objective, str) else list(objective or [])
    return 0.1 if "val_loss" in [str(n) for n in names] and val_path is None else 0.0


def store_schemas() -> None:
    OmegaConf.register_new_resolver("native_resolution", native_resolution, replace=True)
    OmegaConf.register_new_resolver("held_out_share", held_out_share, replace=True)
    OmegaConf.register_new_resolver("full_size_only", full_size_only, replace=True)
    # Hydra's ${now:...}, but one time for all processes of a multi-process run (runner/distributed/launch.py).
    OmegaConf.register_new_resolver("runner_now", runner_now, use_cache=True, replace=True)
    from runner.config.sweep_dirs import job_dir  # a sweep job's short folder name (conf/config.yaml)

    OmegaConf.register_new_resolver("runner_job_dir", job_dir, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="trainer", name="custom", node=CustomTrainerConfig)
    from runner.optim.config import store_optimizer_schemas

    store_optimizer_schemas()
    store_dist_schemas()
    from hydra_plugins.runner_sweeper.install import install_optuna_sweeper

    install_optuna_sweeper()  # hydra/sweeper=optuna: the runner's sweeper, when hydra-optuna-sweeper is installed


_LOADED = False


def load_all() -> None:
    """Every schema, the built-in plugins and trainers, then every entry point. Idempotent.

    The registry only holds what is declared; this is what fills it for a run (compose, the
    listing, the checks), so the registry stays a leaf that imports none of them."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    store_schemas()
    registry.store_empty_options()
    importlib.import_module("runner.plugins")
    importlib.import_module("runner.families")
    for group in (registry.PLUGIN_GROUP, registry.TRAINER_GROUP):
        for ep in entry_points(group=group):
            try:
                obj = ep.load()
            except Exception as e:  # a broken third-party package must not hide the others
                log.warning("entry point %s (%s) failed to load: %s", ep.name, ep.value, e)
                continue
            if isinstance(obj, type) and issubclass(obj, Plugin) and (obj.kind, obj.name) not in registry.plugin_entries():
                registry.register_plugin(obj)
            elif group == registry.TRAINER_GROUP and isinstance(obj, type) and ep.name not in registry.trainers():
                cfg_cls = getattr(obj, "Config", CustomTrainerConfig)
                registry.register_trainer(ep.name, f"{obj.__module__}.{obj.__qualname__}", cfg_cls,
                                          (obj.__doc__ or "").strip(), objective=getattr(obj, "objective", None))
