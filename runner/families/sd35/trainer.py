"""SD3.5 Medium and Large: train the MMDiT transformer (fully or with LoRA) with the flow-matching loss.

Modules as in stabilityai/stable-diffusion-3.5-{medium,large} (``trainer.variant``):
``SD3Transformer2DModel`` (Large: 38 blocks, 8.1 B params; Medium: 24 blocks of which 0-12 have a
second, image-only attention, 2.2 B), the 16-channel VAE, and three text encoders: CLIP ViT-L and
OpenCLIP bigG (``CLIPTextModelWithProjection`` each) and T5-XXL (``T5EncoderModel``).

Conditioning as ``StableDiffusion3Pipeline.encode_prompt`` computes it: the penultimate hidden
states of both CLIPs, concatenated (768 + 1280 wide), zero-padded to T5's width (4096) and put in
front of T5's last hidden state (77 + 256 tokens); the two CLIPs' projected pooled outputs,
concatenated (2048), as ``pooled_projections``. Latents are ``(z - shift_factor) * scaling_factor``
(0.0609, 1.5305); the transformer patchifies them itself (2x2).

Loss: the flow-matching family's (runner/families/common/flow.py), with SD3's training defaults from
diffusers' ``train_dreambooth_sd3.py``: logit-normal t, shifted with the scheduler's fixed shift 3.0
(``loss.timestep_shift=fixed``, ``loss.shift=3.0``), velocity target ``noise - x0``. The
transformer takes ``1000 t`` (the scheduler's timesteps), in float32.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from runner.errors import UserError, valid_list
from runner.families.common.flow import FlowMatchTrainer
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.common.model_configs import CLIP_MAX_LENGTH
from runner.families.common.tokenizers import clip_tokenizer, t5_tokenizer, tokenize
from runner.families.sd35.architecture import SD3_T5_MAX_LENGTH, sd35_configs
from runner.families.sd35.config import SD35TrainerConfig
from runner.trainer import Batch, EncodePart, ModelSet, batch_device

VARIANTS = ("large", "medium")
# The model cards' guidance scales for sampling (classifier-free guidance).
GUIDANCE = {"large": 3.5, "medium": 4.5}
SCHEDULER_SHIFT = 3.0  # scheduler/scheduler_config.json of both: FlowMatchEulerDiscreteScheduler, shift 3.0




class SD35Trainer(FlowMatchTrainer):
    """SD3.5 Medium / Large MMDiT transformer, rectified-flow matching loss."""

    Config = SD35TrainerConfig
    denoiser = "transformer"
    display_name = "SD3.5"
    default_timestep_shift = "fixed"  # SD3's shift 3.0 (loss.shift), as its scheduler and diffusers' scripts
    # diffusers (0.42) reads no kohya-layout SD3 LoRA back (SD3LoraLoaderMixin has no converter), so
    # export.lora_format=kohya is refused; the same layout is written as the ComfyUI file instead.
    kohya_lora = False
    kohya_base_model_version = "sd3"
    comfy_layout = "sd3"  # ComfyUI's LoRA keys for the family: lora_comfy.safetensors (runner/export/comfy.py)
    family = "sd3"  # model.path reads (and export.full_format=single_file writes) the transformer in Stability's layout

    def __init__(self, cfg: Any, run: Any = None) -> None:
        self.variant = str(cfg.trainer.get("variant", "large"))
        if self.variant not in VARIANTS:
            raise UserError(f"Unknown trainer.variant '{self.variant}' for trainer=sd35. "
                            f"Valid values: {valid_list(self.variant, VARIANTS)}.")
        super().__init__(cfg, run)

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKL, SD3Transformer2DModel
        from transformers import CLIPTextModelWithProjection, T5EncoderModel

        return {
            "transformer": SD3Transformer2DModel,
            "vae": AutoencoderKL,
            "text_encoder": CLIPTextModelWithProjection,
            "text_encoder_2": CLIPTextModelWithProjection,
            "text_encoder_3": T5EncoderModel,
        }

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return sd35_configs(self.variant, self.size)

    def default_tokenizer(self, name: str) -> Any:
        if name == "tokenizer_3":
            return t5_tokenizer(SD3_T5_MAX_LENGTH[self.size])
        return clip_tokenizer(CLIP_MAX_LENGTH)

    def encode_parts(self) -> dict[str, EncodePart]:
        """Three text encoders (the base's default has two)."""
        return {
            "latents": EncodePart(("vae",), self.image_inputs()),
            "text": EncodePart(("text_encoder", "text_encoder_2", "text_encoder_3"), ("caption",)),
        }

    def pipeline_class(self) -> type:
        return pipeline_class("StableDiffusion3Pipeline")

    def inference_scheduler(self) -> Any:
        """The published scheduler/scheduler_config.json: FlowMatchEulerDiscreteScheduler, shift 3.0."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SCHEDULER_SHIFT)

    def sampling_family(self) -> Any:
        from runner.families.sd35.sampling import SD3Sampling

        return SD3Sampling(default_guidance=GUIDANCE[self.variant])

    def t5_max_length(self) -> int:
        """T5 prompt length: the tokenizer's, capped at the pipeline's default 256 (see FluxTrainer)."""
        tok = self.tokenizer("tokenizer_3")
        return int(min(tok.model_max_length, SD3_T5_MAX_LENGTH["full"]))

    # -- protocol -------------------------------------------------------------------------
    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior (mean, std), or the joint CLIP + T5 prompt embeddings and pooled CLIP output."""
        if part == "latents":
            return self.encode_latents(models, batch)
        device = batch_device(batch)
        captions = list(batch["caption"])
        clip_states, pooled = [], []
        for enc, tok in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
            te, tk = models[enc], self.tokenizer(tok)
            out = te(tokenize(tk, captions, self.text_max_length(tk, te.config), device), output_hidden_states=True)
            clip_states.append(out.hidden_states[-2])
            pooled.append(out.text_embeds)
        dtype = clip_states[0].dtype
        clip = torch.cat([clip_states[0], clip_states[1].to(dtype)], dim=-1)
        t5 = models["text_encoder_3"](tokenize(self.tokenizer("tokenizer_3"), captions, self.t5_max_length(), device))[0]
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        prompt_embeds = torch.cat([clip, t5.to(dtype)], dim=-2)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": torch.cat([pooled[0], pooled[1].to(dtype)], dim=-1)}

    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        transformer = models["transformer"]
        dt = compute_dtype(transformer)
        return transformer(
            hidden_states=noisy.to(dt),
            encoder_hidden_states=batch["prompt_embeds"].to(dt),
            pooled_projections=batch["pooled_prompt_embeds"].to(dt),
            timestep=timesteps * 1000,  # the scheduler's scale, kept in float32 (bf16 would round it by up to 4)
            return_dict=False,
        )[0]

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives at ``data.resolution``."""
        clip1, clip2 = self.component_config("text_encoder"), self.component_config("text_encoder_2")
        t5 = self.component_config("text_encoder_3")
        clip_len = min(CLIP_MAX_LENGTH, int(clip1["max_position_embeddings"]))
        b, dt = batch_size, self.storage_dtype
        pooled = int(clip1["projection_dim"]) + int(clip2["projection_dim"])
        return {
            "latents": self.example_latents(b, device),
            "prompt_embeds": self.example_tensor((b, clip_len + self.t5_max_length(), int(t5["d_model"])), device, dt, 1),
            "pooled_prompt_embeds": self.example_tensor((b, pooled), device, dt, 2),
            "sample_seed": self.example_seeds(b, device),
        }
