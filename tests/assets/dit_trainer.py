"""The "any trainer" fixture: a user's managed-mode trainer that shares nothing with SDXL or Flux.

Run it with::

    PYTHONPATH=tests/assets python -m runner trainer=custom trainer._target_=dit_trainer.ClassConditionalDiT

It trains a class-conditional diffusers ``DiTTransformer2DModel`` (tiny, built from a config
dict, random init, nothing downloaded) with an epsilon-prediction DDPM loss on its own synthetic
"latents". Deliberately unlike the built-in trainers, so that every shipped preset must work
without assuming their shape: one module, named ``denoiser`` (not ``unet``/``transformer``); no
VAE, no text encoder, no ``encode`` step; no ``pixel_values`` or captions in its batches; the
options come from ``trainer.options`` (e.g. ``+trainer.options.num_layers=4``), not from keys of
the built-in trainers' configs; no LoRA or dtype code (the runner applies ``model.train=lora``,
``model.dtype`` and ``model.train_dtype`` to any trainer's modules). The trade-off: it covers what a preset may assume of a trainer
(only the protocol of runner/trainer.py), not how well a DiT trains.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, DiTTransformer2DModel
from diffusers.models.embeddings import LabelEmbedding
from omegaconf import OmegaConf

from runner.errors import UserError
from runner.trainer import ModelSet, per_sample_rand, per_sample_randn

DEFAULTS: dict[str, Any] = {
    "num_classes": 4, "channels": 4, "latent_size": 8, "num_samples": 16, "seed": 0,
    "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8, "patch_size": 2,
    "label_drop": 0.1,  # share of samples trained unconditionally (classifier-free guidance's null class)
}


class ClassConditionalDiT:
    """A DiT denoiser trained on seeded class-prototype "latents" with integer class labels."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        options = cfg.trainer.get("options") or {}
        given = OmegaConf.to_container(options, resolve=True) if OmegaConf.is_config(options) else dict(options)
        unknown = sorted(set(given) - set(DEFAULTS))
        if unknown:
            raise UserError(f"Unknown trainer.options {unknown} for dit_trainer. Valid: {', '.join(sorted(DEFAULTS))}.")
        self.opt = {**DEFAULTS, **given}
        self.scheduler = DDPMScheduler(num_train_timesteps=1000)

    def build_models(self, device: str | torch.device = "cpu") -> ModelSet:
        o = self.opt
        with torch.device(device):  # on "meta" (the planner) nothing is allocated
            dit = DiTTransformer2DModel(
                num_attention_heads=o["num_attention_heads"], attention_head_dim=o["attention_head_dim"],
                in_channels=o["channels"], num_layers=o["num_layers"], sample_size=o["latent_size"],
                patch_size=o["patch_size"], num_embeds_ada_norm=o["num_classes"])
        for m in dit.modules():
            if isinstance(m, LabelEmbedding):
                # diffusers drops labels with the global RNG, which depends on how a batch is split;
                # loss() drops them per sample instead. The null-class row stays in the table.
                m.dropout_prob = 0.0
        dit.train()
        return ModelSet({"denoiser": dit}, trained={"denoiser"})

    def dataset(self) -> list[dict[str, Any]]:
        """Class i's samples are a seeded prototype plus small noise: something a denoiser can learn."""
        o = self.opt
        g = torch.Generator().manual_seed(int(o["seed"]))
        shape = (o["channels"], o["latent_size"], o["latent_size"])
        prototypes = torch.randn((o["num_classes"], *shape), generator=g)
        return [{"latents": prototypes[i % o["num_classes"]] + 0.1 * torch.randn(shape, generator=g),
                 "class_label": i % o["num_classes"]} for i in range(o["num_samples"])]

    def loss(self, models: ModelSet, batch: dict[str, Any]) -> torch.Tensor:
        x0, seeds = batch["latents"], batch["sample_seed"]
        noise = per_sample_randn(seeds, tuple(x0.shape[1:]), x0.device, x0.dtype)
        steps = self.scheduler.config.num_train_timesteps
        t = (per_sample_rand(seeds, salt=1, device=x0.device) * steps).long().clamp(max=steps - 1)
        drop = per_sample_rand(seeds, salt=2, device=x0.device) < self.opt["label_drop"]
        labels = torch.where(drop, self.opt["num_classes"], batch["class_label"])
        noisy = self.scheduler.add_noise(x0, noise, t)
        pred = models["denoiser"](noisy, timestep=t, class_labels=labels).sample
        return F.mse_loss(pred.float(), noise.float())

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> dict[str, Any]:
        o = self.opt
        seeds_on = "cpu" if torch.device(device).type == "meta" else device  # read with tolist()
        return {"latents": torch.zeros(batch_size, o["channels"], o["latent_size"], o["latent_size"], device=device),
                "class_label": torch.arange(batch_size, device=device) % o["num_classes"],
                "sample_seed": torch.arange(batch_size, dtype=torch.int64, device=seeds_on)}
