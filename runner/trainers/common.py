"""Helpers shared by the built-in trainers: building, loading, freezing, LoRA and tokenizers.

Nothing here downloads: models are built from config dicts (random init) or loaded from a local
``model.path``, and the tiny tokenizers are generated in memory. :class:`DiffusersTrainer` holds
the parts of the trainer protocol that SDXL and Flux share (which module comes from where, in
which dtype, frozen or trained), so that each family file only says what is specific to it:
its module classes, its ``encode`` and its ``loss``.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from runner.errors import UserError, valid_list
from runner.trainer import Batch, EncodePart, ModelSet

log = logging.getLogger("runner")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
TRAIN_MODES = ("full", "lora")
SAFETENSORS_ACCEPTED = (
    "a diffusers folder (with model_index.json or subfolders such as unet/ or transformer/, vae/, "
    "text_encoder/, tokenizer/) or a single .safetensors file holding the denoiser's state dict in "
    "diffusers key layout (keys optionally prefixed 'unet.' or 'transformer.')"
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


def _is_transformers_model(cls: type) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return issubclass(cls, PreTrainedModel)


def _instantiate(cls: type, config: dict[str, Any] | Any) -> nn.Module:
    if _is_transformers_model(cls):
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

    Follows transformers' rule: ``_keep_in_fp32_modules`` (T5's ``wo``, which overflows in
    float16) stay float32 under float16, ``_keep_in_fp32_modules_strict`` under bf16 too. The
    plain ``nn.Module.to`` is called because diffusers' ``ModelMixin.to`` warns on every dtype
    cast, even when the model declares no such modules.
    """
    keep: set[str] = set()
    if dtype == torch.float16:
        keep |= set(getattr(module, "_keep_in_fp32_modules", None) or [])
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(module, "_keep_in_fp32_modules_strict", None) or [])
    nn.Module.to(module, dtype=dtype)
    if keep:
        for name, sub in module.named_modules():
            if any(f".{k}." in f".{name}." for k in keep):
                nn.Module.to(sub, dtype=torch.float32)
    return module


def freeze(module: nn.Module) -> nn.Module:
    """No gradients and eval mode (T5 has dropout; a frozen encoder must be deterministic)."""
    module.requires_grad_(False)
    module.eval()
    return module


# ---- local weights ----------------------------------------------------------------------------
def resolve_model_path(path: str | None) -> tuple[str, str] | None:
    """Check ``model.path`` and say what it is: ``("folder", abs)`` or ``("file", abs)``.

    A file is opened with ``safe_open`` here, which reads only its header, so a wrong file is
    reported when the run starts rather than after the other models were loaded.
    """
    if path is None or str(path) == "":
        return None
    full = os.path.abspath(os.path.expanduser(str(path)))
    if os.path.isdir(full):
        return ("folder", full)
    if not os.path.exists(full):
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
            hint = " The file looks like an original (non-diffusers) checkpoint; convert it to diffusers layout first."
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
    ``safe_open`` and converted to ``dtype`` as it is read, then adopted with
    ``load_state_dict(assign=True)``: the peak is about the final model size, never a float32
    copy next to a bf16 one. diffusers' ``from_single_file`` is not used because it needs the
    original layout plus a hub config to convert from.
    """
    from accelerate import init_empty_weights
    from safetensors import safe_open

    with init_empty_weights(include_buffers=False):
        model = _instantiate(cls, config)
    state: dict[str, torch.Tensor] = {}
    with safe_open(file, framework="pt", device="cpu") as f:
        mapping = check_state_dict_keys(file, f.keys(), model, prefixes, source)
        for file_key, model_key in mapping.items():
            t = f.get_tensor(file_key)
            state[model_key] = t.to(dtype) if t.is_floating_point() else t
    model.load_state_dict(state, strict=True, assign=True)
    return model


def load_folder_component(
    cls: type, folder: str, subfolder: str, dtype: torch.dtype, device: str | torch.device
) -> nn.Module:
    """One module from a diffusers folder: ``from_pretrained`` offline, or its config on meta."""
    sub = os.path.join(folder, subfolder)
    if torch.device(device).type == "meta":
        return build_module(cls, read_folder_config(cls, folder, subfolder), "meta", dtype)
    try:
        if _is_transformers_model(cls):
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
    if _is_transformers_model(cls):
        return cls.config_class.from_pretrained(sub, local_files_only=True)
    with open(os.path.join(sub, "config.json")) as f:
        return json.load(f)


# ---- LoRA ---------------------------------------------------------------------------------
def attach_lora(
    model: nn.Module, rank: int, alpha: float, targets: Iterable[str], dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Freeze ``model`` and add a trainable peft LoRA adapter (diffusers ``add_adapter``).

    The same recipe as diffusers' LoRA training scripts: base frozen first, Gaussian init (B=0,
    so the adapter starts as the identity), adapters cast to ``dtype`` (``model.train_dtype``,
    float32 by default) with ``cast_training_params`` so the optimizer works on float32 even
    over a bf16/fp16 base.
    """
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    targets = [str(t) for t in targets]
    if int(rank) <= 0:
        raise UserError(f"model.lora_rank must be a positive integer, got {rank}.")
    if not targets:
        raise UserError("model.lora_targets is empty; name at least one module, e.g. [to_q, to_k, to_v, to_out.0].")
    model.requires_grad_(False)
    lora = LoraConfig(r=int(rank), lora_alpha=float(alpha), init_lora_weights="gaussian", target_modules=targets)
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


