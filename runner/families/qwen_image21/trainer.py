"""Qwen-Image 2.1: train the 7 B single-stream block-causal DiT (fully or with LoRA) with the rectified-flow loss.

Conditioning as diffusers' ``QwenImage21Pipeline`` computes it for text-to-image: each caption (an empty
one as ``" "``) goes into the pipeline's template (a system line, then the caption as the user's turn),
through Qwen3-VL's language model, and the hidden state of the last decoder layer **before** the final
RMSNorm (the pipeline neutralises the norm with a forward hook; so does this trainer) is kept after the
system line's tokens. Each caption is encoded on its own (no padding enters the causal model), then
zero-padded to ``trainer.max_sequence_length`` with a mask, so a cache entry has one shape.

The transformer places the image tokens after the text in one sequence, and their RoPE frame position is
the text's length, padding included. So ``predict`` cuts the padding: it calls the transformer once per
group of samples with the same caption length (one host read of the counts per step, whatever the
model's size), so that every sample is exactly the pipeline's unpadded single prompt and a sample's loss
does not depend on its batch (gradient accumulation and OOM splits stay exact).

Latents: ``AutoencoderKLQwenImage21`` takes RGBA; a training image is opaque, so its alpha channel is +1
(the pipeline's RGBA conversion and [-1, 1] scaling). One frame, 64 channels at 16x, normalised per
channel with the VAE's ``latents_mean``/``latents_std``, and flattened unpatched into tokens
(``QwenImage21Pipeline._pack_latents``); the transformer groups 2x2 tokens per text-encoder image slot,
so the latent sides are even (``data.resolution`` a multiple of 32).

Loss: the flow-matching family's (runner/families/common/flow.py), ``t`` logit-normal and unshifted by
default; the transformer takes ``t`` in (0, 1) (the pipeline's ``timestep / 1000``) and predicts the
velocity ``noise - x0`` (the Euler scheduler's convention), the base's target as it is.
"""
from __future__ import annotations

import copy
import os
from typing import Any

import torch

from runner.errors import UserError
from runner.families.common.base import with_latent_mask
from runner.families.common.flow import FlowMatchTrainer
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.common.tokenizers import load_folder_tokenizer, qwen2_vl_tokenizer
from runner.families.qwen_image.trainer import latent_factor, normalize_per_channel
from runner.families.qwen_image.architecture import TINY_QWEN_VOCAB
from runner.families.qwen_image21 import architecture as qwen21_configs
from runner.families.qwen_image21.config import QwenImage21TrainerConfig
from runner.trainer import Batch, EncodePart, ModelSet, batch_device

# QwenImage21Pipeline.sys_prompt and prompt_template_t2i (diffusers 0.42.1).
SYSTEM_LINE = "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"
PROMPT_TEMPLATE = SYSTEM_LINE + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
MAX_SEQUENCE_LENGTH = 4096  # a bound for the option: the RoPE tables hold 8192 text-and-image positions
# A chat template rendering messages as Qwen3-VL's does for text parts: what the pipeline's processor needs to
# count the system line's tokens (apply_chat_template) when the tokenizer is the offline one.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def text_model(text_encoder: Any) -> Any:
    """Qwen3-VL's language model (no vision tower, no LM head)."""
    inner = text_encoder.model
    return getattr(inner, "language_model", inner)


