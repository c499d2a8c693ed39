"""Wan 2.1 / 2.2 text-to-video: train the 3-D transformer (fully or with LoRA) with rectified flow.

``trainer.variant``: ``14b`` (Wan2.1-T2V-14B, the default), ``1.3b`` (Wan2.1-T2V-1.3B), ``2.2-5b``
(Wan2.2-TI2V-5B, in its text-to-video mode) or ``2.2-a14b`` (Wan2.2-T2V-A14B: two 14 B experts);
runner/families/wan/architecture.py has the architectures.

Wan 2.2 A14B denoises the steps with t >= 0.875 (``boundary_ratio`` of the folder's
``model_index.json`` when it has one) with its high-noise expert and the rest with its
low-noise one. A run trains one (``trainer.experts=high|low``: two LoRAs, each loaded into its own
model in ComfyUI; ``trainer.experts=both`` trains the two in one run, runner/families/wan/experts.py): the expert's transformer is read from
its subfolder (``transformer/`` or ``transformer_2/``), and each sample's t is the family's draw
scaled into the expert's range (``0.875 + 0.125 t`` or ``0.875 t``), so the loss sees only the
noise levels that expert denoises. Samples during training use the trained expert for every step
(the other expert is not loaded): a preview of the expert, not of the two-expert pipeline.

Data are clips (runner/data/video.py): ``data.frames`` frames at ``data.fps`` and
``data.width`` x ``data.height`` (default: ``data.resolution`` square). The Wan VAE compresses
4x in time after the first frame, so ``data.frames`` must be ``4k + 1`` (1, 5, 9, ... 33, ... 81),
and 8x (16x for the Wan 2.2 VAE) in space before the transformer's 2x2 patches. An image is a
one-frame clip, i.e. one latent frame, which is how Wan trains on images too.

Conditioning as diffusers' ``WanPipeline`` computes it: the caption cleaned (``prompt_clean``),
tokenized (at most 512 tokens), UMT5's last hidden state, zero-padded to 512 (the model was
trained on zero padding, not on a mask). Each caption is encoded on its own, without padding;
the pipeline pads a batch and masks the padding, which gives the caption's tokens the same
values (tests compare the two) but reads the mask's values, which a shape-only planner cannot.
Latents: the VAE
posterior sampled per sample seed, normalised per channel with the VAE config's
``latents_mean``/``latents_std``; the transformer patchifies them itself.

Loss: the flow-matching family's over the whole clip ``(B, C, F, H, W)``; ``t`` logit-normal,
shifted by ``loss.shift`` (3.0) by default, musubi-tuner's recommended recipe for Wan text-to-video
(``--timestep_sampling shift --discrete_flow_shift 3.0``). The transformer takes ``1000 t``, as the
pipeline feeds it its scheduler's timesteps.
"""
from __future__ import annotations

from typing import Any, Self

import torch
from hydra.utils import get_class

from runner.errors import UserError
from runner.families.common.flow import FlowMatchTrainer
from runner.families.common.clips import ClipData
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.common.tokenizers import t5_tokenizer
from runner.families.qwen_image.trainer import latent_factor, normalize_per_channel
from runner.families.wan import architecture as wan_configs
from runner.families.wan.config import WanTrainerConfig
from runner.trainer import Batch, EncodePart, ModelSet, batch_device

DEFAULT_FRAMES = {"tiny": 9, "full": 81}  # data.frames unset: 81 is Wan's native 5 s at 16 fps






