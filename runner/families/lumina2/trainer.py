"""Lumina 2: train the 2.6 B unified NextDiT (fully or with LoRA) with the rectified-flow loss.

Lumina-Image-2.0 (Alpha-VLLM) puts caption and image tokens into one sequence
(``Lumina2Transformer2DModel``: context and noise refiner blocks, then 26 joint blocks),
conditioned on Gemma-2 2B and decoded by FLUX.1's VAE (``(z - shift_factor) * scaling_factor``).

Conditioning as diffusers' ``Lumina2Pipeline.encode_prompt`` computes it: the caption prefixed with
the pipeline's system prompt and ``" <Prompt Start> "``, tokenized to ``max_sequence_length``
(256) with padding, run through Gemma-2 with the tokenizer's mask, and the **second-to-last**
hidden state kept with that mask. The transformer counts each caption's tokens from the mask
(``mask.sum(dim=1)``) and places the image tokens right after them, so the mask goes to it as the
pipeline passes it.

The conventions are Z-Image's (runner/families/z_image/trainer.py), and ``predict`` converts both: the
transformer's timestep is ``1 - sigma``, and it predicts ``x0 - noise`` (the pipeline negates it).

Loss: the flow-matching family's (runner/families/common/flow.py), ``t`` logit-normal and unshifted by
default (``loss.*`` changes it).
"""
from __future__ import annotations

from typing import Any

import torch

from runner.errors import UserError
from runner.families.common.flow import FlowMatchTrainer
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.common.tokenizers import qwen2_tokenizer
from runner.families.lumina2 import architecture as lumina2_configs
from runner.families.lumina2.config import Lumina2TrainerConfig
from runner.trainer import Batch, EncodePart, ModelSet, batch_device

# Alpha-VLLM/Lumina-Image-2.0's scheduler: a static shift of 6.0, as recalled from its scheduler_config.json;
# not checked against the file here (none could be fetched). Used only when model.path has no scheduler/.
LUMINA2_SCHEDULER = {"num_train_timesteps": 1000, "shift": 6.0, "use_dynamic_shifting": False}


class Lumina2Trainer(FlowMatchTrainer):
    """Lumina 2 unified NextDiT, rectified-flow matching loss."""

    Config = Lumina2TrainerConfig
    denoiser = "transformer"
    display_name = "Lumina 2"
    reference_repo = "Alpha-VLLM/Lumina-Image-2.0"
    kohya_lora = False  # no kohya layout for Lumina 2: the diffusers file, and the ComfyUI one below
    comfy_layout = "lumina2"  # diffusion_model.<original NextDiT name>; q/k/v fused (runner/export/comfy.py)
    family = "lumina2"

    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        length = cfg.trainer.get("max_sequence_length")
        default = lumina2_configs.LUMINA2_MAX_SEQUENCE_LENGTH
        self.max_sequence_length = int(default if length is None else length)
        limit = int(lumina2_configs.lumina2_configs(self.size)["transformer"]["axes_lens"][0]) - 1
        if not 1 <= self.max_sequence_length <= limit or (length is not None and int(length) != float(length)):
            raise UserError(f"trainer.max_sequence_length={length!r} is not valid: give a whole number of tokens from 1 "
                            f"to {limit} (the transformer's caption positions, axes_lens[0]), or null for {default}.")

    def _open_single_file(self, file: str) -> None:
        """A diffusers-layout transformer file loads as for every family; Lumina 2's original layout
        (ComfyUI's lumina_2 files) is refused before any weight is read. Why: diffusers' converter
        hard-codes the full model's widths, so the runner cannot check it at the tiny size."""
        super()._open_single_file(file)
        if self.layout is not None:
            raise UserError(
                f"model.path '{file}' is in {self.layout.name}, which trainer=lumina2 does not read. Give model.path "
                "a diffusers folder (e.g. a download of Alpha-VLLM/Lumina-Image-2.0), or convert the file once with "
                "diffusers' Lumina2Transformer2DModel.from_single_file(...).save_pretrained(<folder>, "
                "max_shard_size='100GB') and give model.path=<folder>/diffusion_pytorch_model.safetensors "
                "(a diffusers-layout transformer file)."
            )

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKL, Lumina2Transformer2DModel
        from transformers import Gemma2Model

        return {"transformer": Lumina2Transformer2DModel, "vae": AutoencoderKL, "text_encoder": Gemma2Model}

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return lumina2_configs.lumina2_configs(self.size)

    def default_tokenizer(self, name: str) -> Any:
        return qwen2_tokenizer(1024)

    def pipeline_class(self) -> type:
        return pipeline_class("Lumina2Pipeline")

    def inference_scheduler(self) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(**LUMINA2_SCHEDULER)

    def sampling_family(self) -> Any:
        from runner.families.lumina2.sampling import Lumina2Sampling

        return Lumina2Sampling()

    # -- encoding --------------------------------------------------------------------------------
    def encode_parts(self) -> dict[str, EncodePart]:
        return {"latents": EncodePart(("vae",), self.image_inputs()), "text": EncodePart(("text_encoder",), ("caption",))}

    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior, or Gemma-2's second-to-last hidden state of the system-prompted caption
        with the tokenizer's mask, as ``Lumina2Pipeline.encode_prompt``."""
        if part == "latents":
            return self.encode_latents(models, batch)
        device = batch_device(batch)
        texts = [f"{lumina2_configs.LUMINA2_SYSTEM_PROMPT} <Prompt Start> {c}" for c in batch["caption"]]
        tokens = self.tokenizer("tokenizer")(texts, padding="max_length", max_length=self.max_sequence_length,
                                             truncation=True, return_tensors="pt")
        mask = tokens.attention_mask.to(device)
        hidden = models["text_encoder"](tokens.input_ids.to(device), attention_mask=mask,
                                        output_hidden_states=True).hidden_states[-2]
        return {"prompt_embeds": hidden, "prompt_attention_mask": mask.bool()}

    # -- the denoiser ----------------------------------------------------------------------------
    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The velocity (``noise - x0``): the transformer's output negated, called as the pipeline calls it."""
        transformer = models["transformer"]
        dt = compute_dtype(transformer)
        return -transformer(
            hidden_states=noisy.to(dt),
            timestep=1.0 - timesteps.float(),  # the pipeline's 1 - t / 1000 (float32)
            encoder_hidden_states=batch["prompt_embeds"].to(dt),
            encoder_attention_mask=batch["prompt_attention_mask"],
            return_dict=False,
        )[0]

    # -- shapes for the planner ------------------------------------------------------------------
    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives at ``data.resolution``: every caption at
        ``max_sequence_length`` tokens (all-true mask), the longest sequence a run can see."""
        b, length = batch_size, self.max_sequence_length
        width = int(self.component_config("text_encoder")["hidden_size"])
        return {
            "latents": self.example_latents(b, device),
            "prompt_embeds": self.example_tensor((b, length, width), device, self.storage_dtype, 1),
            "prompt_attention_mask": torch.ones((b, length), dtype=torch.bool, device=device),
            "sample_seed": self.example_seeds(b, device),
        }
