"""Krea 2: train the single-stream MMDiT (fully or with LoRA) with the rectified-flow matching loss.

Conditioning as diffusers' ``Krea2Pipeline.get_text_hidden_states`` computes it: the caption after Qwen-Image's
system prefix, truncated and padded to a fixed length, then the assistant suffix *after* the padding; Qwen3-VL
runs with positions that count only real tokens (the padding takes none), and the hidden states of 12 layers
(``SELECT_LAYERS``) are stacked per token; the system prefix's tokens are dropped. Every caption has the same
length (``trainer.max_sequence_length``), so the batch is encoded as the pipeline encodes it, and the mask goes
to the transformer as the pipeline passes it (text positions are all zero in its RoPE: padding moves nothing).

Latents: Qwen-Image's VAE (one frame, 16 channels, normalised per channel with ``latents_mean``/``latents_std``),
packed 2x2 into 64-wide tokens with the pipeline's own ``_pack_latents``; image positions from its
``prepare_position_ids``.

Loss: the flow-matching family's (runner/families/common/flow.py), ``t`` logit-normal and unshifted by default;
the transformer takes ``t`` in [0, 1] (the pipeline's ``timestep / 1000``) and predicts the velocity ``noise - x0``
(the Euler scheduler's convention).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from runner.errors import UserError
from runner.families.common.flow import FlowMatchTrainer
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.common.tokenizers import qwen2_vl_tokenizer
from runner.families.krea2 import architecture as krea2_configs
from runner.families.krea2.config import Krea2TrainerConfig
from runner.families.qwen_image.architecture import TINY_QWEN_VOCAB
from runner.families.qwen_image.trainer import QwenImageTrainer
from runner.trainer import Batch, EncodePart, ModelSet, batch_device

# Krea2Pipeline.prompt_template_encode_prefix / _suffix (diffusers 0.42.1).
PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
          "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
MAX_SEQUENCE_LENGTH = 2048  # a bound for the option


class Krea2Trainer(QwenImageTrainer):
    """Krea 2 single-stream MMDiT, rectified-flow matching loss (Qwen-Image's VAE and latent handling)."""

    Config = Krea2TrainerConfig
    display_name = "Krea 2"
    reference_repo = "krea/Krea-2"
    comfy_layout = "krea2"  # diffusion_model.<original krea-2 name>, scale in B (runner/export/comfy.py)
    family = "krea2"

    def __init__(self, cfg: Any, run: Any = None) -> None:
        FlowMatchTrainer.__init__(self, cfg, run)
        length = cfg.trainer.get("max_sequence_length")
        text = self.component_config("text_encoder")["text_config"]
        self.table = "tiny" if int(text["vocab_size"]) <= TINY_QWEN_VOCAB else "full"
        default = krea2_configs.KREA2_MAX_SEQUENCE_LENGTH[self.table]
        self.max_sequence_length = int(default if length is None else length)
        if not 1 <= self.max_sequence_length <= MAX_SEQUENCE_LENGTH:
            raise UserError(f"trainer.max_sequence_length={length!r} is not valid: it must be a whole number from 1 to "
                            f"{MAX_SEQUENCE_LENGTH}, or null for {default}.")
        self.select_layers = krea2_configs.SELECT_LAYERS[self.table]

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKLQwenImage, Krea2Transformer2DModel
        from transformers import Qwen3VLModel

        return {"transformer": Krea2Transformer2DModel, "vae": AutoencoderKLQwenImage, "text_encoder": Qwen3VLModel}

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return krea2_configs.krea2_configs(self.size)

    def default_tokenizer(self, name: str) -> Any:
        return qwen2_vl_tokenizer(MAX_SEQUENCE_LENGTH + 256)

    def pipeline_class(self) -> type:
        return pipeline_class("Krea2Pipeline")

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {"text_encoder_select_layers": self.select_layers}

    def pipeline(self, models: ModelSet) -> Any:
        """``Krea2Pipeline`` with this run's prefix and suffix token counts (its fixed 34 and 5 are Qwen's
        tokenizer's; the tiny byte-level one spells more)."""
        pipe = super().pipeline(models)
        pipe.prompt_template_encode_start_idx, pipe.prompt_template_encode_num_suffix_tokens = self.template_counts()
        return pipe

    def inference_scheduler(self) -> Any:
        """The resolution-aware exponential shift ``Krea2Pipeline`` documents for its scheduler config."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                               base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                               max_image_seq_len=6400, time_shift_type="exponential")

    def sampling_family(self) -> Any:
        from runner.families.krea2.sampling import Krea2Sampling

        return Krea2Sampling()

    def build_models(self, device: str | torch.device = "cpu") -> ModelSet:
        return FlowMatchTrainer.build_models(self, device)

    # -- encoding --------------------------------------------------------------------------------
    def template_counts(self) -> tuple[int, int]:
        """Tokens of the system prefix (dropped) and of the suffix, with this run's tokenizer."""
        tok = self.tokenizer("tokenizer")
        return len(tok(PREFIX).input_ids), len(tok(SUFFIX).input_ids)

    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior (Qwen-Image's), or the captions' tapped hidden states in the fixed layout with their mask."""
        if part == "latents":
            return super().encode_part(models, part, batch)
        device = batch_device(batch)
        tok = self.tokenizer("tokenizer")
        prefix, suffix = self.template_counts()
        text = tok([PREFIX + c for c in batch["caption"]], truncation=True, padding="max_length",
                   max_length=self.max_sequence_length + prefix - suffix, return_tensors="pt").to(device)
        tail = tok([SUFFIX] * len(batch["caption"]), return_tensors="pt").to(device)
        ids = torch.cat([text.input_ids, tail.input_ids], dim=1)
        mask = torch.cat([text.attention_mask, tail.attention_mask], dim=1).bool()
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0).unsqueeze(0).expand(3, -1, -1)
        out = models["text_encoder"](input_ids=ids, attention_mask=mask, position_ids=positions,
                                     output_hidden_states=True)
        hidden = torch.stack([out.hidden_states[i] for i in self.select_layers], dim=2)
        return {"prompt_embeds": hidden[:, prefix:], "prompt_embeds_mask": mask[:, prefix:]}

    # -- the denoiser ----------------------------------------------------------------------------
    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """2x2 latent patches as 64-wide tokens (``Krea2Pipeline._pack_latents``)."""
        b, c, h, w = latents.shape
        return pipeline_class("Krea2Pipeline")._pack_latents(SimpleNamespace(patch_size=2), latents, b, c, h, w)

    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        transformer = models["transformer"]
        dt = compute_dtype(transformer)
        _, _, h, w = noisy.shape
        embeds = batch["prompt_embeds"]
        ids = pipeline_class("Krea2Pipeline").prepare_position_ids(embeds.shape[1], h // 2, w // 2, noisy.device)
        return transformer(
            hidden_states=self.pack(noisy).to(dt),
            encoder_hidden_states=embeds.to(dt),
            timestep=timesteps.to(dt),  # t in [0, 1]: the pipeline's timestep / 1000
            position_ids=ids,
            encoder_attention_mask=batch["prompt_embeds_mask"],
            return_dict=False,
        )[0]

    # -- shapes for the planner ------------------------------------------------------------------
    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives at ``data.resolution``."""
        b, length = batch_size, self.max_sequence_length
        width = self.text_hidden_size()
        return {
            "latents": self.example_latents(b, device),
            "prompt_embeds": self.example_tensor((b, length, len(self.select_layers), width), device,
                                                 self.storage_dtype, 1),
            "prompt_embeds_mask": torch.ones((b, length), dtype=torch.bool, device=device),
            "sample_seed": self.example_seeds(b, device),
        }
