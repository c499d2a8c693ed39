"""Flux.2: train the FLUX.2 dev transformer (fully or with LoRA) with the rectified-flow loss,
optionally on targets with reference images.

Everything below is what diffusers' ``Flux2Pipeline`` does, called through its own static helpers
so that training feeds the transformer what inference feeds it:

* Text: the caption in the pipeline's chat layout (its system message, then the caption as the
  user's turn), padded to 512 tokens, through Mistral-Small-3.1; hidden states 10, 20 and 30 are
  stacked on the feature axis (``_get_mistral_3_small_prompt_embeds``): ``[B, 512, 3 x 5120]``.
  Text ids are ``(0, 0, 0, l)`` (``_prepare_text_ids``). The text encoder is needed only for this
  (cacheable) part: with ``offload=park`` it is dropped after caching.
* Latents: the 32-channel VAE posterior is patchified 2x2 into 128 channels at half the grid
  (``_patchify_latents``), then normalised with the VAE's batch-norm running statistics
  (``(z - mean) / sqrt(var + eps)``, ``_encode_vae_image``), and each grid cell is one token
  (``_pack_latents``: a flatten, no further packing); ids ``(0, h, w, 0)`` (``_prepare_latent_ids``).
  The normalisation is done on the posterior's moments in :meth:`encode_part` (an affine map per
  channel: ``mean' = (P(mean) - m) / s``, ``std' = P(std) / s``), so a per-step draw from the cached
  moments is a draw of the normalised latents and ``normalize_latents`` is the identity.
* References (``data.references=N``, up to :attr:`max_references`): each reference's posterior
  *mode* (the mean, the pipeline's ``argmax``), patchified and normalised the same way, joins the
  sequence after the target's tokens, with ids ``(10 + 10 k, h, w, 0)`` for reference ``k = 0..N-1``
  (``_prepare_image_ids``); the output is cut back to the target's tokens, so the loss is on the
  target alone. Trade-off as in Flux.1 Kontext: references are cropped and bucketed with their
  target (one size per batch); the pipeline resizes each to at most 1024x1024 px on its own.
* Timestep ``t`` in (0, 1) (the pipeline's ``timestep / 1000``); guidance ``trainer.guidance`` into
  the guidance embedding (FLUX.2 dev is guidance-distilled); target ``noise - x0``.

FLUX.2 klein (``trainer.variant=klein``, 4 B, or ``klein-9b``) is the same transformer narrower, without a
guidance embedding, with Qwen3 as the text encoder: ``Flux2KleinPipeline._get_qwen3_prompt_embeds`` (the
caption as one user turn, generation prompt, thinking off, padded to 512; hidden states 9, 18, 27 stacked).
Latents, ids, references and the loss are dev's.
"""
from __future__ import annotations

from typing import Any

import torch

from runner.errors import UserError
from runner.families.common.base import with_latent_mask
from runner.families.common.flow import FlowMatchTrainer
from runner.families.common.latents import vae_scale_factor
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.common.tokenizers import mistral_tokenizer, qwen3_tokenizer
from runner.families.flux2 import architecture as flux2_configs
from runner.families.flux2.config import Flux2TrainerConfig
from runner.trainer import Batch, EncodePart, ModelSet, batch_device


def _pipe(klein: bool = False) -> Any:
    return pipeline_class("Flux2KleinPipeline" if klein else "Flux2Pipeline")


