"""Qwen-Image: train the 20 B MMDiT (fully or with LoRA) with the rectified-flow matching loss.

Conditioning as diffusers' ``QwenImagePipeline`` computes it: each caption is put into Qwen-Image's
prompt template (a system line asking to describe the image, then the caption as the user's
turn), encoded by Qwen2.5-VL's language model, and the template's leading tokens (the system
line, 34 tokens with the real tokenizer) are dropped; the last hidden state of what remains
(the caption and the template's closing tokens) is the text stream of the joint attention,
``encoder_hidden_states``, with a mask of its valid tokens.

Two choices differ from the pipeline in form, not in result:

* Each caption is encoded on its own (batch of one), so no padding ever enters the causal
  language model; the pipeline pads a batch and masks, which gives the valid tokens the same
  values (tests/runner/families/test_qwen_wan.py compares the two).
* The embeddings are zero-padded to a fixed ``trainer.max_sequence_length`` (the pipeline's
  default, 512) with the mask marking the padding, rather than to the longest caption of the
  batch: a cache entry then has one shape whatever batch it lands in, and the planner plans the
  length a run can reach. The transformer masks the padding out of every attention, so an image
  token's result does not depend on it; the cost is the padding's share of the text stream's
  compute and activations (a lower ``trainer.max_sequence_length`` trims it, truncating longer
  captions as the pipeline's ``max_sequence_length`` does).

Latents: the VAE is the causal-3D Wan-style ``AutoencoderKLQwenImage``; an image is one frame, so
the frame axis is dropped, and latents are normalised per channel with the VAE config's
``latents_mean``/``latents_std`` (what the pipeline undoes before decoding), then packed 2x2 into
64-wide tokens with the pipeline's own ``_pack_latents``.

Loss: the flow-matching family's (runner/families/common/flow.py); ``t`` logit-normal and unshifted by
default, as diffusers' ``train_dreambooth_lora_qwen_image.py`` trains (``loss.*`` changes it).
The timestep goes to the transformer as ``t`` in (0, 1), the pipeline's ``timestep / 1000``.
"""
from __future__ import annotations

from typing import Any

import torch

from runner.errors import UserError
from runner.families.common.base import with_latent_mask
from runner.families.common.flow import FlowMatchTrainer
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.common.tokenizers import qwen2_tokenizer
from runner.families.qwen_image import architecture as qwen_image_configs
from runner.families.qwen_image.config import QwenImageTrainerConfig
from runner.trainer import Batch, EncodePart, ModelSet, batch_device

# QwenImagePipeline.prompt_template_encode (diffusers 0.35+): the template the model was trained with.
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
MAX_PIPELINE_SEQUENCE_LENGTH = 1024  # QwenImagePipeline refuses longer






def text_model(text_encoder: Any) -> Any:
    """Qwen2.5-VL's language model (no vision tower, no LM head): what the prompt goes through.
    transformers >= 4.52 nests it as ``model.language_model``; earlier it is ``model``."""
    inner = text_encoder.model
    return getattr(inner, "language_model", inner)


