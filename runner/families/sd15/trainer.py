"""SD1.5 and SD2.1: train the U-Net (fully or with LoRA) with the DDPM loss (epsilon or v).

One family, two variants (``trainer.variant``), as their diffusers folders differ only in configs:

* ``sd15`` (stable-diffusion-v1-5): ``UNet2DConditionModel`` with 768-wide cross-attention, the
  OpenAI CLIP ViT-L/14 text encoder (``CLIPTextModel``), epsilon prediction, 512 px;
* ``sd21`` (stabilityai/stable-diffusion-2-1): the same U-Net layout with linear projections,
  upcast attention and 1024-wide cross-attention, the OpenCLIP ViT-H/14 text tower in
  ``CLIPTextModel`` form (23 layers: the original's last layer is dropped, which is SD2's
  penultimate-layer conditioning), v-prediction, 768 px.

Conditioning as ``StableDiffusionPipeline`` encodes a prompt: the text encoder's last hidden state
(after its final layer norm); no pooled embedding and no added conditioning. Latents are the VAE
sample times ``scaling_factor`` (0.18215). The loss is the DDPM family's
(runner/families/common/ddpm.py) on SD's scaled-linear betas, with ``loss.*`` options.

The tiny configs keep each variant's structure (runner/families/sd15/architecture.py); the full ones
are the published ``config.json`` values, so ``mode=plan model.size=full`` plans the real model.
"""
from __future__ import annotations

from typing import Any

import torch

from runner.errors import UserError, valid_list
from runner.families.common.ddpm import NUM_TRAIN_TIMESTEPS, SD_NOISE_SCHEDULE, DDPMTrainer
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.common.model_configs import CLIP_MAX_LENGTH
from runner.families.common.tokenizers import clip_tokenizer, tokenize
from runner.families.sd15.architecture import sd15_configs
from runner.families.sd15.config import SD15_NATIVE_RESOLUTION, SD15TrainerConfig
from runner.trainer import Batch, EncodePart, ModelSet, batch_device

VARIANTS = ("sd15", "sd21")
# What each variant was trained with; trainer.prediction_type overrides it (SD2.1-base is epsilon).
PREDICTION = {"sd15": "epsilon", "sd21": "v_prediction"}
NATIVE_RESOLUTION = SD15_NATIVE_RESOLUTION
# kohya's ss_base_model_version, which A1111/Forge use to sort LoRAs by base model.
KOHYA_VERSION = {("sd15", "epsilon"): "sd_v1", ("sd21", "epsilon"): "sd_v2", ("sd21", "v_prediction"): "sd_v2_768_v",
                 ("sd15", "v_prediction"): "sd_v1"}




class SD15Trainer(DDPMTrainer):
    """SD1.5 / SD2.1 U-Net, DDPM loss (epsilon or v-prediction)."""

    Config = SD15TrainerConfig
    denoiser = "unet"
    display_name = "SD1.5/SD2.1"

    def __init__(self, cfg: Any, run: Any = None) -> None:
        self.variant = str(cfg.trainer.get("variant", "sd15"))
        if self.variant not in VARIANTS:
            raise UserError(f"Unknown trainer.variant '{self.variant}' for trainer=sd15. "
                            f"Valid values: {valid_list(self.variant, VARIANTS)}.")
        # An original SD1.x single file (runner/families/common/single_file.py) is read, and exported, for sd15 only:
        # SD2.x files hold OpenCLIP-H with a 24th layer this CLIPTextModel form drops.
        self.family = "sd" if self.variant == "sd15" else ""
        self.reference_repo = "stable-diffusion-v1-5/stable-diffusion-v1-5" if self.variant == "sd15" else ""
        super().__init__(cfg, run)
        self.kohya_base_model_version = KOHYA_VERSION[(self.variant, self.prediction_type)]

    def default_prediction_type(self) -> str:
        return PREDICTION[self.variant]

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel

        return {"unet": UNet2DConditionModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModel}

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return sd15_configs(self.variant, self.size)

    def default_tokenizer(self, name: str) -> Any:
        return clip_tokenizer(CLIP_MAX_LENGTH)

    def encode_parts(self) -> dict[str, EncodePart]:
        """One text encoder (the base's default has two)."""
        return {
            "latents": EncodePart(("vae",), self.image_inputs()),
            "text": EncodePart(("text_encoder",), ("caption",)),
        }

    def pipeline_class(self) -> type:
        return pipeline_class("StableDiffusionPipeline")

    def pipeline_kwargs(self) -> dict[str, Any]:
        """No safety checker: the published folders ship one, but it is not part of what is trained."""
        return {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}

    def inference_scheduler(self) -> Any:
        """The published folders' schedulers: SD1.5's PNDM, SD2.1's DDIM (each with its betas), with
        this run's prediction type."""
        from diffusers import DDIMScheduler, PNDMScheduler

        common = dict(num_train_timesteps=NUM_TRAIN_TIMESTEPS, steps_offset=1, prediction_type=self.prediction_type,
                      **SD_NOISE_SCHEDULE)
        if self.variant == "sd15":
            return PNDMScheduler(skip_prk_steps=True, set_alpha_to_one=False, **common)
        return DDIMScheduler(clip_sample=False, set_alpha_to_one=False, **common)

    def sampling_family(self) -> Any:
        from runner.families.sd15.sampling import SD15Sampling

        return SD15Sampling()

    # -- protocol -------------------------------------------------------------------------
    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior (mean, std), or the text encoder's last hidden state."""
        if part == "latents":
            return self.encode_latents(models, batch)
        te = models["text_encoder"]
        tok = self.tokenizer("tokenizer")
        ids = tokenize(tok, list(batch["caption"]), self.text_max_length(tok, te.config), batch_device(batch))
        return {"prompt_embeds": te(ids)[0]}

    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        unet = models["unet"]
        dt = compute_dtype(unet)
        return unet(noisy.to(dt), timesteps, encoder_hidden_states=batch["prompt_embeds"].to(dt), return_dict=False)[0]

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives at ``data.resolution``."""
        te = self.component_config("text_encoder")
        length = min(CLIP_MAX_LENGTH, int(te["max_position_embeddings"]))
        return {
            "latents": self.example_latents(batch_size, device),
            "prompt_embeds": self.example_tensor((batch_size, length, int(te["hidden_size"])), device, self.storage_dtype, 1),
            "sample_seed": self.example_seeds(batch_size, device),
        }