class WanTrainer(ClipData, FlowMatchTrainer):
    """Wan 2.1/2.2 text-to-video transformer, rectified-flow matching loss."""

    Config = WanTrainerConfig
    denoiser = "transformer"
    display_name = "Wan"
    kohya_lora = False  # ComfyUI/musubi Wan LoRAs use the original module names: the ComfyUI file below has them
    comfy_layout = "wan"  # ComfyUI's LoRA keys for the family: lora_comfy.safetensors (runner/export/comfy.py)
    family = "wan"  # model.path reads (and export.full_format=single_file writes) the original Wan transformer layout
    default_timestep_shift = "fixed"

    def __new__(cls, cfg: Any = None, run: Any = None) -> Self:
        """``trainer.variant=i2v-*``: the image-to-video trainer (runner/families/wan/i2v.py);
        ``trainer.experts=both``: the two-expert trainer (runner/families/wan/experts.py). ``cfg`` is
        None when ``copy`` makes the instance (the planner deep-copies the trainer): it keeps its class."""
        target: Any = cls
        if cls is WanTrainer and cfg is not None:
            # By dotted path, as runner/families/__init__.py registers trainers: the subclasses import
            # this module, so importing them here would make a three-module import circle.
            if str(cfg.trainer.get("variant", "14b")) in wan_configs.I2V_VARIANTS:
                target = get_class("runner.families.wan.i2v.WanI2VTrainer")
            elif cfg.trainer.get("experts") == wan_configs.BOTH:
                target = get_class("runner.families.wan.experts.WanExpertsTrainer")
        return super().__new__(target)

    def __init__(self, cfg: Any, run: Any = None) -> None:
        self.variant = wan_configs.check_variant(str(cfg.trainer.get("variant", "14b")))
        self.expert = self.check_expert(cfg.trainer.get("experts"))
        super().__init__(cfg, run)
        self.boundary = wan_configs.a14b_boundary(self.source)  # the folder's model_index.json, else 0.875
        length = cfg.trainer.get("max_sequence_length")
        # A real model folder gets the pipeline's 512 whatever model.size says (as Flux's T5 length).
        default = wan_configs.WAN_MAX_SEQUENCE_LENGTH["full" if self.source is not None else self.size]
        self.max_sequence_length = int(default if length is None else length)
        if self.max_sequence_length < 1:
            raise UserError(f"trainer.max_sequence_length={length!r} is not valid: a whole number >= 1 (the pipeline "
                            f"uses 512), or null for {default}.")
        from runner.data.video import clip_settings

        self.clips = clip_settings(cfg.data, *self.video_defaults(cfg))
        if (self.clips.frames - 1) % 4:
            near = sorted({max(1, (self.clips.frames - 1) // 4 * 4 + 1), (self.clips.frames - 1) // 4 * 4 + 5})
            raise UserError(f"data.frames={self.clips.frames} is not usable for Wan: its VAE takes 4k+1 frames (the "
                            f"first, then groups of 4), e.g. data.frames={' or '.join(map(str, near))}.")
        sample = cfg.get("sample") if hasattr(cfg, "get") else None
        if sample is not None and int(sample.get("every", 0) or 0) > 0 and sample.get("resolution") is not None:
            raise UserError(f"sample.resolution={sample.get('resolution')} is set, but Wan samples clips at the training "
                            "clip size (data.width x data.height, data.frames frames); unset sample.resolution.")
        k = self.spatial_factor() * 2
        for key, value in (("data.width", self.clips.width), ("data.height", self.clips.height)):
            if value % k:
                raise UserError(f"{key}={value} is not usable for Wan {self.variant}: frames must be a multiple of {k} "
                                f"pixels (VAE factor {k // 2} times the 2x2 patches), e.g. {key}={max(k, value // k * k)} "
                                "(data.width/data.height default to data.resolution).")

    def check_expert(self, expert: Any) -> str | None:
        """``trainer.experts`` for this variant (wan_configs.check_expert); the I2V trainer has its own."""
        return wan_configs.check_expert(self.variant, expert)

    @classmethod
    def video_defaults(cls, cfg: Any) -> tuple[int, float]:
        """``data.frames`` and ``data.fps`` when unset: 9 frames at tiny size, 81 at full; the
        variant's training rate (16 fps for Wan 2.1, 24 for Wan 2.2 5B)."""
        variant = wan_configs.check_variant(str(cfg.trainer.get("variant", "14b")))
        size = str(cfg.model.size)
        return DEFAULT_FRAMES.get(size, DEFAULT_FRAMES["tiny"]), float(wan_configs.WAN_PIPELINE[variant]["fps"])

    def folder_name(self, name: str) -> str:
        """Wan 2.2 A14B: the trained expert's subfolder holds the transformer."""
        if name == self.denoiser and self.expert is not None:
            return wan_configs.A14B_FOLDER[self.expert]
        return name

    def timesteps(self, seeds: torch.Tensor, seq_len: int = 4096) -> torch.Tensor:
        """The family's t, scaled into the trained expert's range for Wan 2.2 A14B (module docstring)."""
        t = super().timesteps(seeds, seq_len)
        if self.expert is None:
            return t
        b = self.boundary
        return b + (1.0 - b) * t if self.expert == "high" else b * t

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import UMT5EncoderModel

        return {"transformer": WanTransformer3DModel, "vae": AutoencoderKLWan, "text_encoder": UMT5EncoderModel}

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return wan_configs.wan_configs(self.size, self.variant)

    def default_tokenizer(self, name: str) -> Any:
        return t5_tokenizer(self.max_sequence_length if hasattr(self, "max_sequence_length") else 512)

    def pipeline_class(self) -> type:
        return pipeline_class("WanPipeline")

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {"expand_timesteps": bool(wan_configs.WAN_PIPELINE[self.variant]["expand_timesteps"])}

    def inference_scheduler(self) -> Any:
        """The Wan pipelines' UniPC flow scheduler, with the variant's flow shift."""
        from diffusers import UniPCMultistepScheduler

        return UniPCMultistepScheduler(
            num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
            flow_shift=float(wan_configs.WAN_PIPELINE[self.variant]["flow_shift"]),
        )

    def sampling_family(self) -> Any:
        from runner.families.wan.sampling import WanSampling

        return WanSampling(self.spatial_factor() * 2)

    def spatial_factor(self) -> int:
        return latent_factor(self.component_config("vae"))

    def temporal_factor(self) -> int:
        return int(self.component_config("vae").get("scale_factor_temporal") or 4)

    # -- encoding --------------------------------------------------------------------------------
    def encode_parts(self) -> dict[str, EncodePart]:
        return {"latents": EncodePart(("vae",), ("pixel_values",)), "text": EncodePart(("text_encoder",), ("caption",))}

    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior of the clips (B, C, F', h, w), or UMT5's states of each caption, zero-padded."""
        if part == "latents":
            return self.encode_latents(models, batch)
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        device = batch_device(batch)
        te, tok, length = models["text_encoder"], self.tokenizer("tokenizer"), self.max_sequence_length
        rows = []
        for caption in batch["caption"]:
            ids = tok(prompt_clean(caption), max_length=length, truncation=True, add_special_tokens=True,
                      return_tensors="pt").input_ids.to(device)
            hidden = te(ids).last_hidden_state[0]
            rows.append(torch.cat([hidden, hidden.new_zeros(length - hidden.shape[0], hidden.shape[1])]))
        return {"prompt_embeds": torch.stack(rows)}

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``(z - latents_mean) / latents_std`` per channel (the VAE config's statistics)."""
        return normalize_per_channel(latents, self.vae_setting("latents_mean"), self.vae_setting("latents_std"))

    # -- the denoiser ----------------------------------------------------------------------------
    def image_seq_len(self, latents: torch.Tensor) -> int:
        """Tokens of one clip: latent frames times (H / 2) * (W / 2)."""
        return int(latents.shape[2]) * super().image_seq_len(latents)

    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        transformer = models["transformer"]
        dt = compute_dtype(transformer)
        return transformer(
            hidden_states=noisy.to(dt),
            timestep=timesteps.float() * 1000,  # the scheduler's scale; the time embedder is kept in float32
            encoder_hidden_states=batch["prompt_embeds"].to(dt),
            return_dict=False,
        )[0]

    # -- shapes for the planner ------------------------------------------------------------------
    def describe_sample(self) -> str:
        """What one sample is, for the plan's header: "33 frames of 832x480 px at 16 fps"."""
        c = self.clips
        return f"{c.frames} frames of {c.width}x{c.height} px" + (f" at {c.fps:g} fps" if c.fps else "")

    def latent_shape(self) -> tuple[int, int, int, int]:
        """(channels, frames, height, width) of one clip's latents."""
        c = self.clips
        frames = (c.frames - 1) // self.temporal_factor() + 1
        f = self.spatial_factor()
        return int(self.component_config("vae")["z_dim"]), frames, c.height // f, c.width // f

    def example_latents(self, batch_size: int, device: str | torch.device) -> torch.Tensor:
        return self.example_tensor((batch_size, *self.latent_shape()), device, torch.float32, 0)

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives for ``data.frames`` x height x width."""
        b = batch_size
        d_model = int(self.component_config("text_encoder")["d_model"])
        return {
            "latents": self.example_latents(b, device),
            "prompt_embeds": self.example_tensor((b, self.max_sequence_length, d_model), device, self.storage_dtype, 1),
            "sample_seed": self.example_seeds(b, device),
        }

    def example_raw_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """A raw batch of clips as the data loader gives it: pixels (B, 3, F, H, W), captions."""
        c = self.clips
        return {
            "pixel_values": self.example_tensor((batch_size, 3, c.frames, c.height, c.width), device, torch.float32, 3),
            "caption": ["an example caption"] * batch_size,
            "index": self.example_seeds(batch_size, device),
            "sample_seed": self.example_seeds(batch_size, device),
        }


# data.resolution at model.size=full (the short side; data.width/data.height default to it): Wan 2.1's
# 480p, Wan 2.2 5B's 704p. The presets set the 16:9-ish frame (832x480) explicitly.
