"""The checks of a composed config, each naming the key and what would be valid.

Two stages, so that a config error answers at once:

* :func:`check_config`: everything the config decides by itself (every schema, value, range and
  choice, each plugin's own settings, whether ``data.path`` and ``train.resume`` exist). This
  module and everything it imports at the top load without torch, diffusers, transformers,
  accelerate or bitsandbytes (tests/runner/cli/test_cli.py checks it): ``--help`` and these errors
  take the time of Python and Hydra (bench/cli_latency.py).
* :func:`check_run`: what depends on this machine and the resolved run (``train.device=auto``
  resolving to CPU or CUDA, CUDA-only options, a plugin's checks against the precision) and the
  data folder's contents. It imports torch (to ask for CUDA), still before anything is built or
  planned.

:func:`validate` runs both. Composition and its friendly errors are runner/cli/compose.py's.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from runner import registry
from runner.compile.config import check_compile_config
from runner.adapters import check_adapter_quantization
from runner.constants import (
    DTYPES,
    LR_SCHEDULERS,
    MODES,
    NONFINITE_POLICIES,
    PRECISIONS,
    SIZES,
    TRAIN_DTYPES,
    TRAIN_MODES,
)
from runner.devices import check_device_config
from runner.distributed import validate_dist
from runner.ema.config import check_ema_config
from runner.errors import UserError, valid_list
from runner.export.config import validate_export
from runner.config.fit import check_fit_config
from runner.loss.config import check_objective, loss_config, validate_loss
from runner.optim.config import check_optimizer_config
from runner.output.config import validate_log_config
from runner.sampling.config import check_sample_config
from runner.sweep.config import check_sweep_config
from runner.val.config import check_val_config, check_val_path

if TYPE_CHECKING:
    from runner.plugin import Plugin
    from runner.resolved import ResolvedRun


def _one_of(cfg: DictConfig, key: str, valid: Sequence[str]) -> None:
    value = OmegaConf.select(cfg, key)
    if value not in valid:
        raise UserError(f"{key}={value!r} is not valid. Valid values: {valid_list(str(value), valid)}.")


def _positive(cfg: DictConfig, key: str, allow_zero: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    if value is None or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise UserError(f"{key}={value!r} is not valid: it must be a number {bound}.")


@dataclass
class CheckedRun:
    """What :func:`check_run` built to check a job, kept for the job itself: the resolved run (as
    its mode sees it) and every selected plugin, built from its node and that run and validated.
    The run opens with these (runner/session.py), so one job resolves once and builds each plugin
    once, however many stages looked at it."""

    run: ResolvedRun
    plugins: list[Plugin] = field(default_factory=list)


# check_run's results by the config's text. The command line checks every job of a sweep before
# Hydra starts any (runner/cli/launch.py); the job then gets a config Hydra composed again, equal
# in content, and takes its checked run from here instead of validating a second time. A config
# that differs (a resume composed it again on the checkpoint's command line) is checked anew.
_CHECKED: dict[str, CheckedRun] = {}


def _config_key(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=False)


log = logging.getLogger("runner")


def validate(cfg: DictConfig) -> CheckedRun:
    """Both stages of checks for one job, once: a config already checked with this content (by the
    command line's pre-check) is not checked again. Returns what :func:`check_run` built."""
    checked = _CHECKED.pop(_config_key(cfg), None)
    if checked is not None:
        return checked
    check_config(cfg)
    return check_run(cfg, keep=False)


def check_config(cfg: DictConfig) -> None:
    """Everything the config decides by itself, without torch (see the module docstring)."""
    _one_of(cfg, "mode", MODES)
    _one_of(cfg, "model.size", SIZES)
    _one_of(cfg, "model.dtype", DTYPES)
    _one_of(cfg, "model.train", TRAIN_MODES)
    factor = cfg.model.get("lokr_factor", -1)
    if factor != -1 and (not isinstance(factor, int) or factor <= 0):
        raise UserError(f"model.lokr_factor={factor!r} is not valid: it must be -1 (factors as square as possible) "
                        "or a positive integer (e.g. 4, 8, 16).")
    check_adapter_quantization(str(cfg.model.train), bool(cfg.model.get("lora_dora", False)),
                               [str(name) for name in (cfg.get("quantization") or {})])
    if cfg.model.get("lora_dora", False) and cfg.model.train != "lora":
        raise UserError(f"model.lora_dora=true needs model.train=lora (DoRA is a LoRA variant: peft's use_dora), "
                        f"but model.train={cfg.model.train}. Set model.train=lora, or model.lora_dora=false.")
    _one_of(cfg, "model.train_dtype", TRAIN_DTYPES)
    _one_of(cfg, "train.mixed_precision", PRECISIONS)
    _one_of(cfg, "train.device", ("auto", "cpu", "cuda", "cuda_sim"))
    for key in ("train.steps", "train.batch_size", "train.grad_accum", "optimizer.lr", "model.lora_rank"):
        _positive(cfg, key)
    for key in ("train.save_every", "train.max_grad_norm", "train.lr_warmup_steps", "train.max_weight_growth"):
        _positive(cfg, key, allow_zero=True)
    if cfg.budget_gb is not None:
        _positive(cfg, "budget_gb")
    if cfg.train.get("cpu_threads") is not None:
        _positive(cfg, "train.cpu_threads")
    _one_of(cfg, "train.lr_scheduler", LR_SCHEDULERS)
    _one_of(cfg, "train.on_nonfinite", NONFINITE_POLICIES)
    _positive(cfg, "train.nonfinite_patience")
    growth = cfg.train.get("max_weight_growth", 0)
    if 0 < growth <= 1:
        raise UserError(f"train.max_weight_growth={growth!r} is not valid: it is how many times the trained weights' RMS "
                        "may grow in one step, so it must be above 1 (e.g. the default 10), or 0 to turn the check off.")
    _positive(cfg, "train.keep_saved", allow_zero=True)
    if not 0 <= cfg.train.seed < 2**32:
        raise UserError(f"train.seed={cfg.train.seed} is not valid: it must be an integer from 0 to 2**32-1 "
                        "(numpy's seed range; the runner seeds torch, numpy and Python's random from it).")
    if cfg.train.batch_size % cfg.train.grad_accum:
        raise UserError(
            f"train.batch_size={cfg.train.batch_size} is not divisible by train.grad_accum={cfg.train.grad_accum}; "
            "choose a grad_accum that divides the batch size."
        )
    if cfg.model.train_dtype == "bfloat16" and cfg.train.mixed_precision == "fp16":
        raise UserError(
            "model.train_dtype=bfloat16 conflicts with train.mixed_precision=fp16: bf16 weights computed in fp16 "
            "autocast lose bf16's range and fp16's loss scaling does not fit bf16 gradients. Use "
            "train.mixed_precision=bf16 with bf16 trained weights."
        )
    if cfg.train.resume is not None and not Path(cfg.train.resume).exists():
        raise UserError(
            f"train.resume={cfg.train.resume!r} does not exist. Give a run directory or one of its "
            "checkpoints/step-* directories."
        )
    check_sample_config(cfg)
    check_ema_config(cfg)
    check_val_config(cfg)
    check_sweep_config(cfg)
    validate_loss(cfg)
    _check_loss_objective(cfg)
    if cfg.mode == "train":
        _check_data_path(cfg)
    validate_export(cfg)
    check_device_config(cfg)
    check_compile_config(cfg)
    check_fit_config(cfg.fit)
    validate_log_config(cfg.log)
    check_optimizer_config(cfg.optimizer)
    check_plugin_settings(cfg)


def check_run(cfg: DictConfig, keep: bool = True) -> CheckedRun:
    """What depends on this machine and the resolved run, and the data folder's contents (imports
    torch; still before anything is built or planned). ``keep``: hold the result for this config's
    job (:func:`validate` hands it over) rather than only returning it."""
    from runner.data import check_dataset, check_options, refuse_image_only_options
    from runner.data.references import run_references
    from runner.data.video import check_video_keys, trainer_attribute, trainer_video_defaults
    from runner.optim.build import validate_optimizer
    from runner.optim.fused import check_fused_backward
    from runner.sampling.config import check_sample_multiple

    check_options(cfg.data)  # every data.* value, no file read
    say_tiny_data_shape(cfg)
    check_output_dir(cfg.get("output_dir"))
    check_cache_compatible(cfg)  # data.shuffle_tags with offload.park.cache_text is refused, naming both
    check_val_path(cfg)  # mode=train: a data.val_path folder is scanned now, like data.path below
    check_video_keys(cfg.data)  # data.frames, fps, frame_sampling, width, height
    video = trainer_video_defaults(cfg)  # a video trainer's folder is read as clips
    check_sample_multiple(cfg.get("sample"), *reversed(trainer_attribute(cfg, "resolution_multiple", 8)))
    if video:  # masks, buckets, references, several sets: image options, refused for clips in every mode
        refuse_image_only_options(cfg.data)
    else:
        warn_video_keys_ignored(cfg)
    if cfg.mode == "train":  # a data.path folder (or data.sets) is scanned and checked now, not after the model build
        check_dataset(cfg.data, video=video, references=None if video else run_references(cfg))
    run = resolve_for_mode(cfg)
    if run.simulated_card and run.precision == "fp16":
        raise UserError("train.device=cuda_sim runs CUDA's bf16 autocast on the CPU, but train.mixed_precision=fp16 "
                        "also needs CUDA's gradient scaler, which the simulated card does not run. Use "
                        "train.mixed_precision=bf16 or no with train.device=cuda_sim.")
    if run.simulated_card:
        check_simulated_budget(run)
    if run.simulated_card and run.dist.name != "none":
        raise UserError(f"train.device=cuda_sim simulates one card in this process, but dist={run.dist.name} starts "
                        "several processes, each with its own card. Drop dist (dist=none) to simulate the one-card "
                        "run, or plan the distributed run with mode=plan, which plans per rank.")
    check_budget_fits_card(cfg, run)
    validate_dist(cfg, run.dist)  # dist=ddp|fsdp: batch split, refused combinations (runner/distributed/config.py)
    validate_optimizer(cfg, run)
    check_fused_backward(cfg, run, [(k, n) for k, n, _ in registry.selected(cfg)])
    checked = CheckedRun(run, validate_plugins(cfg, run))
    if keep:
        _CHECKED[_config_key(cfg)] = checked
    return checked


def check_budget_fits_card(cfg: DictConfig, run: ResolvedRun) -> None:
    """``budget_gb`` above what the card gives a process is said once, here, before anything is
    built: a named card (``device.name``) plans and caps at its usable memory instead (resolve), and
    a real GPU cannot hold more than it has, whatever the budget says. A warning, not a refusal:
    ``+preset=sdxl_24gb device.name=rtx4090`` (24 GB presets on a 24 GB card) is what users type."""
    budget = cfg.get("budget_gb")
    if budget is None:
        return
    asked, gib = float(budget), 2**30
    if run.gpu is not None and asked > run.gpu.usable_gib and not _set_on_command_line("budget_gb"):
        log.info("budget_gb=%g (the preset's) yields to device.name=%s: the run plans and caps at its usable %g GiB.",
                 asked, run.gpu.name, run.gpu.usable_gib, extra={"once": True})
    elif run.gpu is not None and asked > run.gpu.usable_gib:
        log.warning("budget_gb=%g is more than %s gives a training process (device.name=%s: usable_gib %g of "
                    "memory_gib %g in conf/devices.yaml): the plan and its fit check use %g GiB. Set budget_gb to "
                    "at most %g, or leave it unset for the card's usable memory.", asked, run.gpu.label,
                    run.gpu.name, run.gpu.usable_gib, run.gpu.memory_gib, run.gpu.usable_gib, run.gpu.usable_gib)
    elif run.gpu is None and run.device.type == "cuda":
        from runner.memory.stats import device_total_bytes

        total = device_total_bytes(run.device) / gib
        if asked > total:
            log.warning("budget_gb=%g is more than this GPU has (%.1f GiB): the run can use at most that, and "
                        "allocator.default.cap_to_budget caps at the whole card. Set budget_gb to at most %.1f, or "
                        "name the card with device.name=<key of conf/devices.yaml> to plan for its usable memory.",
                        asked, total, total)


_TYPED: ContextVar[Sequence[str] | None] = ContextVar("typed_overrides", default=None)


@contextmanager
def typed_overrides(overrides: Sequence[str]) -> Iterator[None]:
    """The overrides the user typed, for checks that run before Hydra records them (the entry's precheck)."""
    token = _TYPED.set(list(overrides))
    try:
        yield
    finally:
        _TYPED.reset(token)


def _set_on_command_line(key: str) -> bool:
    """Whether the user typed ``key``: Hydra's task overrides, or the precheck's; unknown (an API call) is yes."""
    from hydra.core.hydra_config import HydraConfig

    typed = HydraConfig.get().overrides.task if HydraConfig.initialized() else _TYPED.get()
    return typed is None or any(o.lstrip("+~").split("=", 1)[0] == key for o in typed)


def _check_loss_objective(cfg: DictConfig) -> None:
    """``loss.*`` options of the other objective than the run's trainer trains with, refused before
    any trainer module is imported: a built-in or entry-point trainer registered its objective. A
    user's ``trainer._target_`` is not imported here; its own constructor checks the options."""
    target = cfg.trainer.get("_target_") if cfg.get("trainer") is not None else None
    for name, entry in registry.trainers().items():
        if entry.target == target:
            if entry.objective:
                check_objective(loss_config(cfg), entry.objective, f"trainer={name}")
            return


def _check_data_path(cfg: DictConfig) -> None:
    """``data.path`` names an existing folder (its images and captions are checked by :func:`check_run`)."""
    path = cfg.data.get("path")
    if path is None:
        return
    shown = str(path)
    root = Path(os.path.expanduser(shown)).absolute()
    hint = ("Set data.path to a folder of images with a same-named .txt caption beside each (cat.png + cat.txt), "
            "or leave it unset (null) for the built-in demo set.")
    if not shown.strip():
        raise UserError(f"data.path is empty ({shown!r}). {hint}")
    if not root.exists():
        raise UserError(f"data.path={shown!r} does not exist (looked for {str(root)!r}). {hint}")
    if not root.is_dir():
        raise UserError(f"data.path={shown!r} is a file, not a folder ({str(root)!r}). {hint}")


def check_plugin_settings(cfg: DictConfig) -> None:
    """Each selected plugin's own settings, from its schema module (no torch, no plugin class).

    A node without ``name`` is a setting for a plugin that is not selected: a preset sets
    ``quantization.nf4.modules`` while the command line chose ``quantization=fp8``.
    """
    for kind, name, node in registry.selected(cfg):
        if not isinstance(node, DictConfig) or "name" not in node:
            keys = ", ".join(f"{kind}.{name}.{k}" for k in (node.keys() if isinstance(node, DictConfig) else []))
            chosen = [n for k, n, sub in registry.selected(cfg) if k == kind and isinstance(sub, DictConfig) and "name" in sub]
            source = f"preset {cfg.preset}" if cfg.get("preset") else "the config"
            raise UserError(
                f"{source} sets {keys or kind + '.' + name}, but {kind}={name} is not selected "
                f"({kind}={_spelling(chosen)}). Add it with +{kind}={name}, drop those settings with "
                f"'~{kind}.{name}' on the command line, or copy the preset into conf/preset/ without those lines."
            )
        entry = registry.plugin_entry(kind, name)
        if entry.check is not None:
            entry.check(node, f"{kind}.{name}")


def validate_plugins(cfg: DictConfig, run: ResolvedRun, *, check: bool = True) -> list[Plugin]:
    """Each selected plugin built from its node and the resolved run, in the config's order, and with
    ``check`` its own ``validate()`` (the checks against the run; its settings' own checks ran in
    :func:`check_config`). ``check=False``: a job whose plugins :func:`check_run` validated already
    (the planner's preflight builds them again for the simulated run)."""
    from runner.parts import selected_plugins

    return selected_plugins(cfg, run, check=check)


def _spelling(names: list[str]) -> str:
    """A kind's choice as a user types it: none, park, [park,stream]."""
    return "none" if not names else names[0] if len(names) == 1 else "[" + ",".join(names) + "]"


def resolve_for_mode(cfg: DictConfig) -> ResolvedRun:
    """The run as ``mode`` will see it: planned for its target on ``meta`` (mode=plan), else the
    running device."""
    import torch

    from runner.resolved import planned_target, resolve

    if cfg.mode in ("plan", "fit"):
        return resolve(cfg, target=planned_target(cfg), device=torch.device("meta")).simulated()
    if cfg.mode == "plugins":
        return resolve(cfg, target=planned_target(cfg), device=torch.device("cpu"))
    return resolve(cfg)


def check_simulated_budget(run: ResolvedRun) -> None:
    """``train.device=cuda_sim`` caps its allocator at the budget less the kernel-workspace margin: that must be > 0."""
    from runner.plan.target import CUDA_WORKSPACE_MARGIN_BYTES

    if run.budget_bytes is not None and run.budget_bytes <= CUDA_WORKSPACE_MARGIN_BYTES:
        margin = CUDA_WORKSPACE_MARGIN_BYTES / 2**30
        raise UserError(f"budget_gb={run.budget_bytes / 2**30:.4g} leaves no memory on the simulated card: "
                        f"train.device=cuda_sim keeps {margin:.3g} GiB of it for kernel workspaces, as the plan does. "
                        f"Give budget_gb above {margin:.3g}, e.g. budget_gb=1.")


def check_output_dir(value: Any) -> None:
    """``output_dir`` (when set) must be a folder or not exist yet, nor lie under a file."""
    if not value:
        return
    path = Path(str(value)).expanduser()
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            where = "is a file" if p == path else f"is under {p}, which is a file"
            raise UserError(f"output_dir={value} {where}: the run writes its outputs into a folder. "
                            "Give a folder that does not exist yet or an existing folder, e.g. output_dir=outputs/my_run.")


VIDEO_KEYS = ("frames", "fps", "width", "height", "frame_sampling")  # defaults: DataConfig's (runner/config)


def warn_video_keys_ignored(cfg: DictConfig) -> None:
    """An image trainer on a video preset: the clip settings it cannot honour, named in one warning line."""
    data = cfg.data
    from runner.config import DataConfig

    defaults = DataConfig()
    set_keys = [f"data.{k}={data.get(k)}" for k in VIDEO_KEYS if data.get(k, getattr(defaults, k)) != getattr(defaults, k)]
    if set_keys:
        name = str(cfg.trainer.get("_target_", "the trainer")).rsplit(".", 1)[-1]
        log.warning("%s trains on images, so %s (video settings, e.g. from a video preset) are ignored: it trains "
                    "%d px images. Use a video trainer (trainer=wan) for clips, or drop these keys.",
                    name, ", ".join(set_keys), int(data.resolution))


def say_tiny_data_shape(cfg: DictConfig) -> None:
    """One line when a preset's full-size data shape (``${full_size_only:...}``) gave way to the tiny model's."""
    import re

    if str(cfg.model.size) == "full":
        return
    raw = OmegaConf.to_container(cfg.data, resolve=False)
    dropped = [f"data.{k}={m.group(1)}" for k, v in raw.items()
               if isinstance(v, str) and (m := re.match(r"\$\{full_size_only:([^,]+),", v))]
    if dropped:
        log.info("model.size=%s: the preset's %s apply at model.size=full; this run takes the tiny model's own "
                 "(type them to keep them).", cfg.model.size, ", ".join(dropped), extra={"once": True})


def check_cache_compatible(cfg: Any) -> None:
    """Refuse ``data.shuffle_tags=true`` with a plugin's text cache on (the setting its schema declares as
    ``text_cache_setting``: ``offload.park.cache_text=true``), naming both keys.

    A cache keyed by caption text can serve the captions a run can list (each file's caption,
    plus the empty one for dropout) but not a new tag order every visit; kohya refuses the same
    pair (``--shuffle_caption`` with ``--cache_text_encoder_outputs``). Encoding the shuffled
    caption each step means keeping the text encoders, which changes the memory plan, so it is
    the user's choice, not a silent fallback.
    """
    data = cfg.get("data") if hasattr(cfg, "get") else None
    if data is None or not bool(data.get("shuffle_tags", False)):
        return
    for kind, name, node in registry.selected(cfg):
        setting = getattr(registry.plugin_entry(kind, name).config, "text_cache_setting", "")
        if not setting or not hasattr(node, "get") or "name" not in node:
            continue
        if bool(node.get(setting, True)):
            key = f"{kind}.{name}.{setting}"
            raise UserError(
                "data.shuffle_tags=true gives every visit of an image a different caption, so its text embeddings "
                f"cannot be served from the encoder cache that {key}=true fills once. Set {key}=false (the text "
                "encoders stay on the host and encode each step; latents can still be cached), or "
                "data.shuffle_tags=false. data.caption_dropout works with the cache."
            )