class QwenImageTrainer(FlowMatchTrainer):
    """Qwen-Image MMDiT, rectified-flow matching loss."""

    Config = QwenImageTrainerConfig
    denoiser = "transformer"
    display_name = "Qwen-Image"
    kohya_lora = False  # no kohya layout for Qwen-Image: the diffusers file, and the ComfyUI one below
    comfy_layout = "qwen_image"  # ComfyUI's LoRA keys for the family: lora_comfy.safetensors (runner/export/comfy.py)
    family = "qwen_image"  # export.full_format=single_file writes the transformer in diffusers' names (ComfyUI's)

    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        length = cfg.trainer.get("max_sequence_length")
        # A real model folder gets the pipeline's 512 whatever model.size says.
        default = qwen_image_configs.QWEN_MAX_SEQUENCE_LENGTH["full" if self.source is not None else self.size]
        self.max_sequence_length = int(default if length is None else length)
        if not 1 <= self.max_sequence_length <= MAX_PIPELINE_SEQUENCE_LENGTH:
            raise UserError(f"trainer.max_sequence_length={length!r} is not valid: it must be a whole number from 1 to "
                            f"{MAX_PIPELINE_SEQUENCE_LENGTH} (QwenImagePipeline's limit), or null for {default}.")

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLForConditionalGeneration

        return {
            "transformer": QwenImageTransformer2DModel,
            "vae": AutoencoderKLQwenImage,
            "text_encoder": Qwen2_5_VLForConditionalGeneration,
        }

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return qwen_image_configs.qwen_image_configs(self.size)

    def default_tokenizer(self, name: str) -> Any:
        return qwen2_tokenizer(MAX_PIPELINE_SEQUENCE_LENGTH + 64)

    def pipeline_class(self) -> type:
        return pipeline_class("QwenImagePipeline")

    def inference_scheduler(self) -> Any:
        """Qwen/Qwen-Image's scheduler/scheduler_config.json: dynamic exponential shift up to 8192 tokens."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
            base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
        )

    def sampling_family(self) -> Any:
        from runner.families.qwen_image.sampling import QwenImageSampling

        return QwenImageSampling()

    def build_models(self, device: str | torch.device = "cpu") -> ModelSet:
        models = super().build_models(device)
        rope_tables_as_buffers(models["transformer"])
        return models

    # -- encoding --------------------------------------------------------------------------------
    def encode_parts(self) -> dict[str, EncodePart]:
        return {"latents": EncodePart(("vae",), self.image_inputs()), "text": EncodePart(("text_encoder",), ("caption",))}

    def template_tokens(self) -> int:
        """Tokens of the template before the caption, which the pipeline drops (34 for Qwen's own
        tokenizer: its ``prompt_template_encode_start_idx``); counted with this run's tokenizer."""
        prefix = PROMPT_TEMPLATE.split("{}")[0]
        return len(self.tokenizer("tokenizer")(prefix).input_ids)

    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior of the one-frame clip (frame axis dropped), or the caption's hidden
        states after the template prefix, zero-padded to ``max_sequence_length``, with their mask."""
        if part == "latents":
            vae = models["vae"]
            pixels = batch["pixel_values"].to(compute_dtype(vae)).unsqueeze(2)  # (B, 3, 1, H, W)
            dist = vae.encode(pixels).latent_dist
            return with_latent_mask({"latent_mean": dist.mean[:, :, 0].contiguous(),
                                     "latent_std": dist.std[:, :, 0].contiguous()}, batch)  # data.masks
        device = batch_device(batch)
        model = text_model(models["text_encoder"])
        tok = self.tokenizer("tokenizer")
        drop, length = self.template_tokens(), self.max_sequence_length
        rows, masks = [], []
        for caption in batch["caption"]:
            ids = tok(PROMPT_TEMPLATE.format(caption), max_length=length + drop, truncation=True,
                      return_tensors="pt").input_ids.to(device)
            hidden = model(input_ids=ids).last_hidden_state[0, drop:drop + length]
            n = int(hidden.shape[0])
            rows.append(torch.cat([hidden, hidden.new_zeros(length - n, hidden.shape[1])]))
            masks.append(torch.tensor([True] * n + [False] * (length - n)))
        return {"prompt_embeds": torch.stack(rows), "prompt_embeds_mask": torch.stack(masks).to(device)}

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``(z - latents_mean) / latents_std`` per channel (the VAE config's statistics)."""
        return normalize_per_channel(latents, self.vae_setting("latents_mean"), self.vae_setting("latents_std"))

    # -- the denoiser ----------------------------------------------------------------------------
    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """2x2 latent patches as 64-wide tokens (``QwenImagePipeline._pack_latents``)."""
        b, c, h, w = latents.shape
        return pipeline_class("QwenImagePipeline")._pack_latents(latents, b, c, h, w)

    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        transformer = models["transformer"]
        dt = compute_dtype(transformer)
        b, _, h, w = noisy.shape
        return transformer(
            hidden_states=self.pack(noisy).to(dt),
            timestep=timesteps.to(dt),  # t in (0, 1): the pipeline's timestep / 1000
            encoder_hidden_states=batch["prompt_embeds"].to(dt),
            encoder_hidden_states_mask=batch["prompt_embeds_mask"],
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]

    # -- shapes for the planner ------------------------------------------------------------------
    def text_hidden_size(self) -> int:
        cfg = self.component_config("text_encoder")
        text = cfg.get("text_config") if isinstance(cfg, dict) else None
        return int((text or cfg)["hidden_size"])

    def example_latents(self, batch_size: int, device: str | torch.device) -> torch.Tensor:
        side = self.resolution() // latent_factor(self.component_config("vae"))
        z = int(self.component_config("vae").get("z_dim", 16))
        return self.example_tensor((batch_size, z, side, side), device, torch.float32, 0)

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives at ``data.resolution``."""
        b, length = batch_size, self.max_sequence_length
        return {
            "latents": self.example_latents(b, device),
            "prompt_embeds": self.example_tensor((b, length, self.text_hidden_size()), device, self.storage_dtype, 1),
            "prompt_embeds_mask": torch.ones((b, length), dtype=torch.bool, device=device),
            "sample_seed": self.example_seeds(b, device),
        }


def rope_tables_as_buffers(transformer: Any) -> None:
    """Make the transformer's RoPE tables (``pos_embed.pos_freqs``/``neg_freqs``: complex64, 4096
    rows, 4 MiB at full size) non-persistent buffers, so that they move with the module.

    diffusers keeps them as plain attributes (a dtype cast of the model would drop a complex
    buffer's imaginary part) and copies them to the device on first use, keeping the copy in an
    lru cache: a run then holds them twice, unseen by placement, offload and the planner. As
    buffers they are placed, counted and moved like every other tensor of the model;
    ``cast_module`` never casts complex tensors, and the state dict does not change
    (non-persistent buffers are not saved)."""
    rope = getattr(transformer, "pos_embed", None)
    for name in ("pos_freqs", "neg_freqs"):
        t = getattr(rope, name, None)
        if isinstance(t, torch.Tensor) and name not in rope._buffers:
            delattr(rope, name)
            rope.register_buffer(name, t, persistent=False)


def latent_factor(vae_config: dict[str, Any]) -> int:
    """Pixels per latent of a Wan-style VAE: its ``scale_factor_spatial``, else one halving per
    ``temperal_downsample`` entry (the pipelines' ``vae_scale_factor``)."""
    return int(vae_config.get("scale_factor_spatial") or 2 ** len(vae_config["temperal_downsample"]))


def normalize_per_channel(latents: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    """``(z - mean) / std`` over axis 1 (channels) of 4-D or 5-D latents, in the latents' dtype."""
    shape = (1, len(mean)) + (1,) * (latents.dim() - 2)
    m = torch.tensor(mean, dtype=torch.float32).view(shape).to(latents.device, latents.dtype)
    s = torch.tensor(std, dtype=torch.float32).view(shape).to(latents.device, latents.dtype)
    return (latents - m) / s
