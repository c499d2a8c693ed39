"""The built-in trainers' option schemas (``trainer=sdxl|flux|flux_kontext|flux2|chroma|sd15|sd35|qwen_image|qwen_image_edit|wan|z_image|lumina2``), importable without torch.

Hydra composes every run against the selected trainer's schema, and ``trainer=sdxl`` is the
default, so the schema must not import diffusers or torch (``--help`` and config errors answer
without them). The trainer classes (runner/trainers/sdxl.py, flux.py) take their ``Config``
from here; runner/trainers/__init__.py registers each option with its class's path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class SDXLTrainerConfig:
    _target_: str = "runner.trainers.sdxl.SDXLTrainer"
    prediction_type: str = "epsilon"  # epsilon | v_prediction


@dataclass
class FluxTrainerConfig:
    _target_: str = "runner.trainers.flux.FluxTrainer"
    guidance: float = 1.0  # value fed to the guidance embedding (guidance-distilled models only)


@dataclass
class FluxKontextTrainerConfig:
    _target_: str = "runner.trainers.flux_kontext.FluxKontextTrainer"
    guidance: float = 1.0  # value fed to the guidance embedding (FLUX.1 Kontext dev is guidance-distilled)


@dataclass
class Flux2TrainerConfig:
    _target_: str = "runner.trainers.flux2.Flux2Trainer"
    variant: str = "dev"  # dev (FLUX.2 dev, 32 B, Mistral-Small-3.1) | klein (4 B, Qwen3-4B) | klein-9b (9 B, Qwen3-8B)
    guidance: float = 1.0  # value fed to the guidance embedding (dev is guidance-distilled; klein has none)


# FLUX.2 klein as a trainer option of its own (trainer=flux2 with the variant set): a preset for it names the
# option instead of setting trainer.variant, so the preset still composes with any other trainer.
@dataclass
class Flux2KleinTrainerConfig(Flux2TrainerConfig):
    variant: str = "klein"  # klein (4 B) | klein-9b


@dataclass
class ChromaTrainerConfig:
    """Chroma has no trainer option of its own: no guidance embedding (it is not guidance-distilled),
    and T5's prompt length is the tokenizer's (512 for a real folder, the pipeline's limit)."""

    _target_: str = "runner.trainers.chroma.ChromaTrainer"


SD15_NATIVE_RESOLUTION = {"sd15": 512, "sd21": 768}  # px at model.size=full, by trainer.variant


@dataclass
class SD15TrainerConfig:
    _target_: str = "runner.trainers.sd15.SD15Trainer"
    variant: str = "sd15"  # sd15 (SD1.5, CLIP ViT-L, 512 px) | sd21 (SD2.1, OpenCLIP ViT-H, 768 px)
    prediction_type: Optional[str] = None  # epsilon | v_prediction; None = the variant's (sd15 epsilon, sd21 v)


@dataclass
class SD35TrainerConfig:
    _target_: str = "runner.trainers.sd35.SD35Trainer"
    variant: str = "large"  # large (8.1 B, 38 blocks) | medium (2.2 B, MMDiT-X)


@dataclass
class QwenImageTrainerConfig:
    _target_: str = "runner.trainers.qwen_image.QwenImageTrainer"
    # Text tokens after the template's dropped prefix; captions are truncated to it and padded to it
    # (masked). null: the pipeline's 512 (96 for the random tiny model's byte-level tokenizer).
    max_sequence_length: Optional[int] = None


@dataclass
class ZImageTrainerConfig:
    _target_: str = "runner.trainers.z_image.ZImageTrainer"
    # Caption tokens (chat template included) per prompt, zero-padded and masked; longer captions are
    # truncated. null: ZImagePipeline's default, 512.
    max_sequence_length: Optional[int] = None


@dataclass
class Lumina2TrainerConfig:
    _target_: str = "runner.trainers.lumina2.Lumina2Trainer"
    # Tokens of the system prompt and caption together, padded and masked; longer ones are truncated.
    # null: Lumina2Pipeline's default, 256.
    max_sequence_length: Optional[int] = None


@dataclass
class QwenImageEditTrainerConfig:
    _target_: str = "runner.trainers.qwen_image_edit.QwenImageEditTrainer"
    variant: str = "edit"  # edit (Qwen-Image-Edit, one reference) | plus (2509/2511, QwenImageEditPlusPipeline, up to 3)
    # Qwen-Image-Edit-2511's transformer flag (its config.json: zero_cond_t true): the reference tokens are modulated
    # at t=0. null: a model.path folder's config.json says (off when built from model.size or a single file, as
    # 2509); true: 2511 (variant=plus), for a single file or a random build; refused when a folder says otherwise.
    zero_cond_t: Optional[bool] = None
    # Instruction tokens kept after the reference's vision tokens; captions are truncated to it and the
    # embedding padded (masked) to the vision tokens plus it. null: 512 (96 for the tiny byte-level tokenizer).
    max_sequence_length: Optional[int] = None


WAN_NATIVE_RESOLUTION = {"14b": 480, "1.3b": 480, "2.2-5b": 704, "2.2-a14b": 480, "i2v-2.1-14b": 480,
                         "i2v-2.2-a14b": 480}  # px at model.size=full, by trainer.variant


@dataclass
class WanTrainerConfig:
    _target_: str = "runner.trainers.wan.WanTrainer"
    # image-to-video: variant i2v-2.1-14b (Wan 2.1 I2V 14B, CLIP image encoder) | i2v-2.2-a14b (Wan 2.2 I2V A14B,
    # trainer.experts=high|low at its 0.9 boundary): runner/trainers/wan_i2v.py
    variant: str = "14b"  # 14b | 1.3b (Wan 2.1 T2V) | 2.2-5b (Wan 2.2 TI2V-5B, text-to-video) | 2.2-a14b (Wan 2.2 T2V A14B)
    experts: Optional[str] = None  # 2.2-a14b only: both (switch by timestep) | high (t >= 0.875, transformer/) | low (transformer_2/)
    # UMT5 tokens per caption (zero-padded); null: the pipeline's 512 (64 for the random tiny model).
    max_sequence_length: Optional[int] = None


# The Wan 2.2 models as trainer options of their own: trainer=wan with the variant (and expert) set.
# A preset for one of them names the option instead of setting trainer.* keys, so the preset still
# composes with any other trainer (trainer=custom, sdxl, ...), which has no trainer.variant.
@dataclass
class Wan22A14BTrainerConfig(WanTrainerConfig):
    variant: str = "2.2-a14b"
    experts: Optional[str] = "both"  # both experts in one run (runner/trainers/wan_experts.py); high|low: one of them


@dataclass
class Wan22_5BTrainerConfig(WanTrainerConfig):
    variant: str = "2.2-5b"
