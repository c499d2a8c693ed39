"""HiDream-I1: train the 17 B sparse DiT (fully or with LoRA) with the rectified-flow loss.

Conditioning as diffusers' ``HiDreamImagePipeline.encode_prompt`` computes it, each prompt padded to
128 tokens: the pooled projections of the two CLIP towers concatenated (``pooled_prompt_embeds``), T5's
last hidden state (``prompt_embeds_t5``) and every Llama layer's output (``hidden_states[1:]``,
``prompt_embeds_llama3``; the transformer reads one per block). The Llama stack is kept batch first
(``[B, layers, L, D]``, so caching and batching split it per sample) and handed to the transformer
layer first, as the pipeline does. The transformer's timestep is ``t * 1000`` and its output the
negative velocity (the pipeline negates it); in train mode it returns its tokens unpatchified to
``[B, C, tokens, p*p]``, which ``predict`` lays back out as the latent image.
"""
from __future__ import annotations

from typing import Any

import torch

from runner.errors import UserError
from runner.families.common.flow import FlowMatchTrainer
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.common.tokenizers import clip_tokenizer, qwen2_tokenizer, t5_tokenizer
from runner.families.hidream.architecture import HIDREAM_MAX_SEQUENCE_LENGTH, hidream_configs
from runner.families.hidream.config import HiDreamTrainerConfig
from runner.trainer import Batch, EncodePart, ModelSet, batch_device

# HiDream-I1-Full's sampling scheduler is a flow UniPC with shift 3.0; samples use the flow-matching Euler
# scheduler at the same shift (HiDreamImagePipeline takes either). Used only when model.path has no scheduler/.
HIDREAM_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")


def unpatchify_training_output(out: torch.Tensor, height: int, width: int, patch: int) -> torch.Tensor:
    """``[B, C, tokens, p*p]`` (the train-mode output; tokens row-major, a non-square image's padded) -> ``[B, C, H, W]``."""
    if out.shape[-2:] == (height, width):
        return out  # inference layout (eval mode or force_inference_output)
    b, c = out.shape[:2]
    ph, pw = height // patch, width // patch
    out = out[:, :, : ph * pw].reshape(b, c, ph, pw, patch, patch)
    return out.permute(0, 1, 2, 4, 3, 5).reshape(b, c, height, width)