class QwenImage21Trainer(FlowMatchTrainer):
    """Qwen-Image 2.1 single-stream DiT, rectified-flow matching loss."""

    Config = QwenImage21TrainerConfig
    denoiser = "transformer"
    display_name = "Qwen-Image 2.1"
    reference_repo = "Qwen/Qwen-Image-2.1"
    resolution_multiple = 32  # VAE factor 16 times the 2x2 token groups of an image slot
    kohya_lora = False  # no kohya layout: the diffusers file, and the ComfyUI one (runner/export/comfy.py)
    comfy_layout = "qwen_image21"  # diffusion_model.<diffusers name>, gate_layer + proj fused (runner/export/comfy.py)
    family = "qwen_image21"

    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        length = cfg.trainer.get("max_sequence_length")
        # The tiny byte-level vocabulary (a random tiny build, or a folder saved from one) gets the tiny default.
        vocab = int(self.component_config("text_encoder")["text_config"]["vocab_size"])
        default = qwen21_configs.QWEN21_MAX_SEQUENCE_LENGTH["tiny" if vocab <= TINY_QWEN_VOCAB else "full"]
        self.max_sequence_length = int(default if length is None else length)
        if not 1 <= self.max_sequence_length <= MAX_SEQUENCE_LENGTH:
            raise UserError(f"trainer.max_sequence_length={length!r} is not valid: it must be a whole number from 1 to "
                            f"{MAX_SEQUENCE_LENGTH}, or null for {default}.")

    def resolution_reason(self) -> str:
        return "VAE factor 16 times the 2x2 token groups"

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
        from transformers import Qwen3VLForConditionalGeneration

        return {"transformer": QwenImage21Transformer2DModel, "vae": AutoencoderKLQwenImage21,
                "text_encoder": Qwen3VLForConditionalGeneration}

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return qwen21_configs.qwen_image21_configs(self.size)

    def default_tokenizer(self, name: str) -> Any:
        return qwen2_vl_tokenizer(MAX_SEQUENCE_LENGTH + 64)

    def tokenizer(self, name: str) -> Any:
        """The folder's ``processor/`` tokenizer (where Qwen-Image 2.1 keeps it), else the base's lookup."""
        if name == "tokenizer" and self._folder_has("processor") and not self._folder_has("tokenizer"):
            self._tokenizers = self._tokenizers or {}
            if name not in self._tokenizers:
                self._tokenizers[name] = load_folder_tokenizer(self.source[1], "processor")
            return self._tokenizers[name]
        return super().tokenizer(name)

    def pipeline_class(self) -> type:
        return pipeline_class("QwenImage21Pipeline")

    def inference_scheduler(self) -> Any:
        """Dynamic shift by token count with ``calculate_shift``'s defaults (the pipeline reads them from the
        scheduler config; no published scheduler_config.json was read here)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                               base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                               max_image_seq_len=4096)

    def vl_processor(self) -> Any:
        """The pipeline's ``processor``: the folder's, else a Qwen3-VL processor around a copy of this run's
        tokenizer (with a chat template for the system line) and no video processor."""
        from transformers import Qwen3VLProcessor

        if self._folder_has("processor"):
            return Qwen3VLProcessor.from_pretrained(os.path.join(self.source[1], "processor"), local_files_only=True)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
            def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
                return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

        tok = copy.deepcopy(self.tokenizer("tokenizer"))
        tok.chat_template = tok.chat_template or CHAT_TEMPLATE
        return ImageOnlyQwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil(patch_size=16), tokenizer=tok,
                                         chat_template=tok.chat_template)

    def pipeline(self, models: ModelSet) -> Any:
        """``QwenImage21Pipeline`` around the modules in memory, with :meth:`vl_processor`."""
        parts = {name: models[name] for name in self.module_classes()}
        pipe = self.pipeline_class()(**parts, processor=self.vl_processor(), scheduler=self.inference_scheduler())
        pipe.register_to_config(processor=("transformers", "Qwen3VLProcessor"))
        return pipe

    def sampling_family(self) -> Any:
        from runner.families.qwen_image21.sampling import QwenImage21Sampling

        return QwenImage21Sampling()

    # -- encoding --------------------------------------------------------------------------------
    def encode_parts(self) -> dict[str, EncodePart]:
        return {"latents": EncodePart(("vae",), self.image_inputs()), "text": EncodePart(("text_encoder",), ("caption",))}

    def system_tokens(self) -> int:
        """Tokens of the system line, which the pipeline drops (its ``_drop_idx``), with this run's tokenizer."""
        return len(self.tokenizer("tokenizer")(SYSTEM_LINE).input_ids)

    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior of the opaque RGBA frame (frame axis dropped), or each caption's pre-norm last
        hidden states after the system line, zero-padded to ``max_sequence_length``, with their mask."""
        if part == "latents":
            vae = models["vae"]
            rgb = batch["pixel_values"].to(compute_dtype(vae))
            rgba = torch.cat([rgb, torch.ones_like(rgb[:, :1])], dim=1).unsqueeze(2)  # (B, 4, 1, H, W)
            dist = vae.encode(rgba).latent_dist
            return with_latent_mask({"latent_mean": dist.mean[:, :, 0].contiguous(),
                                     "latent_std": dist.std[:, :, 0].contiguous()}, batch)  # data.masks
        device = batch_device(batch)
        encoder, tok = models["text_encoder"], self.tokenizer("tokenizer")
        drop, length = self.system_tokens(), self.max_sequence_length
        handle = text_model(encoder).norm.register_forward_hook(lambda module, args, output: args[0])
        rows, masks = [], []
        try:
            for caption in batch["caption"]:
                ids = tok(PROMPT_TEMPLATE.format(caption or " "), return_tensors="pt").input_ids.to(device)
                out = encoder.model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
                hidden = out.hidden_states[-1][0, drop:drop + length]
                n = int(hidden.shape[0])
                rows.append(torch.cat([hidden, hidden.new_zeros(length - n, hidden.shape[1])]))
                masks.append(torch.tensor([True] * n + [False] * (length - n)))
        finally:
            handle.remove()
        return {"prompt_embeds": torch.stack(rows), "prompt_embeds_mask": torch.stack(masks).to(device)}

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``(z - latents_mean) / latents_std`` per channel (the VAE config's statistics)."""
        return normalize_per_channel(latents, self.vae_setting("latents_mean"), self.vae_setting("latents_std"))

    # -- the denoiser ----------------------------------------------------------------------------
    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """One token per latent pixel (``QwenImage21Pipeline._pack_latents``: a spatial flatten)."""
        b, c, h, w = latents.shape
        return pipeline_class("QwenImage21Pipeline")._pack_latents(latents, b, c, h, w)

    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The transformer on each group of samples whose captions have the same token count, the padding cut
        (the image's RoPE positions follow the text's length): each sample is the pipeline's unpadded single
        prompt, and a sample's result does not depend on its batch. One host read of the counts per step."""
        counts = batch["prompt_embeds_mask"].sum(dim=1).tolist()
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(counts):
            groups.setdefault(int(n), []).append(i)
        if len(groups) == 1:
            return self.predict_group(models, noisy, timesteps, batch["prompt_embeds"][:, :int(counts[0])])
        order, outs = [], []
        for n, rows in groups.items():
            idx = torch.tensor(rows, device=noisy.device)
            order += rows
            outs.append(self.predict_group(models, noisy[idx], timesteps[idx], batch["prompt_embeds"][idx, :n]))
        back = torch.tensor(sorted(range(len(order)), key=order.__getitem__), device=noisy.device)
        return torch.cat(outs)[back]

    def predict_group(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor,
                      embeds: torch.Tensor) -> torch.Tensor:
        """One transformer call on samples with unpadded text of one length (no mask, as the pipeline's)."""
        transformer = models["transformer"]
        dt = compute_dtype(transformer)
        b, _, h, w = noisy.shape
        # Text positions, then one image slot per 2x2 target tokens (the pipeline's append_target_slots), made on
        # the host: a few bytes whose values the transformer reads.
        slots = torch.cat([torch.zeros(b, embeds.shape[1], dtype=torch.bool), torch.ones(b, h * w // 4, dtype=torch.bool)],
                          dim=1).to(noisy.device)
        out = transformer(
            hidden_states=self.pack(noisy).to(dt),
            timestep=timesteps.to(dt),  # t in (0, 1): the pipeline's timestep / 1000
            encoder_hidden_states=embeds.to(dt),
            img_shapes=[[(1, h, w)]] * b,
            img_mask=slots,
            return_dict=False,
        )[0]
        return out[:, -h * w:]  # the target's tokens (the pipeline's noise_pred[:, -latents.size(1):])

    # -- shapes for the planner ------------------------------------------------------------------
    def text_hidden_size(self) -> int:
        return int(self.component_config("text_encoder")["text_config"]["hidden_size"])

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives at ``data.resolution``."""
        b, length = batch_size, self.max_sequence_length
        vae = self.component_config("vae")
        side = self.resolution() // latent_factor(vae)
        return {
            "latents": self.example_tensor((b, int(vae.get("z_dim", 64)), side, side), device, torch.float32, 0),
            "prompt_embeds": self.example_tensor((b, length, self.text_hidden_size()), device, self.storage_dtype, 1),
            "prompt_embeds_mask": torch.ones((b, length), dtype=torch.bool, device=device),
            "sample_seed": self.example_seeds(b, device),
        }
