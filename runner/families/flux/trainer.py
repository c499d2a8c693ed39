"""Flux: train the transformer (fully or with LoRA) with the rectified-flow matching loss.

Conditioning as in diffusers' ``FluxPipeline``: the CLIP text encoder's pooled output goes to
``pooled_projections``, the T5 encoder's last hidden state to ``encoder_hidden_states``; latents
are ``(z - shift_factor) * scaling_factor`` of the 16-channel VAE, packed 2x2 into 64-wide tokens
with the pipeline's own ``_pack_latents`` / ``_prepare_latent_image_ids``.

Loss: the flow-matching family's (runner/families/common/flow.py), ``x_t = (1 - t) x0 + t noise``, target
``noise - x0``, MSE over the packed tokens. ``t`` is logit-normal by default, ``sigmoid(N(0, 1))``,
which concentrates training on middle noise levels as SD3/Flux trainers do (diffusers'
``compute_density_for_timestep_sampling("logit_normal")``), with no shift (as diffusers' Flux
scripts train); ``loss.timestep_sampling``, ``loss.timestep_shift`` (``resolution``: Flux's own
``mu`` from the image's token count) change it (runner/loss/objectives.py).
"""
from __future__ import annotations

from typing import Any

import torch

from runner.families.common.loading import pipeline_class
from runner.families.common.model_configs import CLIP_MAX_LENGTH
from runner.families.common.tokenizers import clip_tokenizer, t5_tokenizer, tokenize
from runner.families.flux.architecture import FLUX_T5_MAX_LENGTH, flux_configs
from runner.families.flux.config import FluxTrainerConfig
from runner.families.flux.dit import PackedDiTTrainer, _image_ids, _pack_latents
from runner.trainer import Batch, ModelSet, batch_device


class FluxTrainer(PackedDiTTrainer):
    """Flux transformer, rectified-flow matching loss."""

    Config = FluxTrainerConfig
    denoiser = "transformer"
    display_name = "Flux"
    family = "flux"
    reference_repo = "black-forest-labs/FLUX.1-dev"
    kohya_base_model_version = "flux1"

    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        self.guidance = float(cfg.trainer.get("guidance", 1.0))

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKL, FluxTransformer2DModel
        from transformers import CLIPTextModel, T5EncoderModel

        return {
            "transformer": FluxTransformer2DModel,
            "vae": AutoencoderKL,
            "text_encoder": CLIPTextModel,
            "text_encoder_2": T5EncoderModel,
        }

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return flux_configs(self.size)

    def default_tokenizer(self, name: str) -> Any:
        if name == "tokenizer":
            return clip_tokenizer(CLIP_MAX_LENGTH)
        return t5_tokenizer(FLUX_T5_MAX_LENGTH[self.size])

    def pipeline_class(self) -> type:
        return pipeline_class("FluxPipeline")

    def inference_scheduler(self) -> Any:
        """black-forest-labs/FLUX.1-dev's scheduler/scheduler_config.json (resolution-dependent shift)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        )

    def sampling_family(self) -> Any:
        from runner.families.flux.sampling import FluxSampling

        return FluxSampling()

    def t5_max_length(self) -> int:
        """T5 prompt length: the tokenizer's ``model_max_length``, capped at FLUX.1-dev's 512.

        Taken from the tokenizer rather than from ``model.size`` so that a real folder used with
        the default ``size=tiny`` still gets 512 tokens; the generated tokenizer carries the
        size's length (64 tiny, 512 full), which a saved folder then keeps.
        """
        tok = self.tokenizer("tokenizer_2")
        return int(min(tok.model_max_length, FLUX_T5_MAX_LENGTH["full"]))

    # -- protocol -------------------------------------------------------------------------
    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior (mean, std), or CLIP's pooled output and T5's hidden states."""
        if part == "latents":
            return self.encode_latents(models, batch)
        device = batch_device(batch)
        clip, t5 = models["text_encoder"], models["text_encoder_2"]
        captions = list(batch["caption"])
        tok1 = self.tokenizer("tokenizer")
        ids1 = tokenize(tok1, captions, self.text_max_length(tok1, clip.config), device)
        pooled = clip(ids1).pooler_output
        ids2 = tokenize(self.tokenizer("tokenizer_2"), captions, self.t5_max_length(), device)
        prompt_embeds = t5(ids2).last_hidden_state
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """2x2 latent patches as 64-wide tokens (``FluxPipeline._pack_latents``)."""
        return _pack_latents(latents)

    def flux_inputs(self, transformer: Any, noisy: torch.Tensor, batch: Batch, dt: torch.dtype) -> dict[str, Any]:
        """The guidance embedding's input (guidance-distilled models only) and CLIP's pooled output."""
        guidance = None
        if transformer.config.guidance_embeds:
            guidance = torch.full((noisy.shape[0],), self.guidance, device=noisy.device, dtype=torch.float32)
        return {"guidance": guidance, "pooled_projections": batch["pooled_prompt_embeds"].to(dt)}

    def dit_inputs(self, transformer: Any, noisy: torch.Tensor, batch: Batch,
                   dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        _, _, h, w = noisy.shape
        extra = self.flux_inputs(transformer, noisy, batch, dt)
        return _pack_latents(noisy).to(dt), _image_ids(h, w, noisy.device), extra

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives at :meth:`planned_size`."""
        clip_cfg = self.component_config("text_encoder")
        t5_cfg = self.component_config("text_encoder_2")
        b, dt = batch_size, self.storage_dtype
        return {
            "latents": self.example_latents(b, device),
            "prompt_embeds": self.example_tensor((b, self.t5_max_length(), int(t5_cfg["d_model"])), device, dt, 1),
            "pooled_prompt_embeds": self.example_tensor((b, int(clip_cfg["hidden_size"])), device, dt, 2),
            "sample_seed": self.example_seeds(b, device),
        }
