"""Building and loading the built-in trainers' modules: dtypes, random init, local weights, LoRA.

Nothing here downloads: models are built from config dicts (random init) or loaded from a local
``model.path`` (a diffusers folder, offline, or one .safetensors file read tensor by tensor).
Casting keeps the modules a model declares float32, and the trained weights (a fully trained
denoiser or LoRA adapters) are set up the way diffusers' training scripts do it.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from runner.diffusers_classes import pipeline_class  # noqa: F401 (the families take it from here)
from runner.errors import UserError, valid_list
from runner.float32_rules import is_transformers_model, keep_in_fp32

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
SAFETENSORS_ACCEPTED = (
    "a diffusers folder (with model_index.json or subfolders such as unet/ or transformer/, vae/, "
    "text_encoder/, tokenizer/), a Hugging Face hub id in the local hub cache (owner/name[@revision]), "
    "or a single .safetensors file: an original checkpoint (A1111/ComfyUI SDXL or SD1.5, Black Forest Labs' Flux) or "
    "the denoiser's state dict in diffusers key layout (keys optionally prefixed 'unet.' or 'transformer.')"
)


# ---- dtypes and modules ---------------------------------------------------------------------
def dtype_from_name(name: str, key: str = "model.dtype") -> torch.dtype:
    """The torch dtype for a config value; ``key`` names the setting in the error message."""
    try:
        return DTYPES[str(name)]
    except KeyError:
        raise UserError(f"Unknown {key} '{name}'. Valid dtypes: {valid_list(str(name), DTYPES)}.") from None


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype to feed a module's inputs in: its first floating-point parameter's.

    Not ``next(parameters()).dtype``: after quantization some parameters are integer storage,
    and with LoRA the adapters are float32 while the base (which sets the activations) is not.
    Base layers come first in registration order, so the first float parameter is a base one.
    """
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _instantiate(cls: type, config: dict[str, Any] | Any) -> nn.Module:
    if is_transformers_model(cls):
        cfg = config if not isinstance(config, dict) else cls.config_class(**config)
        return cls(cfg)
    return cls.from_config(config)



def build_module(
    cls: type, config: dict[str, Any] | Any, device: str | torch.device, dtype: torch.dtype
) -> nn.Module:
    """Build ``cls`` from a config dict with random init, or without storage on ``meta``.

    ``meta`` uses the ``torch.device("meta")`` context so that every parameter *and* buffer is
    shape-only and a 12 B model builds in seconds. Any other device builds on the CPU (the runner
    places modules later) in float32 and then casts: building directly in a low-precision
    default dtype would also lower buffers that some models compute in float32 at init, at the
    price of a float32 peak while building a random full-size model.
    """
    is_meta = torch.device(device).type == "meta"
    with torch.device("meta") if is_meta else contextlib.nullcontext():
        module = _instantiate(cls, config)
    return cast_module(module, dtype)


