"""Built-in trainers. Importing this package registers ``trainer=sdxl`` and ``trainer=flux``.

Registered by the path of their class, with their schema from runner/trainers/configs.py: the
trainer modules import torch and diffusers, and are imported only when a run builds the trainer.
"""
from runner.registry import register_trainer
from runner.trainers.configs import FluxTrainerConfig, SDXLTrainerConfig

register_trainer("sdxl", "runner.trainers.sdxl.SDXLTrainer", SDXLTrainerConfig, "SDXL U-Net, DDPM loss")
register_trainer("flux", "runner.trainers.flux.FluxTrainer", FluxTrainerConfig,
                 "Flux transformer, rectified-flow matching loss")
