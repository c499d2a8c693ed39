"""LTX-2: train the audio-video transformer (fully or with LoRA) with rectified flow over both streams.

Conditioning as diffusers' ``LTX2Pipeline`` computes it: the stripped caption, left-padded to
``trainer.max_sequence_length`` (1024) Gemma tokens, every hidden state of Gemma-3 (embeddings included) stacked
per token, then the text connectors (masked per-layer normalisation, one connector per stream) give the video and
audio text embeddings and their mask. The connectors are frozen and run in the text encode part (cacheable).

Video latents: the LTX-2 video VAE (32x space, 8x time: ``data.frames`` must be ``8k + 1``), normalised per channel
with the VAE's ``latents_mean``/``latents_std`` buffers and ``scaling_factor`` (the pipeline's
``_normalize_latents``), packed into tokens by the pipeline's ``_pack_latents``. Audio latents: the clip's stereo
16 kHz waveform (runner/data/audio.py) to log-mel (audio.py), trimmed to 4 mel frames per audio latent frame of the
pipeline's count (``round(seconds * 25)``), through the audio VAE, packed ``[B, L, C * M]`` and normalised with the
audio VAE's buffers (``_pack_audio_latents``, ``_normalize_audio_latents``). Both posteriors are stored normalised
(mean and std through the same per-channel affine map), so a cache entry holds what the loss samples from.

Loss: one t per sample for both streams, ``x_t = (1 - t) x0 + t noise``, velocity target ``noise - x0``; the video
MSE plus ``loss.audio_weight`` times the audio MSE; ``audio_loss`` and ``video_loss`` are columns of the metrics.
t is logit-normal, shifted as the pipeline's scheduler shifts it for the clip's video tokens (``mu`` linear from
0.95 at 1024 tokens to 2.05 at 4096, exponential shift); ``loss.timestep_shift`` set: the generic shifts instead.
``trainer.first_frame_p``: that share of samples is trained as image-to-video the way ``LTX2ImageToVideoPipeline``
conditions (the first latent frame clean, its tokens at timestep 0, and out of the video loss).
``data.audio=false``: video only; the audio stream is fed pure noise at t = 1 (what the model sees of an audio track
it generates from nothing) and has no loss. The transformer takes ``1000 t`` as ``timestep`` and ``sigma``.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from runner.errors import UserError
from runner.families.common.flow import FlowMatchTrainer
from runner.families.common.latents import TIMESTEP_SALT, VAE_SALT, LatentMoments, sample_latents
from runner.families.common.clips import ClipData
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.common.tokenizers import qwen2_tokenizer
from runner.families.ltx2 import architecture as ltx2_configs
from runner.families.ltx2.audio import audio_latent_frames, log_mel
from runner.families.ltx2.config import LTX2TrainerConfig
from runner.families.ltx2.losses import LossParts
from runner.loss.objectives import diffusion_loss, flow_timesteps, prior_weights, shift_timesteps
from runner.trainer import Batch, EncodePart, ModelSet, batch_device, per_sample_rand, per_sample_randn, salted

DEFAULT_FRAMES = {"tiny": 9, "full": 121}  # data.frames unset: LTX-2's 121 frames (5 s at 24 fps)
DEFAULT_FPS = 24.0  # LTX2Pipeline's frame_rate
AUDIO_RATE = 16000  # LTX-2's audio VAE sample rate (both tables)
AUDIO_VAE_SALT, AUDIO_NOISE_SALT, FIRST_FRAME_SALT = 7, 8, 9  # per-sample draws independent of the video's
MAX_SEQUENCE_LENGTH = 4096  # a bound for the option
# LTX2Pipeline's dynamic shift (calculate_shift with its scheduler's defaults).
BASE_SEQ, MAX_SEQ, BASE_SHIFT, MAX_SHIFT = 1024, 4096, 0.95, 2.05


class LTX2Trainer(LossParts, ClipData, FlowMatchTrainer):
    """LTX-2 audio-video transformer, rectified-flow matching loss over video and audio."""

    Config = LTX2TrainerConfig
    denoiser = "transformer"
    display_name = "LTX-2"
    reference_repo = "Lightricks/LTX-2"
    kohya_lora = False
    comfy_layout = "ltx2"  # diffusion_model.<original LTX-2 name> (runner/export/comfy.py)
    family = "ltx2"
    audio_trainer = True  # data.audio: null or true trains audio (runner/data/audio.py reads it)
    resolution_multiple = 32  # the video VAE's spatial factor at full size
    latent_patch = 1

    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        length = cfg.trainer.get("max_sequence_length")
        text = self.component_config("text_encoder")
        self.table = "tiny" if int(text["vocab_size"]) <= 1024 else "full"
        default = ltx2_configs.LTX2_MAX_SEQUENCE_LENGTH[self.table]
        self.max_sequence_length = int(default if length is None else length)
        if not 1 <= self.max_sequence_length <= MAX_SEQUENCE_LENGTH:
            raise UserError(f"trainer.max_sequence_length={length!r} is not valid: it must be a whole number from 1 to "
                            f"{MAX_SEQUENCE_LENGTH}, or null for {default}.")
        self.first_frame_p = first_frame_share(cfg.trainer.get("first_frame_p", 0.0))
        self.audio = audio_enabled(cfg)
        if not self.audio and float(self.loss_options.audio_weight) != 1.0:
            raise UserError(f"loss.audio_weight={self.loss_options.audio_weight!r} weighs the audio loss, and "
                            "data.audio=false trains video only; unset loss.audio_weight or set data.audio=true.")
        from runner.data.video import clip_settings

        self.clips = clip_settings(cfg.data, *self.video_defaults(cfg))
        kt, ks = self.temporal_factor(), self.spatial_factor()
        if (self.clips.frames - 1) % kt:
            near = sorted({max(1, (self.clips.frames - 1) // kt * kt + 1), (self.clips.frames - 1) // kt * kt + kt + 1})
            raise UserError(f"data.frames={self.clips.frames} is not usable for LTX-2: its VAE takes {kt}k+1 frames, "
                            f"e.g. data.frames={' or '.join(map(str, near))}.")
        for key, value in (("data.width", self.clips.width), ("data.height", self.clips.height)):
            if value % ks:
                raise UserError(f"{key}={value} is not usable for LTX-2: frames must be a multiple of {ks} pixels (the "
                                f"VAE's factor), e.g. {key}={max(ks, value // ks * ks)}.")
        if self.audio and int(self.audio_setting("sample_rate")) != AUDIO_RATE:
            raise UserError(f"model.path: this audio VAE runs at {self.audio_setting('sample_rate')} Hz; the runner "
                            f"reads LTX-2's audio at {AUDIO_RATE} Hz. Set data.audio=false to train video only.")
        self.init_loss_parts()

    @classmethod
    def video_defaults(cls, cfg: Any) -> tuple[int, float, int | None]:
        """``data.frames`` and ``data.fps`` when unset (9 frames tiny, 121 full; the pipeline's 24 fps), and the audio
        rate the loader reads each clip's audio at (None: ``data.audio=false``), as build_video_dataset takes them."""
        return (DEFAULT_FRAMES.get(str(cfg.model.size), DEFAULT_FRAMES["tiny"]), DEFAULT_FPS,
                AUDIO_RATE if audio_enabled(cfg) else None)

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
        from diffusers.pipelines.ltx2 import LTX2TextConnectors
        from transformers import Gemma3TextModel

        return {"transformer": LTX2VideoTransformer3DModel, "connectors": LTX2TextConnectors,
                "vae": AutoencoderKLLTX2Video, "audio_vae": AutoencoderKLLTX2Audio, "text_encoder": Gemma3TextModel}

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return ltx2_configs.ltx2_configs(self.size)

    def default_tokenizer(self, name: str) -> Any:
        tok = qwen2_tokenizer.__wrapped__(MAX_SEQUENCE_LENGTH)  # a fresh one: LTX-2 pads on the left
        tok.padding_side = "left"
        return tok

    def pipeline_class(self) -> type:
        return pipeline_class("LTX2Pipeline")

    def pipeline(self, models: ModelSet) -> Any:
        """``LTX2Pipeline`` around the modules in memory, with a vocoder (the model.path folder's, else built from the
        size's table): training never runs it, so it is loaded only here, for exports and samples."""
        from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

        vocoder = self.load_component("vocoder", LTX2Vocoder, "cpu", self.storage_dtype)
        parts: dict[str, Any] = {name: models[name] for name in self.module_classes()}
        return self.pipeline_class()(**parts, tokenizer=self.tokenizer("tokenizer"), vocoder=vocoder.eval(),
                                     scheduler=self.inference_scheduler())

    def inference_scheduler(self) -> Any:
        """LTX-2's scheduler config: the dynamic exponential shift the pipeline computes ``mu`` for."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                               base_shift=BASE_SHIFT, max_shift=MAX_SHIFT, base_image_seq_len=BASE_SEQ,
                                               max_image_seq_len=MAX_SEQ, shift_terminal=0.1)

    def sampling_family(self) -> Any:
        from runner.families.ltx2.sampling import LTX2Sampling

        return LTX2Sampling(self.spatial_factor())

    def spatial_factor(self) -> int:
        return self._vae_ratio("spatial")

    def temporal_factor(self) -> int:
        return self._vae_ratio("temporal")

    def _vae_ratio(self, kind: str) -> int:
        """The video VAE's compression, as ``AutoencoderKLLTX2Video`` computes it from its config."""
        c = {"patch_size": 4, "patch_size_t": 1, "spatio_temporal_scaling": (True,) * 4,
             "downsample_type": ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
             **self.component_config("vae")}
        set_ratio = c.get(f"{kind}_compression_ratio")
        if set_ratio:
            return int(set_ratio)
        steps = [t for t, s in zip(c["downsample_type"], c["spatio_temporal_scaling"]) if s]
        if kind == "spatial":
            return int(c["patch_size"]) * 2 ** sum(t in ("spatial", "spatiotemporal") for t in steps)
        return int(c["patch_size_t"]) * 2 ** sum(t in ("temporal", "spatiotemporal") for t in steps)

    def audio_setting(self, key: str) -> Any:
        from diffusers import AutoencoderKLLTX2Audio
        import inspect

        c = self.component_config("audio_vae")
        return c[key] if key in c else inspect.signature(AutoencoderKLLTX2Audio.__init__).parameters[key].default

    def audio_frames(self) -> int:
        """Audio latent frames of one clip (the pipeline's count for ``data.frames`` at ``data.fps``)."""
        return audio_latent_frames(self.clips.frames, float(self.clips.fps or DEFAULT_FPS),
                                   int(self.audio_setting("sample_rate")), int(self.audio_setting("mel_hop_length")))

    def audio_samples(self) -> int:
        """Waveform samples of one clip's window at the audio VAE's rate."""
        return round(self.clips.frames / float(self.clips.fps or DEFAULT_FPS) * int(self.audio_setting("sample_rate")))

    # -- encoding --------------------------------------------------------------------------------
    def encode_parts(self) -> dict[str, EncodePart]:
        parts = {"latents": EncodePart(("vae",), ("pixel_values",)),
                 "text": EncodePart(("text_encoder", "connectors"), ("caption",))}
        if self.audio:
            parts["audio"] = EncodePart(("audio_vae",), ("audio",))
        return parts

    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        if part == "latents":
            return self.encode_video(models, batch)
        if part == "audio":
            return self.encode_audio(models, batch)
        return self.encode_text(models, batch)

    def encode_video(self, models: ModelSet, batch: Batch) -> dict[str, torch.Tensor]:
        """The video posterior, normalised as the pipeline's ``_normalize_latents``: ``(B, C, F', h, w)``."""
        vae = models["vae"]
        dist = vae.encode(batch["pixel_values"].to(compute_dtype(vae))).latent_dist
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(dist.mean.device, dist.mean.dtype)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(dist.mean.device, dist.mean.dtype)
        sf = vae.config.scaling_factor
        return {"latent_mean": ((dist.mean - mean) * sf / std).contiguous(),
                "latent_std": (dist.std * sf / std).contiguous()}

    def mel(self, audio: torch.Tensor) -> torch.Tensor:
        """The waveform's log-mel, trimmed to 4 mel frames per audio latent frame (padded by its last frame)."""
        hop, rate = int(self.audio_setting("mel_hop_length")), int(self.audio_setting("sample_rate"))
        mel = log_mel(audio, rate, hop, int(self.audio_setting("mel_bins")), ltx2_configs.MEL_N_FFT)
        want = 4 * self.audio_frames()
        if mel.shape[2] < want:
            mel = torch.cat([mel, mel[:, :, -1:].expand(-1, -1, want - mel.shape[2], -1)], dim=2)
        return mel[:, :, :want]

    def encode_audio(self, models: ModelSet, batch: Batch) -> dict[str, torch.Tensor]:
        """The audio posterior packed ``[B, L, C * M]`` and normalised as the pipeline's ``_normalize_audio_latents``."""
        avae = models["audio_vae"]
        dist = avae.encode(self.mel(batch["audio"].to(batch_device(batch))).to(compute_dtype(avae))).latent_dist
        pack = self.pipeline_class()._pack_audio_latents
        mean, std = pack(dist.mean), pack(dist.std)
        mu, sd = avae.latents_mean.to(mean.device, mean.dtype), avae.latents_std.to(mean.device, mean.dtype)
        return {"audio_mean": ((mean - mu) / sd).contiguous(), "audio_std": (std / sd).contiguous()}

    def encode_text(self, models: ModelSet, batch: Batch) -> dict[str, torch.Tensor]:
        """``LTX2Pipeline._get_gemma_prompt_embeds`` then its connectors: video and audio text, and their mask."""
        device = batch_device(batch)
        tok, te = self.tokenizer("tokenizer"), models["text_encoder"]
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        text = tok([c.strip() for c in batch["caption"]], padding="max_length", max_length=self.max_sequence_length,
                   truncation=True, add_special_tokens=True, return_tensors="pt")
        ids, mask = text.input_ids.to(device), text.attention_mask.to(device)
        hidden = te(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        embeds = torch.stack(hidden, dim=-1).flatten(2, 3).to(dtype=te.dtype)
        video, audio, cmask = models["connectors"](embeds, mask, padding_side="left")
        return {"prompt_embeds": video, "audio_prompt_embeds": audio, "prompt_attention_mask": cmask}

    def finish_encode(self, parts: dict[str, dict[str, torch.Tensor]], batch: Batch) -> Batch:
        """Both posteriors sampled with each sample's seed (already normalised); the text as encoded."""
        seeds = batch["sample_seed"]
        lat = parts["latents"]
        out = {"latents": sample_latents(LatentMoments(lat["latent_mean"], lat["latent_std"]), seeds, VAE_SALT),
               **parts["text"], "sample_seed": seeds}
        if "audio" in parts:
            a = parts["audio"]
            out["audio_latents"] = sample_latents(LatentMoments(a["audio_mean"], a["audio_std"]), seeds, AUDIO_VAE_SALT)
        if "prior" in batch:
            out["prior"] = batch["prior"]
        return out

    # -- the denoiser ----------------------------------------------------------------------------
    def image_seq_len(self, latents: torch.Tensor) -> int:
        """Video tokens of one clip (patch 1): latent frames x height x width."""
        return int(latents.shape[2]) * int(latents.shape[3]) * int(latents.shape[4])

    def timesteps(self, seeds: torch.Tensor, seq_len: int = 4096) -> torch.Tensor:
        """Logit-normal t with the pipeline's resolution shift; the generic shift where ``loss.timestep_shift`` is set."""
        o = self.loss_options
        if o.timestep_shift is not None:
            return super().timesteps(seeds, seq_len)
        u = per_sample_rand(seeds, TIMESTEP_SALT, "cpu")
        t = flow_timesteps(u, o.timestep_sampling or self.default_timestep_sampling, o.logit_mean, o.logit_std)
        mu = BASE_SHIFT + (MAX_SHIFT - BASE_SHIFT) / (MAX_SEQ - BASE_SEQ) * (seq_len - BASE_SEQ)
        return shift_timesteps(t, math.exp(mu))

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """Video latents ``(B, C, F, H, W)`` as tokens (``LTX2Pipeline._pack_latents``, patch 1)."""
        return self.pipeline_class()._pack_latents(latents, 1, 1)

    def predict_av(self, models: ModelSet, video: torch.Tensor, audio: torch.Tensor, t: torch.Tensor, batch: Batch,
                   audio_t: torch.Tensor | None = None,
                   clean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer's (video, audio) velocities as ``LTX2Pipeline`` calls it (positions from its ropes, computed
        on the host and copied: the ropes build a small tensor without a device, the same values on every device)."""
        tr = models["transformer"]
        dt = compute_dtype(tr)
        b, _, f, h, w = video.shape
        fps = float(self.clips.fps or DEFAULT_FPS)
        frames = audio.shape[1]
        step = t.to(video.device).float() * 1000
        astep = step if audio_t is None else audio_t.to(video.device).float() * 1000
        # image-to-video (``clean``: 1 on the kept first frame's tokens): per-token video timesteps, as
        # LTX2ImageToVideoPipeline's ``timestep * (1 - conditioning_mask)``
        vstep = step if clean is None else step.unsqueeze(-1) * (1 - clean.to(video.device, step.dtype))
        return tr(hidden_states=self.pack(video).to(dt), audio_hidden_states=audio.to(dt),
                  encoder_hidden_states=batch["prompt_embeds"].to(dt),
                  audio_encoder_hidden_states=batch["audio_prompt_embeds"].to(dt),
                  timestep=vstep, audio_timestep=astep, sigma=step, audio_sigma=astep,
                  encoder_attention_mask=batch["prompt_attention_mask"],
                  audio_encoder_attention_mask=batch["prompt_attention_mask"],
                  num_frames=f, height=h, width=w, fps=fps, audio_num_frames=frames,
                  video_coords=tr.rope.prepare_video_coords(b, f, h, w, "cpu", fps=fps).to(video.device),
                  audio_coords=tr.audio_rope.prepare_audio_coords(b, frames, "cpu").to(video.device),
                  use_cross_timestep=True, return_dict=False)

    def silent_audio(self, seeds: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Pure-noise audio latents (packed) for a video-only step: what the model sees at t = 1."""
        return per_sample_randn(salted(seeds, AUDIO_NOISE_SALT), self.audio_shape(), device, torch.float32)

    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The video velocity (the audio stream fed pure noise at t = 1)."""
        audio = self.silent_audio(batch["sample_seed"], noisy.device)
        return self.predict_av(models, noisy, audio, timesteps, batch, torch.ones_like(timesteps))[0]

    def first_frame_mask(self, seeds: torch.Tensor, latents: torch.Tensor) -> torch.Tensor | None:
        """``(B, 1, F, 1, 1)``: 1 on the first latent frame of the samples trained as image-to-video
        (``trainer.first_frame_p``, drawn per sample from its seed); None when the option is off."""
        if self.first_frame_p <= 0:
            return None
        chosen = (per_sample_rand(seeds, FIRST_FRAME_SALT, "cpu") < self.first_frame_p).float().to(latents.device)
        mask = torch.zeros((latents.shape[0], 1, latents.shape[2], 1, 1), device=latents.device)
        mask[:, 0, 0] = chosen.view(-1, 1, 1)
        return mask

    def loss(self, models: ModelSet, batch: Batch) -> torch.Tensor:
        """Video flow-matching loss plus ``loss.audio_weight`` times the audio one (module docstring)."""
        x0 = batch["latents"].float()
        seeds, device, b = batch["sample_seed"], x0.device, x0.shape[0]
        noise = per_sample_randn(seeds, tuple(x0.shape[1:]), device, torch.float32)
        t = self.timesteps(seeds, self.image_seq_len(x0)).to(device)
        tt = t.view(b, 1, 1, 1, 1)
        frame = self.first_frame_mask(seeds, x0)
        x_t = (1.0 - tt) * x0 + tt * noise
        clean = keep = None
        if frame is not None:  # the kept first frame: clean latents, timestep 0, no loss (the i2v pipeline's mask)
            x_t = frame * x0 + (1 - frame) * x_t
            clean = self.pack(frame.expand(-1, -1, -1, *x0.shape[3:]).contiguous()).squeeze(-1)
            keep = (1 - clean).unsqueeze(-1).expand(-1, -1, self.pack(x0).shape[-1]).contiguous()
        weights = prior_weights(batch, self.loss_options, device)
        a0 = batch.get("audio_latents")
        if a0 is None:
            pred_v, _ = self.predict_av(models, x_t, self.silent_audio(seeds, device), t, batch, torch.ones_like(t),
                                        clean)
            return diffusion_loss(pred_v, self.pack(noise - x0), self.loss_options, weights, keep)
        a0 = a0.float()
        anoise = per_sample_randn(salted(seeds, AUDIO_NOISE_SALT), tuple(a0.shape[1:]), device, torch.float32)
        ta = t.view(b, 1, 1)
        pred_v, pred_a = self.predict_av(models, x_t, (1.0 - ta) * a0 + ta * anoise, t, batch, None, clean)
        video_loss = diffusion_loss(pred_v, self.pack(noise - x0), self.loss_options, weights, keep)
        audio_loss = diffusion_loss(pred_a, anoise - a0, self.loss_options, weights)
        self.add_loss_parts(b, video_loss=video_loss, audio_loss=audio_loss)
        return video_loss + float(self.loss_options.audio_weight) * audio_loss

    # -- shapes for the planner ------------------------------------------------------------------
    def describe_sample(self) -> str:
        c = self.clips
        return (f"{c.frames} frames of {c.width}x{c.height} px at {c.fps:g} fps"
                + (" with audio" if self.audio else " (video only)"))

    def latent_shape(self) -> tuple[int, int, int, int]:
        c = self.clips
        f = (c.frames - 1) // self.temporal_factor() + 1
        s = self.spatial_factor()
        channels = int(self.component_config("vae").get("latent_channels", 128))
        return channels, f, c.height // s, c.width // s

    def audio_shape(self) -> tuple[int, int]:
        """Packed audio latents of one clip: (frames, channels x latent mel bins)."""
        bins = int(self.audio_setting("mel_bins")) // 4
        return self.audio_frames(), int(self.audio_setting("latent_channels")) * bins

    def example_latents(self, batch_size: int, device: str | torch.device) -> torch.Tensor:
        return self.example_tensor((batch_size, *self.latent_shape()), device, torch.float32, 0)

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives for ``data.frames`` x height x width (and audio)."""
        b, n = batch_size, self.max_sequence_length
        width = int(self.component_config("connectors").get("caption_channels", 3840))
        out = {"latents": self.example_latents(b, device),
               "prompt_embeds": self.example_tensor((b, n, width), device, self.storage_dtype, 1),
               "audio_prompt_embeds": self.example_tensor((b, n, width), device, self.storage_dtype, 1),
               "prompt_attention_mask": torch.ones((b, n), dtype=torch.int64, device=device),
               "sample_seed": self.example_seeds(b, device)}
        if self.audio:
            out["audio_latents"] = self.example_tensor((b, *self.audio_shape()), device, torch.float32, 0)
        return out

    def example_raw_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """A raw batch as the loader gives it: pixels (B, 3, F, H, W), captions, and the stereo waveform."""
        c = self.clips
        out = {"pixel_values": self.example_tensor((batch_size, 3, c.frames, c.height, c.width), device, torch.float32, 3),
               "caption": ["an example caption"] * batch_size,
               "index": self.example_seeds(batch_size, device),
               "sample_seed": self.example_seeds(batch_size, device)}
        if self.audio:
            out["audio"] = self.example_tensor((batch_size, 2, self.audio_samples()), device, torch.float32, 4)
        return out


def first_frame_share(value: Any) -> float:
    """``trainer.first_frame_p``, checked: a number from 0 to 1."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= float(value) <= 1.0
    if not ok:
        raise UserError(f"trainer.first_frame_p={value!r} is not valid: it is the share of samples trained as "
                        "image-to-video (first frame kept clean), a number from 0 to 1 (e.g. 0.5; 0 turns it off).")
    return float(value)


def audio_enabled(cfg: Any) -> bool:
    """``data.audio``: null (the default) or true trains audio; false trains video only."""
    data = cfg.get("data") if hasattr(cfg, "get") else None
    value = data.get("audio", None) if data is not None and hasattr(data, "get") else None
    return True if value is None else bool(value)