def cast_module(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast floating-point weights to ``dtype``, keeping the model's declared float32 modules.

    Which modules stay float32: :func:`keep_in_fp32` (a weight is kept when a part of its dotted
    name is listed). Those are cast to float32 from their values as built, never through ``dtype``
    (a float64 rope table must not lose its bits on the way). The plain ``nn.Module.to`` is called
    because diffusers' ``ModelMixin.to`` warns on every dtype cast, even when the model declares
    no such modules.
    """
    keep = keep_in_fp32(module, dtype)
    if not keep and not any(t.is_complex() for t in (*module.parameters(), *module.buffers())):
        nn.Module.to(module, dtype=dtype)
        return module
    # Tensor by tensor: float32-kept weights go straight to float32, and complex tensors (RoPE
    # tables some models keep as buffers) are never cast to a real dtype.
    cast_floating(module, lambda full: torch.float32 if keep & set(full.split(".")) else dtype)
    return module


def cast_floating(module: nn.Module, target: Callable[[str], torch.dtype | None]) -> None:
    """Each floating-point parameter and buffer of ``module`` cast in place to ``target(its dotted
    name)`` (None: left as it is); parameters keep their objects (``.data``), buffers are replaced."""
    for prefix, sub in module.named_modules():
        for table in (sub._parameters, sub._buffers):
            for key, t in list(table.items()):
                if t is None or not t.is_floating_point():
                    continue
                want = target(f"{prefix}.{key}" if prefix else key)
                if want is None or t.dtype == want:
                    continue
                if isinstance(t, nn.Parameter):
                    t.data = t.data.to(want)
                else:
                    table[key] = t.to(want)


def freeze(module: nn.Module) -> nn.Module:
    """No gradients and eval mode (T5 has dropout; a frozen encoder must be deterministic)."""
    module.requires_grad_(False)
    module.eval()
    return module


# ---- local weights ----------------------------------------------------------------------------
def resolve_model_path(path: str | None) -> tuple[str, str] | None:
    """Check ``model.path`` and say what it is: ``("folder", abs)`` or ``("file", abs)``.

    A hub id (``owner/name[@revision]``) that is not a local path is resolved to its snapshot
    folder in the local hub cache (runner/families/common/hub.py). A file is opened with ``safe_open``
    here, which reads only its header, so a wrong file is reported when the run starts rather
    than after the other models were loaded.
    """
    if path is None or str(path) == "":
        return None
    full = os.path.abspath(os.path.expanduser(str(path)))
    if os.path.isdir(full):
        return ("folder", full)
    if not os.path.exists(full):
        from runner.families.common.hub import parse_hub_id, resolve_hub_id

        hub = parse_hub_id(str(path))
        if hub is not None:
            return ("folder", resolve_hub_id(str(path), *hub))
        raise UserError(f"model.path '{path}' does not exist. Accepted: {SAFETENSORS_ACCEPTED}.")
    from safetensors import safe_open

    try:
        with safe_open(full, framework="pt", device="cpu") as f:
            f.keys()
    except Exception as e:  # SafetensorError, OSError, ... all mean "not a usable file"
        raise UserError(
            f"model.path '{path}' is not a valid safetensors file ({type(e).__name__}: {e}). "
            f"Accepted: {SAFETENSORS_ACCEPTED}."
        ) from None
    return ("file", full)


def _strip_prefix(keys: Iterable[str], prefixes: Iterable[str]) -> dict[str, str]:
    """Map file key -> model key. With a known prefix present, only prefixed keys are used."""
    keys = list(keys)
    for prefix in prefixes:
        if any(k.startswith(prefix) for k in keys):
            return {k: k[len(prefix):] for k in keys if k.startswith(prefix)}
    return {k: k for k in keys}


def check_state_dict_keys(
    file: str, file_keys: Iterable[str], model: nn.Module, prefixes: Iterable[str], source: str = "its config"
) -> dict[str, str]:
    """Compare a file's keys with a model's; a mismatch is a UserError naming the file.

    Done on key names only (the safetensors header), before any tensor is read.
    """
    mapping = _strip_prefix(file_keys, prefixes)
    expected = set(model.state_dict().keys())
    got = set(mapping.values())
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (e.g. {', '.join(unexpected[:3])})")
        hint = ""
        if any(k.startswith(("model.diffusion_model.", "double_blocks.", "diffusion_model.")) for k in mapping):
            hint = " The file looks like an original (non-diffusers) checkpoint of another model family."
        raise UserError(
            f"model.path '{file}' does not match the {type(model).__name__} architecture of "
            f"{source}: {'; '.join(parts)}.{hint} Accepted: {SAFETENSORS_ACCEPTED}."
        )
    return mapping


def load_single_file(
    cls: type,
    config: dict[str, Any],
    file: str,
    dtype: torch.dtype,
    prefixes: Iterable[str] = ("unet.", "transformer."),
    source: str = "its config",
) -> nn.Module:
    """Load a denoiser from one .safetensors file, tensor by tensor, into a model built on meta.

    Parameters are built on ``meta`` (accelerate's ``init_empty_weights`` keeps buffers real,
    since non-persistent buffers are not in the file) and each tensor is read lazily with
    ``safe_open`` and converted to ``dtype`` as it is read (the file reopened every 256 MiB, so the
    mapped pages a conversion read leave RSS), then adopted with
    ``load_state_dict(assign=True)``: the peak is about the final model size, never a float32
    copy next to a bf16 one. diffusers' ``from_single_file`` is not used because it needs the
    original layout plus a hub config to convert from.
    """
    from accelerate import init_empty_weights
    from safetensors import safe_open

    from runner.families.common.safetensors_read import read_tensors

    with init_empty_weights(include_buffers=False):
        model = _instantiate(cls, config)
    with safe_open(file, framework="pt", device="cpu") as f:
        mapping = check_state_dict_keys(file, f.keys(), model, prefixes, source)
    # Read in chunks, the file reopened between them (runner/families/common/safetensors_read.py).
    read = read_tensors(file, list(mapping), dtype)
    state = {model_key: read.pop(file_key) for file_key, model_key in mapping.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model


def build_empty(cls: type, config: dict[str, Any] | Any, dtype: torch.dtype, every_tensor: bool = False) -> nn.Module:
    """``cls`` with its parameters on ``meta`` and its buffers real (computed by its init), in the
    dtypes the load it stands for would give: :func:`cast_module` (random init and ``from_pretrained``
    of a diffusers folder), or with ``every_tensor`` every parameter and persistent buffer in
    ``dtype`` (:func:`load_single_file`, which reads every state tensor in ``dtype``).

    What ``dist=fsdp`` builds on every rank before sharding (runner/distributed/loading.py): no storage for
    the weights, no random draw for them (so the frozen modules built after it draw the same values
    as in one process), and the buffers that no file holds (non-persistent ones) already right.
    """
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        module = _instantiate(cls, config)
    if not every_tensor:
        return cast_module(module, dtype)
    persistent = set(module.state_dict())
    cast_floating(module, lambda full: dtype if full in persistent else None)
    return module


def folder_weight_files(folder: str, subfolder: str) -> dict[str, tuple[str, str]] | None:
    """key -> (safetensors file, key in it) of a diffusers folder's component, as ``from_pretrained``
    reads it (``diffusion_pytorch_model.safetensors``, or the sharded index); None when the component
    has no safetensors weights (a ``.bin`` folder: read whole, runner/distributed/loading.py)."""
    sub = os.path.join(folder, subfolder)
    index = os.path.join(sub, "diffusion_pytorch_model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: (os.path.join(sub, v), k) for k, v in weight_map.items()}
    single = os.path.join(sub, "diffusion_pytorch_model.safetensors")
    if not os.path.isfile(single):
        return None
    from safetensors import safe_open

    with safe_open(single, framework="pt", device="cpu") as f:
        keys = list(f.keys())
    return {k: (single, k) for k in keys}


def load_folder_component(
    cls: type, folder: str, subfolder: str, dtype: torch.dtype, device: str | torch.device
) -> nn.Module:
    """One module from a diffusers folder: ``from_pretrained`` offline, or its config on meta."""
    sub = os.path.join(folder, subfolder)
    if torch.device(device).type == "meta":
        return build_module(cls, read_folder_config(cls, folder, subfolder), "meta", dtype)
    try:
        if is_transformers_model(cls):
            return cls.from_pretrained(sub, local_files_only=True, **{_transformers_dtype_kwarg(): dtype})
        return cls.from_pretrained(folder, subfolder=subfolder, local_files_only=True, torch_dtype=dtype)
    except (OSError, ValueError, EnvironmentError) as e:
        raise UserError(
            f"Could not load {cls.__name__} from '{sub}' (model.path): {e}. Accepted: {SAFETENSORS_ACCEPTED}."
        ) from None


@functools.lru_cache(maxsize=1)
def _transformers_dtype_kwarg() -> str:
    """transformers renamed ``torch_dtype`` to ``dtype`` in 4.56 (the old name warns in 5.x)."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"



def read_folder_config(cls: type, folder: str, subfolder: str) -> Any:
    """The config of one component of a diffusers folder (a dict, or a transformers config)."""
    sub = os.path.join(folder, subfolder)
    if is_transformers_model(cls):
        return cls.config_class.from_pretrained(sub, local_files_only=True)
    with open(os.path.join(sub, "config.json")) as f:
        return json.load(f)


# ---- LoRA ---------------------------------------------------------------------------------
def attach_lora(
    model: nn.Module, rank: int, alpha: float, targets: Iterable[str], dtype: torch.dtype = torch.float32,
    dora: bool = False, kind: str = "lora", factor: int = -1,
) -> nn.Module:
    """Freeze ``model`` and add a trainable peft adapter (diffusers ``add_adapter``): LoRA, or with
    ``kind`` LoKr / LoHa (``model.train``), ``factor`` being LoKr's ``decompose_factor`` (``model.lokr_factor``).

    ``dora`` (``model.lora_dora``): peft's DoRA, LoRA plus a trained magnitude per output row,
    initialised to the base weight's row norms. It costs a weight-sized temporary per adapted
    layer per forward (the norm of base + B@A), which the planner simulates by running peft's own
    forward on fake tensors; the trade-off is that memory and time for the closer-to-full-tune fit.

    The same recipe as diffusers' LoRA training scripts: base frozen first, Gaussian init (B=0,
    so the adapter starts as the identity), adapters cast to ``dtype`` (``model.train_dtype``,
    float32 by default) with ``cast_training_params`` so the optimizer works on float32 even
    over a bf16/fp16 base.
    """
    from diffusers.training_utils import cast_training_params

    targets = [str(t) for t in targets]
    if int(rank) <= 0:
        raise UserError(f"model.lora_rank must be a positive integer, got {rank}.")
    if not targets:
        raise UserError("model.lora_targets is empty; name at least one module, e.g. [to_q, to_k, to_v, to_out.0].")
    model.requires_grad_(False)
    lora = _adapter_config(kind, int(rank), float(alpha), targets, bool(dora), int(factor))
    try:
        if hasattr(model, "add_adapter"):  # diffusers PeftAdapterMixin models (U-Nets, transformers)
            model.add_adapter(lora)
        else:  # any other nn.Module, e.g. a user trainer's UNet2DModel
            from peft import inject_adapter_in_model

            inject_adapter_in_model(lora, model)
    except ValueError as e:
        leaves = sorted({n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))})
        raise UserError(
            f"model.lora_targets {targets} match no layer of {type(model).__name__} ({e}). "
            f"Layer names that can be targeted include: {', '.join(leaves[:30])}."
        ) from None
    cast_training_params(model, dtype=dtype)
    return model


def _adapter_config(kind: str, rank: int, alpha: float, targets: list[str], dora: bool, factor: int) -> Any:
    """The peft config of ``model.train=kind``. LoRA starts as the identity by its Gaussian init
    (B = 0); LoKr and LoHa by peft's default init (``init_weights=True``: one factor zero), as peft
    and LyCORIS train them."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    if kind == "lokr":
        return LoKrConfig(r=rank, alpha=alpha, target_modules=targets, decompose_factor=factor, init_weights=True)
    if kind == "loha":
        return LoHaConfig(r=rank, alpha=alpha, target_modules=targets, init_weights=True)
    return LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets, use_dora=dora)


def build_denoiser(name: str, device: str = "meta", dtype: Any = None) -> Any:
    """Build a full-size denoiser by name; on ``meta`` by default (no storage, for planning)."""
    import diffusers

    from runner.families.denoisers import denoiser_config

    cls_name, cfg = denoiser_config(name)
    return build_module(getattr(diffusers, cls_name), cfg, device, dtype or torch.float32)