def normalized_moments(vae: Any, mean: torch.Tensor, std: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
    """The posterior's mean (and std) patchified and batch-norm normalised as ``_encode_vae_image`` does
    to a latent: float32, contiguous (as a cache entry read back is)."""
    pipe = _pipe()
    bn_mean = vae.bn.running_mean.float().view(1, -1, 1, 1).to(mean.device)
    bn_std = torch.sqrt(vae.bn.running_var.float().view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(mean.device)
    out_mean = ((pipe._patchify_latents(mean.float()) - bn_mean) / bn_std).contiguous()
    out_std = None if std is None else (pipe._patchify_latents(std.float()) / bn_std).contiguous()
    return out_mean, out_std


def flux2_inputs(noisy: torch.Tensor, references: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer's image tokens and ids: the target's (``prepare_latents``), then each reference's
    (``prepare_image_latents``), as ``Flux2Pipeline.__call__`` concatenates them."""
    pipe = _pipe()
    device = noisy.device
    tokens, ids = [pipe._pack_latents(noisy).to(dtype)], [pipe._prepare_latent_ids(noisy).to(device)]
    if references is not None and references.shape[1]:
        b = noisy.shape[0]
        refs = [references[:, k].to(device) for k in range(references.shape[1])]
        ref_ids = pipe._prepare_image_ids([r[:1] for r in refs]).to(device)
        tokens += [pipe._pack_latents(r).to(dtype) for r in refs]
        ids.append(ref_ids.expand(b, -1, -1))
    return torch.cat(tokens, dim=1), torch.cat(ids, dim=1)


class Flux2Trainer(FlowMatchTrainer):
    """FLUX.2 dev / klein transformer, rectified-flow matching loss, optional reference images."""

    Config = Flux2TrainerConfig
    denoiser = "transformer"
    display_name = "Flux.2"
    family = "flux2"  # no original-layout single file is converted (runner/families/common/single_file.py knows none)
    reference_repo = "black-forest-labs/FLUX.2-dev"
    kohya_lora = False  # no kohya file: the ComfyUI one below is what other tools read
    comfy_layout = "flux2"  # BFL's names under diffusion_model., q/k/v fused (runner/families/flux2/comfy.py)
    latent_patch = 1  # the patchified latents' grid is the token grid
    max_references = 4  # reference images per target (Flux2Pipeline takes a list; BFL recommend up to ~10)

    def __init__(self, cfg: Any, run: Any = None) -> None:
        self.variant = str(cfg.trainer.get("variant", "dev"))
        if self.variant not in flux2_configs.VARIANTS:
            raise UserError(f"trainer.variant={self.variant!r} is not a Flux.2 variant this runner builds: valid "
                            f"values are {', '.join(flux2_configs.VARIANTS)} (klein: FLUX.2 klein 4B, klein-9b: "
                            "FLUX.2 klein 9B, both with Qwen3; dev: FLUX.2 dev, 32 B, with Mistral-Small-3.1).")
        self.klein = self.variant in flux2_configs.KLEIN
        super().__init__(cfg, run)
        self.guidance = float(cfg.trainer.get("guidance", 1.0))
        if self.klein and self.guidance != 1.0:
            raise UserError(f"trainer.guidance={self.guidance}: FLUX.2 {self.variant} has no guidance embedding (it is "
                            "not guidance-distilled), so the value would be ignored. Leave trainer.guidance at 1.0; "
                            "sampling guidance is classifier-free (the pipeline's guidance_scale).")
        from runner.export.config import export_config

        ec = export_config(cfg)
        kind = str(cfg.model.train)
        if ec.enabled and kind in ("lokr", "loha") and ec.wants("comfy"):
            raise UserError(
                f"export.lora_format={ec.lora_format} with model.train={kind}: the Flux.2 ComfyUI file fuses q/k/v "
                "into BFL's qkv, which this runner does for LoRA only. Set export.lora_format=diffusers, or "
                "model.train=lora.")

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
        from transformers import Mistral3ForConditionalGeneration, Qwen3ForCausalLM

        return {"transformer": Flux2Transformer2DModel, "vae": AutoencoderKLFlux2,
                "text_encoder": Qwen3ForCausalLM if self.klein else Mistral3ForConditionalGeneration}

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return flux2_configs.flux2_configs(self.variant, self.size)

    def default_tokenizer(self, name: str) -> Any:
        make = qwen3_tokenizer if self.klein else mistral_tokenizer
        return make(2 * flux2_configs.MAX_SEQUENCE_LENGTH)

    def pipeline_class(self) -> type:
        """``Flux2Pipeline`` (dev) or ``Flux2KleinPipeline`` (klein; its ``is_distilled`` left at the default,
        False: samples with classifier-free guidance, as a LoRA trained on the base model needs)."""
        return _pipe(self.klein)

    def inference_scheduler(self) -> Any:
        """FLUX.2 dev's scheduler: flow-matching Euler with dynamic shifting; ``Flux2Pipeline`` passes its
        own sigmas and its empirical ``mu`` (``compute_empirical_mu``) to it at every call."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                               base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                               max_image_seq_len=4096)

    def sampling_family(self) -> Any:
        from runner.families.flux2.sampling import Flux2Sampling

        return Flux2Sampling(self.klein, self.references)

    # -- protocol -------------------------------------------------------------------------
    def encode_parts(self) -> dict[str, EncodePart]:
        """VAE latents (and references) from pixels; Mistral's stacked hidden states from captions."""
        return {"latents": EncodePart(("vae",), self.image_inputs()), "text": EncodePart(("text_encoder",), ("caption",))}

    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The normalised posterior (and references' normalised modes), or the prompt embeddings as
        ``Flux2Pipeline.encode_prompt`` computes them."""
        if part == "latents":
            vae = models["vae"]
            dist = vae.encode(batch["pixel_values"].to(compute_dtype(vae))).latent_dist
            mean, std = normalized_moments(vae, dist.mean, dist.std)
            out = with_latent_mask({"latent_mean": mean, "latent_std": std}, batch)
            if self.references:
                refs = batch["references"]
                b, n = refs.shape[:2]
                ref_mean = vae.encode(refs.flatten(0, 1).to(compute_dtype(vae))).latent_dist.mean
                norm, _ = normalized_moments(vae, ref_mean)
                out["reference_latents"] = norm.view(b, n, *norm.shape[1:])
            return out
        captions, device = list(batch["caption"]), batch_device(batch)
        if self.klein:
            embeds = _pipe(True)._get_qwen3_prompt_embeds(
                models["text_encoder"], self.tokenizer("tokenizer"), captions, device=device,
                max_sequence_length=flux2_configs.MAX_SEQUENCE_LENGTH,
                hidden_states_layers=flux2_configs.QWEN3_HIDDEN_LAYERS)
            return {"prompt_embeds": embeds}
        pipe = _pipe()
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        embeds = pipe._get_mistral_3_small_prompt_embeds(
            models["text_encoder"], self.tokenizer("tokenizer"), captions, device=device,
            max_sequence_length=flux2_configs.MAX_SEQUENCE_LENGTH, system_message=SYSTEM_MESSAGE,
            hidden_states_layers=flux2_configs.MISTRAL_HIDDEN_LAYERS)
        return {"prompt_embeds": embeds}

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The identity: :meth:`encode_part` already normalised the moments (see the module docstring)."""
        return latents

    def finish_encode(self, parts: dict[str, dict[str, torch.Tensor]], batch: Batch) -> Batch:
        out = super().finish_encode(parts, batch)
        if "reference_latents" in parts["latents"]:
            out["reference_latents"] = parts["latents"]["reference_latents"].float()
        return out

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """One token per cell of the patchified grid (``Flux2Pipeline._pack_latents``)."""
        return _pipe()._pack_latents(latents)

    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``Flux2Pipeline``'s transformer call: target then reference tokens, 4-axis ids, the output cut
        back to the target's tokens."""
        transformer = models["transformer"]
        dt = compute_dtype(transformer)
        prompt_embeds = batch["prompt_embeds"].to(noisy.device, dt)
        b, _, h, w = noisy.shape
        hidden, ids = flux2_inputs(noisy, batch.get("reference_latents"), dt)
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance, device=noisy.device, dtype=torch.float32)
        return transformer(
            hidden_states=hidden,
            encoder_hidden_states=prompt_embeds,
            timestep=timesteps.to(dt),  # t in (0, 1): the pipeline's timestep / 1000
            img_ids=ids,
            txt_ids=_pipe()._prepare_text_ids(prompt_embeds).to(noisy.device),
            guidance=guidance,
            return_dict=False,
        )[0][:, : h * w]

    def example_latents(self, batch_size: int, device: str | torch.device) -> torch.Tensor:
        """Patchified latents at :meth:`planned_size`: ``4 x latent_channels`` at 1/16 of the pixels."""
        vae_cfg = self.component_config("vae")
        factor = 2 * vae_scale_factor(vae_cfg)
        h, w = self.planned_size()
        return self.example_tensor((batch_size, 4 * int(vae_cfg["latent_channels"]), h // factor, w // factor),
                                   device, torch.float32, 0)

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives at :meth:`planned_size` (references included)."""
        text_cfg = self.component_config("text_encoder")
        text_cfg = text_cfg if self.klein else text_cfg["text_config"]
        layers = flux2_configs.QWEN3_HIDDEN_LAYERS if self.klein else flux2_configs.MISTRAL_HIDDEN_LAYERS
        width = len(layers) * int(text_cfg["hidden_size"])
        b = batch_size
        batch = {
            "latents": self.example_latents(b, device),
            "prompt_embeds": self.example_tensor((b, flux2_configs.MAX_SEQUENCE_LENGTH, width), device,
                                                 self.storage_dtype, 1),
            "sample_seed": self.example_seeds(b, device),
        }
        if self.references:
            lat = batch["latents"]
            batch["reference_latents"] = self.example_tensor((b, self.references, *lat.shape[1:]), device,
                                                             torch.float32, 7)
        return batch
