"""Built-in trainers. Importing this package registers ``trainer=sdxl``, ``flux``, ``flux_kontext``, ``chroma``, ``sd15``, ``sd35``,
``qwen_image``, ``qwen_image_edit`` and ``wan``.

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
    FluxKontextTrainerConfig,
    FluxTrainerConfig,
    QwenImageEditTrainerConfig,
    QwenImageTrainerConfig,
    SD15TrainerConfig,
    SD35TrainerConfig,
    SDXLTrainerConfig,
    WanTrainerConfig,
)

register_trainer("sdxl", "runner.trainers.sdxl.SDXLTrainer", SDXLTrainerConfig, "SDXL U-Net, DDPM loss",
                 objective=DDPM)
register_trainer("flux", "runner.trainers.flux.FluxTrainer", FluxTrainerConfig,
                 "Flux transformer, rectified-flow matching loss", objective=FLOW)
register_trainer("flux_kontext", "runner.trainers.flux_kontext.FluxKontextTrainer", FluxKontextTrainerConfig,
                 "Flux.1 Kontext (edit) transformer: reference images (data.references=1) join the sequence, "
                 "rectified-flow matching loss on the target", objective=FLOW)
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
                 "Wan 2.1/2.2 text-to-video transformer (trainer.variant=14b|1.3b|2.2-5b), rectified-flow matching loss",
                 native_resolution=WAN_NATIVE_RESOLUTION, objective=FLOW)