# ---- repeated blocks --------------------------------------------------------------------------
def outermost(root: nn.Module, match: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """Modules under ``root`` for which ``match`` holds, not descending into a match."""
    found: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if match(child):
                found.append(child)
            else:
                visit(child)

    visit(root)
    return found


def find_repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost repeated blocks of a denoiser, for checkpointing and offload plugins.

    For a U-Net the unit is each resnet and each attention (Transformer2DModel) of the
    down/mid/up blocks: diffusers' ``_repeated_blocks`` names only ``BasicTransformerBlock``,
    which would leave the resnets (most of a U-Net's activation memory) outside every block.
    Elsewhere the model's own ``_repeated_blocks`` (or ``_no_split_modules``) class names are used.
    """
    base = model
    if hasattr(model, "get_base_model") and not hasattr(model, "down_blocks"):
        base = model.get_base_model()
    if hasattr(base, "down_blocks") and hasattr(base, "up_blocks"):
        stages = list(base.down_blocks) + ([base.mid_block] if getattr(base, "mid_block", None) is not None else [])
        stages += list(base.up_blocks)
        wanted: set[int] = set()
        for stage in stages:
            for attr in ("resnets", "attentions"):
                for m in getattr(stage, attr, None) or []:
                    wanted.add(id(m))
        return outermost(base, lambda m: id(m) in wanted)
    names = set(getattr(type(base), "_repeated_blocks", None) or getattr(type(base), "_no_split_modules", None) or [])
    return outermost(base, lambda m: type(m).__name__ in names)


# ---- tokenizers ---------------------------------------------------------------------------
def _clip_vocab_files() -> str:
    """A folder with a minimal byte-level CLIP ``vocab.json`` and an empty ``merges.txt``.

    Files rather than an in-memory vocabulary because ``CLIPTokenizer.from_pretrained(folder)``
    is the one constructor that transformers 4.x (slow tokenizer) and 5.x (tokenizers backend)
    share. The folder is keyed by the content's hash under the temp dir and written to a
    private folder first, then renamed into place, so concurrent runs never see half a file.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    for s in symbols:
        vocab[s + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    vocab_text = json.dumps(vocab, ensure_ascii=False, sort_keys=True)
    merges_text = "#version: 0.2\n"
    digest = hashlib.sha256((vocab_text + merges_text).encode()).hexdigest()[:16]
    folder = os.path.join(tempfile.gettempdir(), f"runner-clip-bytes-{digest}")
    if not os.path.isfile(os.path.join(folder, "merges.txt")):
        staging = tempfile.mkdtemp(prefix="runner-clip-bytes-", dir=tempfile.gettempdir())
        with open(os.path.join(staging, "vocab.json"), "w", encoding="utf-8") as f:
            f.write(vocab_text)
        with open(os.path.join(staging, "merges.txt"), "w", encoding="utf-8") as f:
            f.write(merges_text)
        try:
            os.rename(staging, folder)
        except OSError:  # another process got there first: use its (identical) files
            shutil.rmtree(staging, ignore_errors=True)
    return folder


@functools.lru_cache(maxsize=4)
def clip_tokenizer(model_max_length: int = 77) -> Any:
    """A real ``CLIPTokenizer`` over a minimal byte-level vocabulary, built offline.

    Vocabulary: the 256 byte symbols of GPT-2's byte-to-unicode table, their ``</w>`` (end of
    word) forms, then ``<|startoftext|>`` = 512 and ``<|endoftext|>`` = 513; no merges, so every
    word is spelled byte by byte. Tokenization, specials, padding and truncation are the library's.
    """
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(_clip_vocab_files(), model_max_length=model_max_length, local_files_only=True)


@functools.lru_cache(maxsize=4)
def t5_tokenizer(model_max_length: int = 512) -> Any:
    """``ByT5Tokenizer`` (bytes, needs no files); ids < 384 fit both the tiny and the real T5 vocab."""
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer(model_max_length=model_max_length)


def load_folder_tokenizer(folder: str, subfolder: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.path.join(folder, subfolder), local_files_only=True)
    except (OSError, ValueError) as e:
        where = os.path.join(folder, subfolder)
        raise UserError(f"Could not load a tokenizer from '{where}' (model.path): {e}.") from None


def tokenize(tokenizer: Any, texts: list[str], max_length: int, device: torch.device) -> torch.Tensor:
    """Token ids padded/truncated to ``max_length``, as diffusers pipelines tokenize prompts."""
    ids = tokenizer(
        list(texts), padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
    ).input_ids
    return ids.to(device)


# ---- per-sample randomness ----------------------------------------------------------------------
def salted(seeds: torch.Tensor, salt: int) -> torch.Tensor:
    """Derived per-sample seeds, so two draws from one sample's seed are independent.

    Without it the VAE posterior sample and the diffusion noise of a sample would be the *same*
    numbers (same seed, same shape).
    """
    return torch.tensor([(int(s) * 7_919_007 + salt) % (1 << 62) for s in seeds.tolist()], dtype=torch.int64)


def sample_latents(dist: Any, seeds: torch.Tensor, salt: int) -> torch.Tensor:
    """``mean + std * eps`` of a VAE posterior in float32, with eps drawn per sample.

    ``latent_dist.sample(generator)`` takes one generator for the whole batch, so the result
    would depend on how the batch is split; the mean/std form reproduces it per sample.
    """
    from runner.trainer import per_sample_randn

    mean, std = dist.mean.float(), dist.std.float()
    eps = per_sample_randn(salted(seeds, salt), tuple(mean.shape[1:]), mean.device, torch.float32)
    return mean + std * eps


class LatentMoments(NamedTuple):
    """A VAE posterior reduced to what sampling needs: what ``encode_part`` returns and a cache stores.

    Has the ``mean``/``std`` attributes of diffusers' ``DiagonalGaussianDistribution``, so
    :func:`sample_latents` takes either.
    """

    mean: torch.Tensor
    std: torch.Tensor


def file_stats(folder: str) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime_ns) of every file under ``folder``, sorted: a cheap identity
    of local weights for cache keys (reading and hashing gigabytes of weights on every start would
    cost more than the cache saves)."""
    out = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            st = os.stat(full)
            out.append((os.path.relpath(full, folder), st.st_size, st.st_mtime_ns))
    return out


# ---- shared trainer skeleton ------------------------------------------------------------------
class DiffusersTrainer:
    """The parts of a trainer that do not depend on the model family.

    Subclasses set ``denoiser`` (the trained module's name and diffusers subfolder), implement
    :meth:`module_classes` and :meth:`size_configs`, and write ``encode``/``loss``/``example_batch``.

    Where each module comes from:

    * ``model.path`` unset: built from the ``model.size`` config dicts with random init.
    * a diffusers folder: every module from its subfolder (``from_pretrained``, offline). The
      denoiser's subfolder is required; a missing frozen module is built at random with a warning.
    * a single .safetensors file: the denoiser from it (architecture of ``model.size``); the frozen
      modules random, with a warning.

    Dtypes: frozen modules (and a LoRA's frozen base) are stored in ``model.dtype``; the trained
    weights (a fully fine-tuned denoiser, or the LoRA adapters) in ``model.train_dtype``: float32
    master weights by default (mixed precision is the runner's job), bfloat16 to halve them
    (kohya's ``--full_bf16``: what lets a full SDXL U-Net fine-tune fit 24 GB).
    """

    denoiser: str = ""
    denoiser_prefixes: tuple[str, ...] = ("unet.", "transformer.")

    def __init__(self, cfg: Any, run: Any = None) -> None:
        """``run``: the :class:`~runner.resolved.ResolvedRun`, whose dtypes win over the config's
        (a CPU run trains in float32 whatever ``model.train_dtype`` says; runner/resolved.py)."""
        self.cfg = cfg
        m = cfg.model
        if str(m.train) not in TRAIN_MODES:
            raise UserError(f"Unknown model.train '{m.train}'. Valid values: {valid_list(str(m.train), TRAIN_MODES)}.")
        self.storage_dtype = run.frozen_dtype if run is not None else dtype_from_name(m.dtype)
        self.train_dtype = (run.train_dtype if run is not None
                            else dtype_from_name(m.get("train_dtype", "float32"), "model.train_dtype"))
        if self.train_dtype not in (torch.float32, torch.bfloat16):
            raise UserError(f"Unknown model.train_dtype '{m.train_dtype}'. Valid dtypes: float32, bfloat16.")
        self.size = str(m.size)
        self.size_configs()  # validates model.size
        self.source = resolve_model_path(m.path)
        if self.source is not None and self.source[0] == "folder" and not self._folder_has(self.denoiser):
            folder = self.source[1]
            present = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
            raise UserError(
                f"model.path '{folder}' has no '{self.denoiser}/' subfolder for the {self.denoiser} "
                f"(subfolders found: {', '.join(present) or 'none'}). Accepted: {SAFETENSORS_ACCEPTED}."
            )
        self._tokenizers: dict[str, Any] | None = None

    # -- to implement ----------------------------------------------------------------------
    def module_classes(self) -> dict[str, type]:
        raise NotImplementedError

    def size_configs(self) -> dict[str, dict[str, Any]]:
        raise NotImplementedError

    # -- configs -------------------------------------------------------------------------
    def _folder_has(self, name: str) -> bool:
        src = self.source
        return src is not None and src[0] == "folder" and os.path.isdir(os.path.join(src[1], name))

    def component_config(self, name: str) -> dict[str, Any]:
        """The architecture of one module as a dict (folder config.json, else the size's dict).

        Read without building anything, so ``example_batch`` can size tensors for the planner.
        """
        if self._folder_has(name):
            with open(os.path.join(self.source[1], name, "config.json")) as f:
                return json.load(f)
        return self.size_configs()[name]

    # -- models -------------------------------------------------------------------------
    def module_dtype(self, name: str, trained_full: bool) -> torch.dtype:
        """``model.train_dtype`` for a fully trained module; ``model.dtype`` otherwise, with one exception.

        A VAE whose config sets ``force_upcast`` (the SDXL and Flux VAEs) overflows to NaN in
        float16, so with ``model.dtype=float16`` it stays float32, as diffusers' training
        scripts and pipelines do. bfloat16 has the range and is kept.
        """
        if trained_full:
            return self.train_dtype
        if name == "vae" and self.storage_dtype == torch.float16 and self.component_config("vae").get("force_upcast"):
            return torch.float32
        return self.storage_dtype

    def load_component(self, name: str, cls: type, device: str, dtype: torch.dtype) -> nn.Module:
        src = self.source
        if src is not None and src[0] == "folder":
            if self._folder_has(name):  # the denoiser's subfolder was checked in __init__
                return load_folder_component(cls, src[1], name, dtype, device)
            log.warning(
                "model.path %s has no %s/ subfolder: %s is randomly initialised (model.size=%s)",
                src[1], name, name, self.size,
            )
        elif src is not None and src[0] == "file":
            if name == self.denoiser:
                if torch.device(device).type == "meta":
                    model = build_module(cls, self.size_configs()[name], "meta", dtype)
                    from safetensors import safe_open

                    with safe_open(src[1], framework="pt", device="cpu") as f:
                        keys = list(f.keys())
                    check_state_dict_keys(src[1], keys, model, self.denoiser_prefixes, f"model.size={self.size}")
                    return model
                return load_single_file(
                    cls, self.size_configs()[name], src[1], dtype, self.denoiser_prefixes, f"model.size={self.size}"
                )
            log.warning("model.path is a single file: %s is randomly initialised (model.size=%s)", name, self.size)
        return build_module(cls, self.size_configs()[name], device, dtype)

    def build_models(self, device: str | torch.device = "cpu") -> ModelSet:
        m = self.cfg.model
        build_on = "meta" if torch.device(device).type == "meta" else "cpu"
        full = str(m.train) == "full"
        modules: dict[str, nn.Module] = {}
        for name, cls in self.module_classes().items():
            trained_full = name == self.denoiser and full
            module = self.load_component(name, cls, build_on, self.module_dtype(name, trained_full))
            if trained_full:
                module.requires_grad_(True)
                module.train()
            else:
                freeze(module)
            modules[name] = module
        if not full:
            attach_lora(modules[self.denoiser], m.lora_rank, m.lora_alpha, list(m.lora_targets), self.train_dtype)
            modules[self.denoiser].train()
        models = ModelSet(modules=modules, trained={self.denoiser}, dtypes_applied=True)
        models.blocks = self.repeated_blocks(models)
        return models

    def repeated_blocks(self, models: ModelSet) -> dict[str, list[nn.Module]]:
        """Outermost repeated blocks of the trained denoiser (see :func:`find_repeated_blocks`)."""
        return {self.denoiser: find_repeated_blocks(models[self.denoiser])}

    # -- encoding (see "Cacheable encoding" in runner/trainer.py) ------------------------------
    # Bump when encode_part computes something different, so that old cache entries miss.
    cache_format: int = 1

    def encode_parts(self) -> dict[str, EncodePart]:
        """Both built-in families: VAE latents from pixels, two text encoders' outputs from captions."""
        return {
            "latents": EncodePart(("vae",), ("pixel_values",)),
            "text": EncodePart(("text_encoder", "text_encoder_2"), ("caption",)),
        }

    @staticmethod
    def encode_latents(models: ModelSet, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior (mean, std): sampling happens per step, so a cache entry stays reusable."""
        vae = models["vae"]
        dist = vae.encode(batch["pixel_values"].to(compute_dtype(vae))).latent_dist
        # Contiguous, as a cache entry read back is: the CPU VAE returns channels-last
        # tensors, and that layout made the denoiser's backward round differently.
        return {"latent_mean": dist.mean.contiguous(), "latent_std": dist.std.contiguous()}

    @torch.no_grad()
    def encode(self, models: ModelSet, batch: Batch) -> Batch:
        """Pixels and captions to latents and conditioning, on the batch's device.

        Inputs go to the batch's device (the runner's compute device) rather than to each
        module's parameters, so modules parked elsewhere by an offload plugin still receive
        inputs where they will run.
        """
        parts = {name: self.encode_part(models, name, batch) for name in self.encode_parts()}
        return self.finish_encode(parts, batch)

    def vae_setting(self, key: str) -> Any:
        """A VAE config value (``scaling_factor``, ``shift_factor``) without building the VAE:
        from its config dict, else the class default, i.e. what ``vae.config`` would hold."""
        import inspect

        cfg = self.component_config("vae")
        if key in cfg:
            return cfg[key]
        return inspect.signature(self.module_classes()["vae"].__init__).parameters[key].default

    def module_source(self, name: str) -> dict[str, Any]:
        """Where a module's weights come from, for cache keys: its folder's files (path, size,
        mtime), or, when randomly initialised, what that init depends on (the runner seeds the
        RNG with ``train.seed`` right before ``build_models``)."""
        if self._folder_has(name):
            folder = os.path.join(self.source[1], name)
            return {"folder": folder, "files": file_stats(folder)}
        seed = self.cfg.get("train", {}).get("seed") if hasattr(self.cfg, "get") else None
        return {
            "random_init": True,
            "seed": seed,
            "size": self.size,
            "model_path": self.source[1] if self.source else None,
            "config": self.size_configs()[name],
        }

    def tokenizer_source(self, name: str) -> dict[str, Any]:
        tok = self.tokenizer(name)
        info: dict[str, Any] = {"class": type(tok).__name__, "model_max_length": int(tok.model_max_length)}
        if self._folder_has(name):
            folder = os.path.join(self.source[1], name)
            info["files"] = file_stats(folder)
        else:
            info["vocab_size"] = int(tok.vocab_size)
        return info

    def cache_signature(self, part: str) -> dict[str, Any]:
        """Every setting that changes ``encode_part(part)`` besides the sample itself."""
        spec = self.encode_parts()[part]
        sig: dict[str, Any] = {
            "format": self.cache_format,
            "trainer": f"{type(self).__module__}.{type(self).__qualname__}",
            "part": part,
            "modules": {
                name: {"dtype": str(self.module_dtype(name, False)).replace("torch.", ""), "source": self.module_source(name)}
                for name in spec.modules
            },
        }
        if "pixel_values" in spec.inputs:
            data = self.cfg.data
            sig["data"] = {
                "resolution": int(data.resolution),
                "center_crop": bool(data.get("center_crop", True)),
                "random_flip": bool(data.get("random_flip", False)),
            }
        if "caption" in spec.inputs:
            sig["tokenizers"] = {
                m.replace("text_encoder", "tokenizer"): self.tokenizer_source(m.replace("text_encoder", "tokenizer"))
                for m in spec.modules
                if m.startswith("text_encoder")
            }
        return sig

    def dataset(self) -> Any:
        from runner.data import build_dataset  # lazily: the data module is optional for planning

        return build_dataset(self.cfg.data)

    # -- tokenizers ---------------------------------------------------------------------
    def default_tokenizer(self, name: str) -> Any:
        raise NotImplementedError

    def tokenizer(self, name: str) -> Any:
        """``tokenizer`` / ``tokenizer_2``: from the diffusers folder, else generated offline.

        A folder whose text encoder is loaded but whose tokenizer is missing is an error: the
        byte-level fallback would feed the real encoder meaningless ids without failing.
        """
        if self._tokenizers is None:
            self._tokenizers = {}
        if name not in self._tokenizers:
            encoder = name.replace("tokenizer", "text_encoder")
            if self._folder_has(name):
                tok = load_folder_tokenizer(self.source[1], name)
            elif self._folder_has(encoder):
                raise UserError(
                    f"model.path '{self.source[1]}' has a {encoder}/ subfolder but no {name}/ subfolder; "
                    f"the tokenizer must come with its text encoder. Accepted: {SAFETENSORS_ACCEPTED}."
                )
            else:
                tok = self.default_tokenizer(name)
            self._tokenizers[name] = tok
        return self._tokenizers[name]

    # -- helpers for example batches -----------------------------------------------------
    def resolution(self) -> int:
        return int(self.cfg.data.resolution)

    @staticmethod
    def example_tensor(
        shape: tuple[int, ...], device: str | torch.device, dtype: torch.dtype, seed: int = 0
    ) -> torch.Tensor:
        """Shape-only on meta; seeded standard-normal values elsewhere, so a loss is finite."""
        if torch.device(device).type == "meta":
            return torch.empty(shape, device="meta", dtype=dtype)
        g = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    @staticmethod
    def example_seeds(batch_size: int, device: str | torch.device) -> torch.Tensor:
        """Seeds stay on the CPU for ``meta``: the per-sample draws read them with ``tolist()``."""
        dev = "cpu" if torch.device(device).type == "meta" else device
        return torch.arange(batch_size, dtype=torch.int64, device=dev)

    def example_raw_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """A raw batch as the data loader gives it at ``data.resolution``, for the planner's encode step.

        Captions are padded to the tokenizers' fixed lengths, so their text does not change any shape.
        """
        res = self.resolution()
        return {
            "pixel_values": self.example_tensor((batch_size, 3, res, res), device, torch.float32, 3),
            "caption": ["an example caption"] * batch_size,
            "index": self.example_seeds(batch_size, device),
            "sample_seed": self.example_seeds(batch_size, device),
        }


def vae_scale_factor(vae_config: dict[str, Any]) -> int:
    """Downsampling factor of an AutoencoderKL: one halving per block but the last (8 for 4 blocks)."""
    return 2 ** (len(vae_config["block_out_channels"]) - 1)
