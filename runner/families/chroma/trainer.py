"""Chroma: train the 8.9 B Flux-derived transformer (fully or with LoRA) with the rectified-flow loss.

Chroma (lodestones/Chroma1-HD) is FLUX.1-schnell's architecture with the per-block modulation
linears replaced by one small shared network (the "distilled guidance" approximator), no CLIP and
no guidance embedding. What it shares with Flux is reused from runner/families/flux/trainer.py: the
16-channel VAE with ``(z - shift_factor) * scaling_factor``, the 2x2 latent packing and the image
position ids (``FluxPipeline``'s own helpers), and the flow-matching loss (runner/families/common/flow.py,
``t`` logit-normal and unshifted by default, ``loss.*`` changes it).

Conditioning as diffusers' ``ChromaPipeline._get_t5_prompt_embeds`` computes it: T5-XXL's last
hidden state of the caption padded to the prompt length *with* the tokenizer's attention mask
(unlike Flux), and a text mask that keeps the caption's tokens and the first padding token.
The transformer gets that mask extended by ones over the image tokens, in the compute dtype, as
the pipeline passes it. Trade-off: diffusers' attention receives this 0/1 mask as a floating
tensor, which scaled-dot-product attention adds to the scores rather than using as a hard mask;
training feeds exactly what ``ChromaPipeline`` feeds at inference, so a trained LoRA samples as
it trained, at the cost of matching diffusers rather than the original implementation's hard mask.
"""
from __future__ import annotations

from typing import Any

import torch

from runner.errors import UserError
from runner.families.chroma.architecture import chroma_configs
from runner.families.chroma.config import ChromaTrainerConfig
from runner.families.common.loading import pipeline_class
from runner.families.common.tokenizers import t5_tokenizer
from runner.families.flux.architecture import FLUX_T5_MAX_LENGTH
from runner.families.flux.dit import PackedDiTTrainer, _image_ids, _pack_latents
from runner.trainer import Batch, EncodePart, ModelSet, batch_device


class ChromaTrainer(PackedDiTTrainer):
    """Chroma transformer, rectified-flow matching loss."""

    Config = ChromaTrainerConfig
    denoiser = "transformer"
    display_name = "Chroma"
    family = "chroma"  # an original Chroma file is recognised (runner/families/common/single_file.py), then refused
    reference_repo = "lodestones/Chroma1-HD"
    kohya_base_model_version = "chroma"  # the family's name (metadata only; no kohya reader depends on it)
    # ComfyUI's Chroma model is a Flux model (comfy/model_base.py ``Chroma(Flux)``): its LoRA keys
    # are Flux's ``lora_transformer_<diffusers name>`` map (comfy/lora.py), i.e. the kohya file.
    comfy_layout = "kohya"

    def _open_single_file(self, file: str) -> None:
        """A diffusers-layout transformer file loads as for every family; Chroma's original layout
        (chroma-unlocked-*.safetensors) is refused before any weight is read. Why: diffusers' own
        converter assumes the full 3072-wide model and this runner converts nothing it cannot check
        at the tiny size; a diffusers folder loads instead."""
        super()._open_single_file(file)
        if self.layout is not None:
            raise UserError(
                f"model.path '{file}' is in {self.layout.name}, which trainer=chroma does not read. Give "
                "model.path a diffusers folder (e.g. a download of lodestones/Chroma1-HD), or convert the file "
                "once with diffusers' ChromaTransformer2DModel.from_single_file(...).save_pretrained(<folder>, "
                "max_shard_size='100GB') and give model.path=<folder>/diffusion_pytorch_model.safetensors "
                "(a diffusers-layout transformer file)."
            )

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKL, ChromaTransformer2DModel
        from transformers import T5EncoderModel

        return {"transformer": ChromaTransformer2DModel, "vae": AutoencoderKL, "text_encoder": T5EncoderModel}

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return chroma_configs(self.size)

    def default_tokenizer(self, name: str) -> Any:
        return t5_tokenizer(FLUX_T5_MAX_LENGTH[self.size])

    def pipeline_class(self) -> type:
        return pipeline_class("ChromaPipeline")

    def inference_scheduler(self) -> Any:
        """Chroma1-HD's scheduler: FLUX.1's flow-matching Euler with the resolution-dependent shift
        (``ChromaPipeline`` computes ``mu`` with the same 256/4096 tokens and 0.5/1.15 shifts)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        )

    def sampling_family(self) -> Any:
        from runner.families.chroma.sampling import ChromaSampling

        return ChromaSampling()

    def t5_max_length(self) -> int:
        """T5 prompt length: the tokenizer's ``model_max_length``, capped at the pipeline's 512 (its
        limit); a real folder used with ``size=tiny`` still gets 512 (see ``FluxTrainer.t5_max_length``)."""
        tok = self.tokenizer("tokenizer")
        return int(min(tok.model_max_length, FLUX_T5_MAX_LENGTH["full"]))

    # -- protocol -------------------------------------------------------------------------
    def encode_parts(self) -> dict[str, EncodePart]:
        """VAE latents from pixels, and T5's output from captions (the only text encoder)."""
        return {"latents": EncodePart(("vae",), self.image_inputs()), "text": EncodePart(("text_encoder",), ("caption",))}

    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior, or T5's masked hidden states and Chroma's text mask (the caption's
        tokens plus the first padding token), as ``ChromaPipeline`` encodes a prompt."""
        if part == "latents":
            return self.encode_latents(models, batch)
        device = batch_device(batch)
        tokens = self.tokenizer("tokenizer")(list(batch["caption"]), padding="max_length",
                                             max_length=self.t5_max_length(), truncation=True, return_tensors="pt")
        mask = tokens.attention_mask.to(device)
        prompt_embeds = models["text_encoder"](tokens.input_ids.to(device), attention_mask=mask).last_hidden_state
        positions = torch.arange(mask.shape[1], device=device).unsqueeze(0)
        text_mask = positions <= mask.sum(dim=1, keepdim=True)
        return {"prompt_embeds": prompt_embeds, "prompt_attention_mask": text_mask}

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """2x2 latent patches as 64-wide tokens (``FluxPipeline._pack_latents``, which Chroma's is)."""
        return _pack_latents(latents)

    def dit_inputs(self, transformer: Any, noisy: torch.Tensor, batch: Batch,
                   dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """The packed latents, and the text mask extended by ones over the image tokens (``ChromaPipeline``'s)."""
        b, _, h, w = noisy.shape
        device = noisy.device
        packed = _pack_latents(noisy).to(dt)
        text_mask = batch["prompt_attention_mask"].to(device, dt)
        mask = torch.cat([text_mask, torch.ones(b, packed.shape[1], device=device, dtype=dt)], dim=1)
        return packed, _image_ids(h, w, device), {"attention_mask": mask}

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives at :meth:`planned_size`."""
        t5_cfg = self.component_config("text_encoder")
        b, length = batch_size, self.t5_max_length()
        return {
            "latents": self.example_latents(b, device),
            "prompt_embeds": self.example_tensor((b, length, int(t5_cfg["d_model"])), device, self.storage_dtype, 1),
            "prompt_attention_mask": torch.ones((b, length), dtype=torch.bool, device=device),
            "sample_seed": self.example_seeds(b, device),
        }