class HiDreamTrainer(FlowMatchTrainer):
    """HiDream-I1 sparse DiT, rectified-flow matching loss."""

    Config = HiDreamTrainerConfig
    denoiser = "transformer"
    display_name = "HiDream-I1"
    reference_repo = "HiDream-ai/HiDream-I1-Full"
    default_timestep_shift = "fixed"  # shift 3.0 (loss.shift), the published scheduler's
    kohya_lora = False  # diffusers reads no kohya-layout HiDream LoRA back: the diffusers file and ComfyUI's
    # HiDream's attention has a plain to_out (no .0) and the text stream's own projections
    lora_default_targets = ("to_q", "to_k", "to_v", "to_out", "to_q_t", "to_k_t", "to_v_t", "to_out_t")
    comfy_layout = "hidream"  # diffusion_model.<diffusers name>: ComfyUI's HiDream modules carry diffusers' names
    family = "hidream"

    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        side = 8 * int(self.size_configs()["transformer"]["max_resolution"][0])  # VAE factor 8
        data = cfg.get("data") if hasattr(cfg, "get") else None
        if data is not None and bool(data.get("buckets", False)) and self.resolution() > side:
            raise UserError(
                f"data.resolution={self.resolution()} with data.buckets=true is not usable for HiDream-I1: the "
                f"transformer pads a non-square image to its max_resolution's {side}x{side} px of tokens and has no "
                f"room for more. Use data.resolution<={side} with buckets, or data.buckets=false (square crops).")

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKL, HiDreamImageTransformer2DModel
        from transformers import CLIPTextModelWithProjection, LlamaForCausalLM, T5EncoderModel

        return {"transformer": HiDreamImageTransformer2DModel, "vae": AutoencoderKL,
                "text_encoder": CLIPTextModelWithProjection, "text_encoder_2": CLIPTextModelWithProjection,
                "text_encoder_3": T5EncoderModel, "text_encoder_4": LlamaForCausalLM}

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return hidream_configs(self.size)

    def default_tokenizer(self, name: str) -> Any:
        if name == "tokenizer_3":
            return t5_tokenizer(512)
        if name == "tokenizer_4":  # Llama-3.1's tokenizer stand-in: byte level, its eos as the pad (as the pipeline sets)
            return qwen2_tokenizer(1024)
        return clip_tokenizer(HIDREAM_MAX_SEQUENCE_LENGTH)

    def pipeline_class(self) -> type:
        return pipeline_class("HiDreamImagePipeline")

    def inference_scheduler(self) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(**HIDREAM_SCHEDULER)

    def sampling_family(self) -> Any:
        from runner.families.hidream.sampling import HiDreamSampling

        return HiDreamSampling()

    def build_models(self, device: str | torch.device = "cpu") -> ModelSet:
        """The base's, with the experts' planner-safe forward (runner/families/hidream/experts.py)."""
        from runner.families.hidream.experts import plan_experts

        models = super().build_models(device)
        plan_experts(models["transformer"])
        return models

    def repeated_blocks(self, models: ModelSet) -> dict[str, list[torch.nn.Module]]:
        """The 16 double- and 32 single-stream blocks; not the 49 caption projections (one Linear each),
        which the generic finder would also take for repeated blocks."""
        t = models["transformer"]
        return {self.denoiser: [*t.double_stream_blocks, *t.single_stream_blocks]}

    # -- encoding --------------------------------------------------------------------------------
    def encode_parts(self) -> dict[str, EncodePart]:
        return {"latents": EncodePart(("vae",), self.image_inputs()), "text": EncodePart(TEXT_ENCODERS, ("caption",))}

    def _tokens(self, name: str, captions: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        tok = self.tokenizer(name)
        length = min(HIDREAM_MAX_SEQUENCE_LENGTH, int(tok.model_max_length))
        out = tok(captions, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        return out.input_ids.to(device), out.attention_mask.to(device)

    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior, or ``HiDreamImagePipeline.encode_prompt``'s three embeddings (module docstring)."""
        if part == "latents":
            return self.encode_latents(models, batch)
        device = batch_device(batch)
        captions = list(batch["caption"])
        pooled = [models[enc](self._tokens(tok, captions, device)[0], output_hidden_states=True)[0]
                  for enc, tok in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"))]
        ids, mask = self._tokens("tokenizer_3", captions, device)
        t5 = models["text_encoder_3"](ids, attention_mask=mask)[0]
        tok4 = self.tokenizer("tokenizer_4")
        if tok4.pad_token is None:
            tok4.pad_token = tok4.eos_token  # HiDreamImagePipeline.__init__ does the same
        ids, mask = self._tokens("tokenizer_4", captions, device)
        llama = models["text_encoder_4"](ids, attention_mask=mask, output_hidden_states=True).hidden_states[1:]
        return {"pooled_prompt_embeds": torch.cat([pooled[0], pooled[1].to(pooled[0].dtype)], dim=-1),
                "prompt_embeds_t5": t5, "prompt_embeds_llama3": torch.stack(llama, dim=1)}

    # -- the denoiser ----------------------------------------------------------------------------
    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The velocity (``noise - x0``): the transformer's output negated, called as the pipeline calls it."""
        transformer = models["transformer"]
        dt = compute_dtype(transformer)
        out = transformer(
            hidden_states=noisy.to(dt),
            timesteps=timesteps.float() * 1000,  # the scheduler's scale (the pipeline passes its timesteps)
            encoder_hidden_states_t5=batch["prompt_embeds_t5"].to(dt),
            encoder_hidden_states_llama3=batch["prompt_embeds_llama3"].to(dt).transpose(0, 1),
            pooled_embeds=batch["pooled_prompt_embeds"].to(dt),
            return_dict=False,
        )[0]
        patch = int(transformer.config.patch_size)
        return -unpatchify_training_output(out, noisy.shape[-2], noisy.shape[-1], patch)

    # -- shapes for the planner ------------------------------------------------------------------
    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives at ``data.resolution`` (every prompt 128 tokens)."""
        b, length, dt = batch_size, HIDREAM_MAX_SEQUENCE_LENGTH, self.storage_dtype
        clip1, clip2 = self.component_config("text_encoder"), self.component_config("text_encoder_2")
        t5, llama = self.component_config("text_encoder_3"), self.component_config("text_encoder_4")
        pooled = int(clip1["projection_dim"]) + int(clip2["projection_dim"])
        layers, width = int(llama["num_hidden_layers"]), int(llama["hidden_size"])
        return {
            "latents": self.example_latents(b, device),
            "pooled_prompt_embeds": self.example_tensor((b, pooled), device, dt, 1),
            "prompt_embeds_t5": self.example_tensor((b, length, int(t5["d_model"])), device, dt, 2),
            "prompt_embeds_llama3": self.example_tensor((b, layers, length, width), device, dt, 3),
            "sample_seed": self.example_seeds(b, device),
        }
