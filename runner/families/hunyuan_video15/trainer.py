"""HunyuanVideo 1.5 text-to-video: train the dual-stream transformer (fully or with LoRA) with rectified flow.

Data are clips (runner/data/video.py): ``data.frames`` frames at ``data.fps`` and ``data.width`` x ``data.height``.
The VAE compresses 4x in time after the first frame (``data.frames`` is ``4k + 1``: 1, 5, ... 61, ... 121) and
16x in space; the transformer's patches are 1x1, so a frame side is a multiple of 16 pixels.

Conditioning as ``HunyuanVideo15Pipeline.encode_prompt`` computes it (its ``format_text_input`` and
``extract_glyph_texts`` run here; the encoder calls are its helpers', the masks passed as booleans):

* Qwen2.5-VL: the caption in the pipeline's system/user chat template, padded to the template's tokens plus
  ``trainer.max_sequence_length`` (the pipeline's 1000), the third-last hidden state, the template's tokens
  dropped (the pipeline's 108 with the real tokenizer; counted for the tiny byte-level one), with its mask;
* ByT5: the quoted text of the caption (``"..."``: glyphs to render) as ``Text "..."``, padded to 256 bytes,
  the encoder's last state with its mask; a caption without quotes gives zeros and an all-false mask.

Latents: the VAE posterior sampled per sample seed, times ``scaling_factor`` (the pipeline divides by it before
decoding). The transformer's input is the pipeline's text-to-video one: the noisy latents, zero condition latents
and a zero mask channel (65 channels), a zero SigLIP image embedding (which the model masks out), ``1000 t`` as the
timestep in the transformer's dtype.

Loss: the flow-matching family's, ``t`` logit-normal shifted by ``loss.shift`` (``loss.timestep_shift=fixed`` by
default, at 5.0, the 480p model's sampling shift, unless ``loss.shift`` is given); the target is the velocity ``noise - x0``, as the
pipeline's Euler scheduler steps ``x + (sigma_next - sigma) v``.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from contextlib import contextmanager
from typing import Any

import torch

from runner.compat import is_fake, without_dispatch_modes
from runner.errors import UserError
from runner.families.common.flow import FlowMatchTrainer
from runner.families.common.clips import ClipData
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.common.tokenizers import qwen3_tokenizer, t5_tokenizer
from runner.families.hunyuan_video15 import architecture as hv_configs
from runner.families.hunyuan_video15.config import HunyuanVideo15TrainerConfig
from runner.families.hunyuan_video15.vae_mask import use_frame_causal_masks
from runner.loss.config import LossConfig
from runner.trainer import Batch, EncodePart, ModelSet, batch_device

DEFAULT_FRAMES = {"tiny": 5, "full": 121}  # data.frames unset: 121 is the pipeline's 5 s at 24 fps
PIPELINE = "HunyuanVideo15Pipeline"


def simulated(t: torch.Tensor) -> bool:
    """A tensor of the planner's simulated step (meta or fake): no values to read."""
    return t.device.type == "meta" or is_fake(t)


