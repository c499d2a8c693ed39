"""The shared skeleton of the built-in trainers.

Three layers, so that a model family is one small file (docs/adding-a-family.md):

* :class:`DiffusersTrainer` (here): what does not depend on the family or the loss: which module
  comes from where, in which dtype, frozen or trained; the cacheable encode step (VAE posterior
  and text conditioning), latents normalised as the family's VAE says; tokenizers; export and
  sampling hooks; example batches for the planner.
* one base per loss family: :class:`runner.families.common.ddpm.DDPMTrainer` (epsilon or v-prediction:
  SDXL, SD1.5/SD2.1) and :class:`runner.families.common.flow.FlowMatchTrainer` (rectified flow: Flux,
  SD3.5), which own the loss and its options (``loss.*``, runner/loss/objectives.py);
* the family: its module classes and config dicts, the text part of ``encode``, the denoiser
  call (``predict``), latent packing and its pipeline class.

Building and loading the modules is :mod:`runner.families.common.loading`, the tokenizers are
:mod:`runner.families.common.tokenizers`, the repeated blocks :mod:`runner.blocks`; the per-sample latent
draws and the VAE's geometry :mod:`runner.families.common.latents`, and the encode parts' cache keys
:mod:`runner.families.common.cache_keys` (a mixin of :class:`DiffusersTrainer`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

import torch
from torch import nn

from runner.blocks import find_repeated_blocks
from runner.adapters import DEFAULT_LORA_TARGETS, lora_alpha
from runner.constants import TRAIN_MODES
from runner.data.audio import refuse_audio_keys
from runner.data.checks import family_references
from runner.errors import UserError, valid_list
from runner.export.comfy import check_comfy_targets
from runner.families.common.cache_keys import CacheKeys
from runner.families.common.examples import ExampleBatches
from runner.families.common.latents import VAE_SALT, LatentMoments, sample_latents
from runner.families.common.loading import (
    SAFETENSORS_ACCEPTED,
    attach_lora,
    build_module,
    check_state_dict_keys,
    compute_dtype,
    dtype_from_name,
    freeze,
    load_folder_component,
    load_single_file,
    resolve_model_path,
)
from runner.families.common.tokenizers import load_folder_tokenizer
from runner.loss.objectives import check_objective, loss_config
from runner.trainer import Batch, EncodePart, ModelSet

log = logging.getLogger("runner")



# ---- shared trainer skeleton ------------------------------------------------------------------
def with_latent_mask(out: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
    """A latents part ``out`` with, when the batch has a loss mask (``data.masks``), ``latent_mask``:
    float32 ``[B, 1, h, w]`` on the latent grid of ``out["latent_mean"]``, the area average of the mask
    over each latent cell, so a latent is weighted by the share of its pixels the mask keeps
    (nearest-neighbour would drop thin strokes or keep cells that are mostly masked out)."""
    mask = batch.get("mask")
    if isinstance(mask, torch.Tensor):
        grid = tuple(out["latent_mean"].shape[-2:])
        out["latent_mask"] = torch.nn.functional.interpolate(mask.float(), size=grid, mode="area").contiguous()
    return out


class DiffusersTrainer(CacheKeys, ExampleBatches):
    """The parts of a trainer that do not depend on the model family.

    A loss-family base (ddpm.py, flow.py) adds ``loss``; a family sets ``denoiser`` (the trained
    module's name and diffusers subfolder) and implements :meth:`module_classes`,
    :meth:`size_configs`, :meth:`default_tokenizer`, ``encode_part`` (its text part),
    :meth:`predict`, :meth:`example_batch`, :meth:`pipeline_class`, :meth:`inference_scheduler`
    and :meth:`sampling_family`.

    Where each module comes from:

    * ``model.path`` unset: built from the ``model.size`` config dicts with random init.
    * a diffusers folder: every module from its subfolder (``from_pretrained``, offline). The
      denoiser's subfolder is required; a missing frozen module is built at random with a warning.
    * a hub id (``owner/name[@revision]``): the diffusers folder of its snapshot in the local hub
      cache (runner/families/common/hub.py).
    * a single .safetensors file in an original layout (A1111/ComfyUI SDXL, BFL Flux;
      runner/families/common/single_file.py): every module the file holds, converted with the
      architecture of ``model.size``, the others random with a warning; the tokenizers of the
      family's reference repository (``reference_repo``) from the hub cache.
    * a single .safetensors file in diffusers' key layout: the denoiser from it (architecture of
      ``model.size``); the frozen modules random, with a warning.

    Dtypes: frozen modules (and a LoRA's frozen base) are stored in ``model.dtype``; the trained
    weights (a fully fine-tuned denoiser, or the LoRA adapters) in ``model.train_dtype``: float32
    master weights by default (mixed precision is the runner's job), bfloat16 to halve them
    (kohya's ``--full_bf16``: what lets a full SDXL U-Net fine-tune fit 24 GB).
    """

    denoiser: str = ""
    denoiser_prefixes: tuple[str, ...] = ("unet.", "transformer.")
    family: str = ""  # matched against an original single file's layout (runner/families/common/single_file.py)
    reference_repo: str = ""  # hub repo whose tokenizers an original single file's text encoders need
    display_name: str = ""  # the family in messages ("SDXL"); the class name when empty
    objective: str | None = None  # runner.loss.objectives.DDPM | FLOW, set by the loss-family base
    resolution_multiple: int = 8  # data.resolution must be a multiple (VAE factor x latent packing)
    kohya_lora: bool = True  # whether diffusers reads a kohya-layout LoRA of this family back (runner/export/)
    kohya_base_model_version: str | None = None  # kohya's ss_base_model_version of this family's LoRAs
    comfy_layout: str = "kohya"  # the LoRA key layout ComfyUI maps for this family (runner/export/comfy.py LAYOUTS)
    lora_default_targets: tuple[str, ...] = ()  # the family's LoRA targets when model.lora_targets is left at its default
    audio_trainer: bool = False  # trains an audio stream beside the video (data.audio, loss.audio_weight): LTX-2
    max_references: int = 0  # reference images per target an edit family takes (data.references; 0: not an edit family)
    default_references: int = 0  # data.references unset: how many it trains on (an edit family that needs them: its count)
    # dist=fsdp's sharded load (runner/distributed/loading.py) sets this around build_models: these modules are
    # built with their parameters on meta (buffers real, :func:`build_empty`), their weights filled in later.
    empty_modules: frozenset[str] = frozenset()
    _file_keys: list[str] | None = None  # the single file's keys, read once (_stored_file_keys)

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
                f"model.path '{folder}' has no '{self.folder_name(self.denoiser)}/' subfolder for the {self.denoiser} "
                f"(subfolders found: {', '.join(present) or 'none'}). Accepted: {SAFETENSORS_ACCEPTED}."
            )
        self._tokenizers: dict[str, Any] | None = None
        self.layout, self.header = None, None  # an original single file's layout and its header
        if self.source is not None and self.source[0] == "file":
            self._open_single_file(self.source[1])
        name = self.display_name or type(self).__name__
        self.loss_options = loss_config(cfg)  # loss.* (runner/loss/objectives.py), read by the loss-family base
        data = cfg.get("data") if hasattr(cfg, "get") else None
        self.masks = bool(data.get("masks", False)) if data is not None and hasattr(data, "get") else False
        self.references = family_references(data, self.max_references, name, self.default_references)
        if self.objective is not None:
            check_objective(self.loss_options, self.objective, f"trainer {name}")
        if not self.audio_trainer:
            refuse_audio_keys(cfg, name)
        export = cfg.get("export") if hasattr(cfg, "get") else None
        if export is not None and str(export.get("lora_format", "both")) == "kohya" and not self.kohya_lora:
            raise UserError(f"export.lora_format=kohya: diffusers cannot read a kohya-layout {name} LoRA back, so the "
                            "runner does not write one. Use export.lora_format=comfy (lora_comfy.safetensors, the "
                            "layout ComfyUI and Forge load at the trained strength), diffusers, or both (the "
                            "default: diffusers + comfy).")
        res, k = self.resolution(), self.resolution_multiple
        if res <= 0 or res % k:
            raise UserError(f"data.resolution={res} is not usable for {name}: it must be a positive multiple of {k} "
                            f"({self.resolution_reason()}), e.g. {max(k, res // k * k)}.")
        self.check_sizes(k, self.resolution_reason())  # aspect-ratio buckets and per-set resolutions

    def _open_single_file(self, file: str) -> None:
        """Header, layout, family and tokenizers checked before any weight is read (single_file.py)."""
        from runner.families.common.single_file_load import open_single_file

        self.layout, self.header = open_single_file(self, file)

    def file_provides(self, name: str) -> bool:
        """Whether the original single file of ``model.path`` holds module ``name``."""
        layout = self.layout
        return layout is not None and name in layout.components and bool(layout.components[name].keys(self.header))

    # -- to implement ----------------------------------------------------------------------
    def module_classes(self) -> dict[str, type]:
        raise NotImplementedError

    def size_configs(self) -> dict[str, dict[str, Any]]:
        raise NotImplementedError

    def pipeline_class(self) -> type:
        """The diffusers pipeline class of this family: what exports write for (runner/export/)."""
        raise NotImplementedError

    def inference_scheduler(self) -> Any:
        """The sampling scheduler a pipeline of this family ships with (not the training one)."""
        raise NotImplementedError

    def resolution_reason(self) -> str:
        """Why ``data.resolution`` must be a multiple of :attr:`resolution_multiple`, for the message."""
        return "the VAE factor" if self.resolution_multiple == 8 else "VAE factor 8 times the 2x2 latent packing"

    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The denoiser's output for ``noisy`` latents ``(B, C, H, W)`` at ``timesteps`` (the loss
        family's: DDPM integer steps, flow-matching t in (0, 1)), conditioned on the encoded
        ``batch``, in the layout of :meth:`pack` (the loss packs its target the same way). Packs and
        casts its inputs to the denoiser's compute dtype inside the call's arguments, so that no
        float32 copy stays alive through the forward."""
        raise NotImplementedError

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C, H, W)`` in the layout the denoiser takes (Flux: 2x2 patches as tokens); the
        identity for denoisers that patchify themselves."""
        return latents

    def sampling_family(self) -> Any:
        """The family's sampling helper (runner/sampling/pipelines.py), or None (no built-in samples)."""
        return None

    def pipeline_kwargs(self) -> dict[str, Any]:
        """Extra constructor arguments of :meth:`pipeline_class` beyond modules, tokenizers and scheduler."""
        return {}

    def pipeline(self, models: ModelSet) -> Any:
        """A diffusers pipeline around the modules in memory (no copy): ``models`` plus this
        trainer's tokenizers and :meth:`inference_scheduler`. What a full fine-tune is exported
        as, and what the export tests render with; every module must be present (a run whose
        plugins dropped or quantized frozen modules rebuilds them first, runner/export/)."""
        parts: dict[str, Any] = {name: models[name] for name in self.module_classes()}
        for name in parts.copy():
            if name.startswith("text_encoder"):
                tok = name.replace("text_encoder", "tokenizer")
                parts[tok] = self.tokenizer(tok)
        return self.pipeline_class()(**parts, scheduler=self.inference_scheduler(), **self.pipeline_kwargs())

    # -- configs -------------------------------------------------------------------------
    def folder_name(self, name: str) -> str:
        """The diffusers subfolder of module ``name``: its name, unless a family says (Wan 2.2 A14B's experts)."""
        return name

    def _folder_has(self, name: str) -> bool:
        src = self.source
        return src is not None and src[0] == "folder" and os.path.isdir(os.path.join(src[1], self.folder_name(name)))

    def component_config(self, name: str) -> dict[str, Any]:
        """The architecture of one module as a dict (folder config.json, else the size's dict).

        Read without building anything, so ``example_batch`` can size tensors for the planner.
        """
        if self._folder_has(name):
            with open(os.path.join(self.source[1], self.folder_name(name), "config.json")) as f:
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

    def weight_files(self, name: str) -> dict[str, tuple[str, str]] | None:
        """Where each weight of module ``name`` lies, when it is read as stored, without conversion:
        model key -> (safetensors file, key in it), for a diffusers folder's safetensors or a single
        file in diffusers' key layout (the denoiser). None: built at random, converted from an original
        layout, or ``.bin`` weights; such a module is read whole (runner/distributed/loading.py)."""
        from runner.families.common.loading import folder_weight_files

        src = self.source
        if src is not None and src[0] == "folder" and self._folder_has(name):
            return folder_weight_files(src[1], self.folder_name(name))
        keys = self._stored_file_keys(name)
        if keys is not None:
            from runner.families.common.loading import _strip_prefix

            return {model_key: (src[1], file_key)
                    for file_key, model_key in _strip_prefix(keys, self.denoiser_prefixes).items()}
        return None

    def _stored_file_keys(self, name: str) -> list[str] | None:
        """The single file's keys when module ``name`` is read from it as stored (the denoiser, in
        diffusers' layout); read from its header once per trainer."""
        src = self.source
        if src is None or src[0] != "file" or self.layout is not None or name != self.denoiser:
            return None
        if self._file_keys is None:
            from safetensors import safe_open

            with safe_open(src[1], framework="pt", device="cpu") as f:
                self._file_keys = list(f.keys())
        return self._file_keys

    def load_component(self, name: str, cls: type, device: str, dtype: torch.dtype) -> nn.Module:
        src = self.source
        if name in self.empty_modules and torch.device(device).type != "meta":
            return self._empty_component(name, cls, dtype)
        if src is not None and src[0] == "folder":
            if self._folder_has(name):  # the denoiser's subfolder was checked in __init__
                return load_folder_component(cls, src[1], self.folder_name(name), dtype, device)
            log.warning(
                "model.path %s has no %s/ subfolder: %s is randomly initialised (model.size=%s)",
                src[1], name, name, self.size,
            )
        elif src is not None and src[0] == "file" and self.layout is not None:
            if self.file_provides(name):
                from runner.families.common.single_file_load import load_component

                return load_component(src[1], self.header, self.layout, name, cls, self.size_configs()[name], dtype,
                                      device, f"model.size={self.size}")
            log.warning("model.path %s holds no %s: %s is randomly initialised (model.size=%s)", src[1], name, name,
                        self.size)
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

    def _empty_component(self, name: str, cls: type, dtype: torch.dtype) -> nn.Module:
        """Module ``name`` as :meth:`load_component` would build it, its parameters on meta (``empty_modules``)."""
        from runner.families.common.loading import build_empty, read_folder_config

        src = self.source
        if src is not None and src[0] == "folder" and self._folder_has(name):
            return build_empty(cls, read_folder_config(cls, src[1], self.folder_name(name)), dtype)
        model = build_empty(cls, self.size_configs()[name], dtype,
                            every_tensor=src is not None and src[0] == "file" and name == self.denoiser)
        keys = self._stored_file_keys(name)
        if keys is not None:
            check_state_dict_keys(src[1], keys, model, self.denoiser_prefixes, f"model.size={self.size}")
        return model

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
            from runner.meta_weights import stand_in_weights

            # An empty base (runner/distributed/loading.py) gets CPU stand-ins while the adapters are drawn, so they
            # come out on the host in the base's dtype, as over a loaded base (runner/meta_weights.py).
            empty = self.denoiser in self.empty_modules and torch.device(build_on).type != "meta"
            with stand_in_weights(modules[self.denoiser]) if empty else contextlib.nullcontext():
                attach_lora(modules[self.denoiser], m.lora_rank, lora_alpha(m), self.lora_targets(m), self.train_dtype,
                            dora=bool(m.get("lora_dora", False)), kind=str(m.train), factor=int(m.get("lokr_factor", -1)))
            check_comfy_targets(self.cfg, self.comfy_layout, modules[self.denoiser], self.display_name or type(self).__name__)
            modules[self.denoiser].train()
        models = ModelSet(modules=modules, trained={self.denoiser}, dtypes_applied=True)
        models.blocks = self.repeated_blocks(models)
        return models

    def repeated_blocks(self, models: ModelSet) -> dict[str, list[nn.Module]]:
        """Outermost repeated blocks of the trained denoiser (see :func:`find_repeated_blocks`)."""
        return {self.denoiser: find_repeated_blocks(models[self.denoiser])}

    # -- encoding (see "Cacheable encoding" in runner/trainer.py) ------------------------------
    def encode_parts(self) -> dict[str, EncodePart]:
        """Both built-in families: VAE latents from pixels, two text encoders' outputs from captions."""
        return {
            "latents": EncodePart(("vae",), self.image_inputs()),
            "text": EncodePart(("text_encoder", "text_encoder_2"), ("caption",)),
        }

    def image_inputs(self) -> tuple[str, ...]:
        """What the latents part reads: the pixels, and with ``data.masks`` their loss mask, so the
        mask is cached with the latents and its content is in the cache key (plugins/park/cache.py)."""
        return ("pixel_values",) + (("mask",) if self.masks else ()) + (("references",) if self.references else ())

    @staticmethod
    def encode_latents(models: ModelSet, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior (mean, std): sampling happens per step, so a cache entry stays reusable.

        With a loss mask (``data.masks``) also ``latent_mask`` (:func:`with_latent_mask`)."""
        vae = models["vae"]
        dist = vae.encode(batch["pixel_values"].to(compute_dtype(vae))).latent_dist
        # Contiguous, as a cache entry read back is: the CPU VAE returns channels-last
        # tensors, and that layout made the denoiser's backward round differently.
        return with_latent_mask({"latent_mean": dist.mean.contiguous(), "latent_std": dist.std.contiguous()}, batch)

    @torch.no_grad()
    def encode(self, models: ModelSet, batch: Batch) -> Batch:
        """Pixels and captions to latents and conditioning, on the batch's device.

        Inputs go to the batch's device (the runner's compute device) rather than to each
        module's parameters, so modules parked elsewhere by an offload plugin still receive
        inputs where they will run.
        """
        parts = {name: self.encode_part(models, name, batch) for name in self.encode_parts()}
        return self.finish_encode(parts, batch)

    def finish_encode(self, parts: dict[str, dict[str, torch.Tensor]], batch: Batch) -> Batch:
        """Sample the latents with each sample's seed and normalise them; the text part as encoded,
        plus :meth:`extra_conditioning`. Image sizes come from the latents, never the pixels, so a
        batch whose parts were all read from a cache needs no pixels."""
        seeds = batch["sample_seed"]
        lat = parts["latents"]
        latents = self.normalize_latents(sample_latents(LatentMoments(lat["latent_mean"], lat["latent_std"]), seeds, VAE_SALT))
        out = {"latents": latents, **parts["text"], **self.extra_conditioning(latents, batch), "sample_seed": seeds}
        if "latent_mask" in lat:  # data.masks: the loss averages over it (runner/loss/objectives.py)
            out["loss_mask"] = lat["latent_mask"].float()
        if "prior" in batch:  # a sample of a prior (class) set: its loss x loss.prior_weight
            out["prior"] = batch["prior"]
        return out

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``(z - shift_factor) * scaling_factor`` of the VAE config (no shift when it has none):
        the latent space the denoiser was trained in, as the family's pipeline un-does it."""
        shift = self.vae_setting("shift_factor") or 0.0
        return (latents - shift) * self.vae_setting("scaling_factor")

    def extra_conditioning(self, latents: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """Conditioning that is neither latents nor text (SDXL's ``time_ids``); none by default."""
        return {}

    def vae_setting(self, key: str) -> Any:
        """A VAE config value (``scaling_factor``, ``shift_factor``) without building the VAE:
        from its config dict, else the class default, i.e. what ``vae.config`` would hold."""
        import inspect

        cfg = self.component_config("vae")
        if key in cfg:
            return cfg[key]
        return inspect.signature(self.module_classes()["vae"].__init__).parameters[key].default

    def lora_targets(self, m: Any) -> list[str]:
        """``model.lora_targets``, or the family's ``lora_default_targets`` where the runner's default is left as
        it is (a family whose attention names differ from diffusers' usual ones; a preset stays trainer-neutral)."""
        targets = list(m.lora_targets)
        return list(self.lora_default_targets) if self.lora_default_targets and targets == list(DEFAULT_LORA_TARGETS) \
            else targets

    def dataset(self) -> Any:
        from runner.data import (
            build_dataset,  # lazily: the data module is optional for planning
        )

        return build_dataset(self.cfg.data, references=self.references)

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
            elif self.file_provides(encoder):
                tok = self.reference_tokenizer(name)
            else:
                tok = self.default_tokenizer(name)
            self._tokenizers[name] = tok
        return self._tokenizers[name]

    def reference_tokenizer(self, name: str) -> Any:
        """The tokenizer of a text encoder read from an original single file (single_file.py)."""
        from runner.families.common.single_file_load import reference_tokenizer

        return reference_tokenizer(self, name)

    @staticmethod
    def text_max_length(tokenizer: Any, encoder_config: Any) -> int:
        """A CLIP prompt's token count: the tokenizer's length, capped at the encoder's positions."""
        return int(min(tokenizer.model_max_length, encoder_config.max_position_embeddings))
