"""Sampling for LTX-2: ``LTX2Pipeline`` around the transformer in memory, both streams generated together, with the
trainer's own text encoding (the connectors' video and audio embeddings, precomputed once per prompt) and the
pipeline's guidance (classifier-free, 3.0 for video and 7.0 for audio; its spatio-temporal and modality guidance
are off: each would be one more transformer call per step). The pipeline's connectors are given the precomputed
outputs through :class:`PrecomputedConnectors`, since ``LTX2Pipeline`` runs its connectors on whatever text it is
handed. A sample is the clip (``NN-prompt.png``, ``.gif``, ``.mp4`` as Wan's) and its audio, ``NN-prompt.wav``
(the audio VAE's mel through the vocoder), when the audio VAE is kept (``data.audio`` on).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.families.wan.sampling import VideoSample
from runner.sampling.pipelines import _text
from runner.trainer import ModelSet


class PrecomputedConnectors(nn.Module):
    """Stands in for ``LTX2TextConnectors``: its input is the trainer's connector outputs, video and audio
    embeddings concatenated on the last axis, and the connectors' mask; it splits them back."""

    def __init__(self, width: int, device: torch.device) -> None:
        super().__init__()
        self.width = width
        self.register_buffer("anchor", torch.zeros(0, device=device), persistent=False)

    @property
    def device(self) -> torch.device:  # what DiffusionPipeline reads of each module to place its inputs
        return self.anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor, padding_side: str = "left", **_: Any) -> tuple:
        return embeds[..., :self.width], embeds[..., self.width:], mask


class AudioVideoSample(VideoSample):
    """A sampled clip and its stereo waveform, written as ``.wav`` beside the clip's files."""

    def __init__(self, frames: list[Any], fps: float, audio: torch.Tensor | None, rate: int) -> None:
        super().__init__(frames, fps)
        self.audio, self.rate = audio, rate

    def save(self, path: str | Path) -> None:
        super().save(path)
        if self.audio is not None:
            write_wav(self.audio, self.rate, Path(path).with_suffix(".wav"))


def write_wav(audio: torch.Tensor, rate: int, path: Path) -> None:
    """16-bit PCM stereo WAV of a ``[2, N]`` waveform in [-1, 1], with PyAV."""
    import av

    pcm = (audio.float().clamp(-1, 1) * 32767).to(torch.int16).numpy()
    with av.open(str(path), "w") as out:
        stream = out.add_stream("pcm_s16le", rate=rate, layout="stereo")
        frame = av.AudioFrame.from_ndarray(pcm.T.reshape(1, -1).copy(), format="s16", layout="stereo")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


class LTX2Sampling:
    """``LTX2Pipeline`` with LTX-2's scheduler (or the folder's own); clips at the training clip size."""

    default_guidance = 3.0  # the pipeline's guidance_scale (audio: its 7.0)
    negative_prompt = True
    kept_modules = ("vae", "audio_vae")  # kept on the host for the decodes even if offload=park drops them

    def __init__(self, factor: int = 32) -> None:
        self.factor = factor
        self._vocoder: nn.Module | None = None

    @staticmethod
    def denoiser_batch(guidance: float) -> int:
        return 2 if guidance > 1 else 1

    @staticmethod
    def default_negative(guidance: float) -> str | None:
        return "" if guidance > 1 else None

    def encode(self, trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        return _text(trainer, models, prompt, device)

    def scheduler(self, trainer: Any) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        if trainer._folder_has("scheduler"):
            return FlowMatchEulerDiscreteScheduler.from_pretrained(trainer.source[1], subfolder="scheduler",
                                                                   local_files_only=True)
        return trainer.inference_scheduler()

    @staticmethod
    def decode_shape(trainer: Any, resolution: int) -> tuple[int, ...]:
        return (1, *trainer.latent_shape())

    def vocoder(self, trainer: Any) -> nn.Module:
        """The vocoder (the folder's, else built from the size's table), built once, on the host."""
        if self._vocoder is None:
            from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

            self._vocoder = trainer.load_component("vocoder", LTX2Vocoder, "cpu", torch.float32).eval()
        return self._vocoder

    @staticmethod
    def _embeds(cond: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.cat([cond["prompt_embeds"], cond["audio_prompt_embeds"]], dim=-1).to(device),
                cond["prompt_attention_mask"].to(device))

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor],
                 negative: dict | None, *, steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: Any) -> Any:
        vae, avae = modules["vae"], modules.get("audio_vae")
        width = int(cond["prompt_embeds"].shape[-1])
        pipe = trainer.pipeline_class()(scheduler=self.scheduler(trainer), vae=vae, audio_vae=avae, text_encoder=None,
                                        tokenizer=None, connectors=PrecomputedConnectors(width, device), vocoder=None,
                                        transformer=modules["transformer"])
        pipe.set_progress_bar_config(disable=True)
        embeds, mask = self._embeds(cond, device)
        kw: dict[str, Any] = {}
        if negative is not None:
            kw["negative_prompt_embeds"], kw["negative_prompt_attention_mask"] = self._embeds(negative, device)
        clips, g = trainer.clips, guidance if negative is not None else 1.0
        with torch.no_grad():
            latents, audio_latents = pipe(
                prompt_embeds=embeds, prompt_attention_mask=mask, height=clips.height, width=clips.width,
                num_frames=clips.frames, frame_rate=float(clips.fps), num_inference_steps=steps, guidance_scale=g,
                audio_guidance_scale=7.0 if g > 1 else 1.0, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
                audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0, generator=generator,
                output_type="latent", return_dict=False, **kw)
            with vae_on_device():
                video = vae.decode(latents.to(next(vae.parameters()).dtype), return_dict=False)[0]
            frames = pipe.video_processor.postprocess_video(video.float(), output_type="pil")[0]
            audio = None
            if avae is not None and trainer.audio:
                mel = avae.decode(audio_latents.to("cpu", next(avae.parameters()).dtype), return_dict=False)[0]
                voc = self.vocoder(trainer)
                audio = voc(mel.float().to(next(voc.parameters()).dtype))[0].float().cpu()
                rate = int(getattr(voc.config, "output_sampling_rate", 24000))
        return AudioVideoSample(frames, float(clips.fps), audio, rate if audio is not None else 0)