class _ZeroImageAnswer(torch.overrides.TorchFunctionMode):
    """The transformer's one value read, ``torch.all(image_embeds == 0)`` (text-to-video or not), answered True in
    the planner's simulation, where the zero embedding ``predict`` passes has no values."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = shape

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "all" and len(args) == 1 and not kwargs and tuple(args[0].shape) == self.shape:
            return True  # a Python bool: a tensor made here would be one of the simulation's, without a value
        return func(*args, **kwargs)


@contextmanager
def answered_zero_image(embeds: torch.Tensor) -> Iterator[None]:
    if simulated(embeds):
        with _ZeroImageAnswer(tuple(embeds.shape)):
            yield
    else:
        yield


class HunyuanVideo15Trainer(ClipData, FlowMatchTrainer):
    """HunyuanVideo 1.5 text-to-video transformer, rectified-flow matching loss."""

    Config = HunyuanVideo15TrainerConfig
    denoiser = "transformer"
    display_name = "HunyuanVideo 1.5"
    kohya_lora = False  # diffusers reads no kohya layout of this family; the ComfyUI file has the original names
    comfy_layout = "hunyuan_video15"  # diffusion_model.<original name> (runner/export/comfy.py)
    default_timestep_shift = "fixed"

    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        if self.loss_options.shift == LossConfig.shift:  # loss.shift left at the schema's 3.0: the family's own 5.0
            self.loss_options = replace(self.loss_options, shift=hv_configs.FLOW_SHIFT)
        length = cfg.trainer.get("max_sequence_length")
        self.table = "full" if self.source is not None else self.size
        default = hv_configs.MAX_SEQUENCE_LENGTH[self.table]
        self.max_sequence_length = int(default if length is None else length)
        if not 1 <= self.max_sequence_length <= 4096:
            raise UserError(f"trainer.max_sequence_length={length!r} is not valid: a whole number from 1 to 4096 (the "
                            f"pipeline uses 1000), or null for {default}.")
        from runner.data.video import clip_settings

        self.clips = clip_settings(cfg.data, *self.video_defaults(cfg))
        if (self.clips.frames - 1) % 4:
            near = sorted({max(1, (self.clips.frames - 1) // 4 * 4 + 1), (self.clips.frames - 1) // 4 * 4 + 5})
            raise UserError(f"data.frames={self.clips.frames} is not usable for HunyuanVideo 1.5: its VAE takes 4k+1 "
                            f"frames (the first, then groups of 4), e.g. data.frames={' or '.join(map(str, near))}.")
        sample = cfg.get("sample") if hasattr(cfg, "get") else None
        if sample is not None and int(sample.get("every", 0) or 0) > 0 and sample.get("resolution") is not None:
            raise UserError(f"sample.resolution={sample.get('resolution')} is set, but HunyuanVideo 1.5 samples clips "
                            "at the training clip size (data.width x data.height, data.frames frames); unset "
                            "sample.resolution.")
        k = self.spatial_factor()
        for key, value in (("data.width", self.clips.width), ("data.height", self.clips.height)):
            if value % k:
                raise UserError(f"{key}={value} is not usable for HunyuanVideo 1.5: frames must be a multiple of {k} "
                                f"pixels (the VAE's factor), e.g. {key}={max(k, value // k * k)} (data.width/"
                                "data.height default to data.resolution).")

    @classmethod
    def video_defaults(cls, cfg: Any) -> tuple[int, float]:
        """``data.frames`` and ``data.fps`` when unset: 5 frames at tiny size, 121 at full; 24 fps."""
        return DEFAULT_FRAMES.get(str(cfg.model.size), DEFAULT_FRAMES["tiny"]), hv_configs.FPS

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel
        from transformers import Qwen2_5_VLTextModel, T5EncoderModel

        return {"transformer": HunyuanVideo15Transformer3DModel, "vae": AutoencoderKLHunyuanVideo15,
                "text_encoder": Qwen2_5_VLTextModel, "text_encoder_2": T5EncoderModel}

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return hv_configs.hunyuan_video15_configs(self.size)

    def build_models(self, device: str | torch.device = "cpu") -> ModelSet:
        """The base's models, the VAE building its causal masks a frame at a time (runner/families/hunyuan_video15/vae_mask.py)."""
        models = super().build_models(device)
        use_frame_causal_masks(models["vae"])
        return models

    def default_tokenizer(self, name: str) -> Any:
        """Offline stand-ins: Qwen's byte-level vocabulary with the chat template; ByT5's bytes."""
        return t5_tokenizer(hv_configs.BYT5_MAX_LENGTH) if name == "tokenizer_2" else qwen3_tokenizer(8192)

    def pipeline_class(self) -> type:
        return pipeline_class(PIPELINE)

    def pipeline_kwargs(self) -> dict[str, Any]:
        from diffusers.guiders import ClassifierFreeGuidance

        return {"guider": ClassifierFreeGuidance(guidance_scale=hv_configs.GUIDANCE)}

    def pipeline(self, models: ModelSet) -> Any:
        """The pipeline with this run's text lengths (the template's token count, the caption's tokens)."""
        pipe = super().pipeline(models)
        pipe.prompt_template_encode_start_idx = self.crop_start()
        pipe.tokenizer_max_length = self.max_sequence_length
        return pipe

    def inference_scheduler(self) -> Any:
        """The 480p pipeline's Euler flow scheduler, shift 5.0."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=hv_configs.FLOW_SHIFT)

    def sampling_family(self) -> Any:
        from runner.families.hunyuan_video15.sampling import HunyuanVideo15Sampling

        return HunyuanVideo15Sampling()

    def spatial_factor(self) -> int:
        return int(self.component_config("vae").get("spatial_compression_ratio") or 16)

    def temporal_factor(self) -> int:
        return int(self.component_config("vae").get("temporal_compression_ratio") or 4)

    # -- encoding --------------------------------------------------------------------------------
    def crop_start(self) -> int:
        """Tokens of the system template before the caption: the pipeline's 108 with a real tokenizer, counted
        with the offline one (which spells the system message byte by byte)."""
        tok = self.tokenizer("tokenizer")
        if not self._folder_has("tokenizer") and not self.file_provides("text_encoder"):
            from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

            text = tok.apply_chat_template(format_text_input(["\x00"], self.system_message())[0], tokenize=False,
                                           add_generation_prompt=True)
            return len(tok(text[:text.index("\x00")]).input_ids)
        return hv_configs.CROP_START

    def encode_parts(self) -> dict[str, EncodePart]:
        return {"latents": EncodePart(("vae",), ("pixel_values",)),
                "text": EncodePart(("text_encoder", "text_encoder_2"), ("caption",))}

    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior of the clips, or both text encoders' states with their masks (the pipeline's helpers)."""
        if part == "latents":  # one clip at a time: the VAE's mid-block causal mask is (B, L, L), which SDPA
            # broadcasts against (B, 1, L, L) queries only for B = 1 (diffusers 0.42.1); its own use_slicing does so too
            n = int(batch["pixel_values"].shape[0])
            parts = [self.encode_latents(models, {k: v[i:i + 1] if isinstance(v, torch.Tensor) and v.shape[:1] == (n,)
                                                  else v for k, v in batch.items()}) for i in range(n)]
            return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        device, captions = batch_device(batch), list(batch["caption"])
        embeds, mask = self.encode_mllm(models["text_encoder"], captions, device)
        rows = [self.encode_glyphs(models["text_encoder_2"], caption, device) for caption in captions]
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask,
                "prompt_embeds_2": torch.cat([r[0] for r in rows]),
                "prompt_embeds_mask_2": torch.cat([r[1] for r in rows])}

    def encode_glyphs(self, text_encoder: Any, caption: str, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``HunyuanVideo15Pipeline._get_byt5_prompt_embeds`` for one caption: ByT5's last state of its quoted text
        (``Text "..."``) padded to 256 bytes with the mask, or zeros and an all-false mask when it quotes nothing."""
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts

        length, glyphs = hv_configs.BYT5_MAX_LENGTH, extract_glyph_texts(caption)
        if glyphs is None:
            width = int(text_encoder.config.d_model)
            return (torch.zeros((1, length, width), device=device, dtype=text_encoder.dtype),
                    torch.zeros((1, length), device=device, dtype=torch.bool))
        with without_dispatch_modes():
            tokens = self.tokenizer("tokenizer_2")(glyphs, padding="max_length", max_length=length, truncation=True,
                                                   add_special_tokens=True, return_tensors="pt")
        mask = tokens.attention_mask.to(device)
        # unmasked in the planner's simulation, as the Qwen encoder (encode_mllm)
        out = text_encoder(input_ids=tokens.input_ids.to(device),
                           attention_mask=None if simulated(mask) else mask.float())[0]
        return out, mask.bool()

    def encode_mllm(self, text_encoder: Any, captions: list[str], device: torch.device) -> tuple[torch.Tensor, ...]:
        """``HunyuanVideo15Pipeline._get_mllm_prompt_embeds``: the chat template padded to the template's tokens plus
        the caption length, the third-last hidden state, the template's tokens dropped. The mask goes in as booleans
        (the model makes them so itself): the planner keeps a boolean mask's values (runner/plan/batch.py), which
        transformers' causal-mask shortcut reads."""
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

        crop = self.crop_start()
        with without_dispatch_modes():  # real CPU ids and mask also inside the planner's simulation (their values kept)
            text = self.tokenizer("tokenizer").apply_chat_template(
                format_text_input(captions, self.system_message()), add_generation_prompt=True, tokenize=True,
                return_dict=True, padding="max_length", max_length=self.max_sequence_length + crop, truncation=True,
                return_tensors="pt")
        mask = text.attention_mask.to(device).bool()
        # In the planner's simulation the mask reaches transformers' causal-mask shortcut without its values (a read
        # it cannot answer): the encoder is planned unmasked there, which moves only the L x L mask of a 1,108-token
        # prompt (and the text encoder's pass is not the plan's peak).
        hidden = text_encoder(input_ids=text.input_ids.to(device), attention_mask=None if simulated(mask) else mask,
                              output_hidden_states=True).hidden_states[-3]
        return hidden[:, crop:], mask[:, crop:]

    def system_message(self) -> str:
        """The pipeline's system prompt (its ``_get_mllm_prompt_embeds`` default, which ``encode_prompt`` passes)."""
        import inspect

        return inspect.signature(self.pipeline_class()._get_mllm_prompt_embeds).parameters["system_message"].default

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``z * scaling_factor``: the VAE has no shift (the pipeline decodes ``latents / scaling_factor``)."""
        return latents * self.vae_setting("scaling_factor")

    # -- the denoiser ----------------------------------------------------------------------------
    def image_seq_len(self, latents: torch.Tensor) -> int:
        """Tokens of one clip: latent frames times height times width (1x1 patches)."""
        return int(latents.shape[2]) * int(latents.shape[3]) * int(latents.shape[4])

    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The pipeline's text-to-video call: zero condition latents and mask channel, a zero image embedding."""
        transformer = models["transformer"]
        dt = compute_dtype(transformer)
        b, c, f, h, w = noisy.shape
        x = torch.cat([noisy.to(dt), noisy.new_zeros((b, c, f, h, w), dtype=dt),
                       noisy.new_zeros((b, 1, f, h, w), dtype=dt)], dim=1)
        image = noisy.new_zeros((b, hv_configs.IMAGE_TOKENS, int(transformer.config.image_embed_dim)), dtype=dt)
        with answered_zero_image(image):
            return transformer(
                hidden_states=x,
                image_embeds=image,
                timestep=(timesteps.float() * 1000).to(dt),  # the scheduler's sigma * 1000, in the latents' dtype
                encoder_hidden_states=batch["prompt_embeds"].to(dt),
                encoder_attention_mask=batch["prompt_embeds_mask"],
                encoder_hidden_states_2=batch["prompt_embeds_2"].to(dt),
                encoder_attention_mask_2=batch["prompt_embeds_mask_2"],
                return_dict=False,
            )[0]

    # -- shapes for the planner ------------------------------------------------------------------
    def describe_sample(self) -> str:
        """What one sample is, for the plan's header: "61 frames of 848x480 px at 24 fps"."""
        c = self.clips
        return f"{c.frames} frames of {c.width}x{c.height} px" + (f" at {c.fps:g} fps" if c.fps else "")

    def latent_shape(self) -> tuple[int, int, int, int]:
        """(channels, frames, height, width) of one clip's latents."""
        c, f = self.clips, self.spatial_factor()
        frames = (c.frames - 1) // self.temporal_factor() + 1
        return int(self.component_config("vae")["latent_channels"]), frames, c.height // f, c.width // f

    def example_latents(self, batch_size: int, device: str | torch.device) -> torch.Tensor:
        return self.example_tensor((batch_size, *self.latent_shape()), device, torch.float32, 0)

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives (masks all true: the longest text)."""
        b, length, length_2 = batch_size, self.max_sequence_length, hv_configs.BYT5_MAX_LENGTH
        width = int(self.component_config("text_encoder")["hidden_size"])
        width_2 = int(self.component_config("text_encoder_2")["d_model"])
        return {
            "latents": self.example_latents(b, device),
            "prompt_embeds": self.example_tensor((b, length, width), device, self.storage_dtype, 1),
            "prompt_embeds_mask": torch.ones((b, length), dtype=torch.bool, device=device),
            "prompt_embeds_2": self.example_tensor((b, length_2, width_2), device, self.storage_dtype, 2),
            "prompt_embeds_mask_2": torch.ones((b, length_2), dtype=torch.bool, device=device),
            "sample_seed": self.example_seeds(b, device),
        }

    def example_raw_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """A raw batch of clips as the data loader gives it: pixels (B, 3, F, H, W), captions with quoted text
        (so the planner runs the glyph encoder, as a caption with text to render does)."""
        c = self.clips
        return {
            "pixel_values": self.example_tensor((batch_size, 3, c.frames, c.height, c.width), device, torch.float32, 3),
            "caption": ['an example caption with a sign that reads "hello"'] * batch_size,
            "index": self.example_seeds(batch_size, device),
            "sample_seed": self.example_seeds(batch_size, device),
        }
