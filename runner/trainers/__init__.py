"""Built-in trainers. Importing this package registers ``trainer=sdxl``, ``flux``, ``flux_kontext``, ``flux2`` (and ``flux2_klein``),
``chroma``, ``sd15``, ``sd35``, ``qwen_image``, ``qwen_image_edit``, ``wan`` (and its Wan 2.2 options ``wan22_a14b``,
``wan22_5b``), ``z_image`` and ``lumina2``.

Registered by the path of their class, with their schema from runner/trainers/configs.py and their
loss objective: the trainer modules import torch and diffusers, and are imported only when a run
builds the trainer (``loss.*`` options are checked against the registered objective before that).
"""
from runner.loss.config import DDPM, FLOW
from runner.registry import register_trainer
from runner.trainers.configs import (
    SD15_NATIVE_RESOLUTION,
    WAN_NATIVE_RESOLUTION,
    ChromaTrainerConfig,
    Flux2KleinTrainerConfig,
    Flux2TrainerConfig,
    FluxKontextTrainerConfig,
    FluxTrainerConfig,
    Lumina2TrainerConfig,
    QwenImageEditTrainerConfig,
    QwenImageTrainerConfig,
    SD15TrainerConfig,
    SD35TrainerConfig,
    SDXLTrainerConfig,
    Wan22_5BTrainerConfig,
    Wan22A14BTrainerConfig,
    WanTrainerConfig,
    ZImageTrainerConfig,
)

register_trainer("sdxl", "runner.trainers.sdxl.SDXLTrainer", SDXLTrainerConfig, "SDXL U-Net, DDPM loss",
                 objective=DDPM)
register_trainer("flux", "runner.trainers.flux.FluxTrainer", FluxTrainerConfig,
                 "Flux transformer, rectified-flow matching loss", objective=FLOW)
register_trainer("flux_kontext", "runner.trainers.flux_kontext.FluxKontextTrainer", FluxKontextTrainerConfig,
                 "Flux.1 Kontext (edit) transformer: reference images (data.references=1) join the sequence, "
                 "rectified-flow matching loss on the target", objective=FLOW)
register_trainer("flux2", "runner.trainers.flux2.Flux2Trainer", Flux2TrainerConfig,
                 "Flux.2 dev transformer (32 B, Mistral-Small-3.1 text encoder), optional reference images "
                 "(data.references=1..4), rectified-flow matching loss", objective=FLOW)
register_trainer("flux2_klein", "runner.trainers.flux2.Flux2Trainer", Flux2KleinTrainerConfig,
                 "trainer=flux2 with trainer.variant=klein: FLUX.2 klein 4B (Qwen3-4B; trainer.variant=klein-9b for "
                 "the 9B)", objective=FLOW)
register_trainer("chroma", "runner.trainers.chroma.ChromaTrainer", ChromaTrainerConfig,
                 "Chroma transformer (8.9 B, Flux-derived, T5 only), rectified-flow matching loss", objective=FLOW)
register_trainer("sd15", "runner.trainers.sd15.SD15Trainer", SD15TrainerConfig,
                 "SD1.5 / SD2.1 U-Net (trainer.variant=sd15|sd21), DDPM loss (epsilon or v)",
                 native_resolution=SD15_NATIVE_RESOLUTION, objective=DDPM)
register_trainer("sd35", "runner.trainers.sd35.SD35Trainer", SD35TrainerConfig,
                 "SD3.5 Medium / Large transformer (trainer.variant=medium|large), rectified-flow matching loss",
                 objective=FLOW)
register_trainer("qwen_image", "runner.trainers.qwen_image.QwenImageTrainer", QwenImageTrainerConfig,
                 "Qwen-Image MMDiT (20 B), Qwen2.5-VL text encoder, rectified-flow matching loss", objective=FLOW)
register_trainer("qwen_image_edit", "runner.trainers.qwen_image_edit.QwenImageEditTrainer", QwenImageEditTrainerConfig,
                 "Qwen-Image-Edit MMDiT (trainer.variant=edit|plus): reference images (data.references) join the "
                 "sequence and Qwen2.5-VL sees them with the instruction, rectified-flow matching loss on the target",
                 objective=FLOW)
register_trainer("wan", "runner.trainers.wan.WanTrainer", WanTrainerConfig,
                 "Wan 2.1/2.2 text-to-video transformer (trainer.variant=14b|1.3b|2.2-5b|2.2-a14b; image-to-video: "
                 "i2v-2.1-14b|i2v-2.2-a14b), rectified-flow matching loss",
                 native_resolution=WAN_NATIVE_RESOLUTION, objective=FLOW)
register_trainer("wan22_a14b", "runner.trainers.wan.WanTrainer", Wan22A14BTrainerConfig,
                 "trainer=wan with trainer.variant=2.2-a14b trainer.experts=both: Wan 2.2 T2V A14B, both experts in one "
                 "run, switched by timestep (trainer.experts=high or low: one expert per run)", native_resolution=WAN_NATIVE_RESOLUTION, objective=FLOW)
register_trainer("wan22_5b", "runner.trainers.wan.WanTrainer", Wan22_5BTrainerConfig,
                 "trainer=wan with trainer.variant=2.2-5b: Wan 2.2 TI2V-5B in its text-to-video mode",
                 native_resolution=WAN_NATIVE_RESOLUTION, objective=FLOW)
register_trainer("z_image", "runner.trainers.z_image.ZImageTrainer", ZImageTrainerConfig,
                 "Z-Image single-stream DiT (6.2 B), Qwen3-4B text encoder, rectified-flow matching loss", objective=FLOW)
register_trainer("lumina2", "runner.trainers.lumina2.Lumina2Trainer", Lumina2TrainerConfig,
                 "Lumina-Image 2.0 unified NextDiT (2.6 B), Gemma-2 2B text encoder, rectified-flow matching loss",
                 objective=FLOW)
