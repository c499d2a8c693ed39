"""Wan image-to-video: train the 36-channel transformer (fully or with LoRA) to continue a clip's first frame.

``trainer=wan trainer.variant=i2v-2.1-14b`` (Wan2.1-I2V-14B-480P/720P) or ``i2v-2.2-a14b``
(Wan2.2-I2V-A14B, one expert per run: ``trainer.experts=high|low`` as for the text-to-video A14B,
split at the folder's ``boundary_ratio``, else 0.9); runner/families/wan/architecture.py has the
architectures. :class:`runner.families.wan.trainer.WanTrainer` hands these variants to this subclass, and
everything text-to-video (clips, UMT5 text, the flow loss over the whole clip, the expert's t range)
is its. What differs is exactly what diffusers' ``WanImageToVideoPipeline`` feeds the transformer:

* **The condition.** The start image followed by ``F - 1`` zero frames (black-grey: 0 in [-1, 1]),
  VAE-encoded with the posterior's mode (``retrieve_latents(..., sample_mode="argmax")``, the mean)
  and normalised like the latents (per channel, ``latents_mean``/``latents_std``), after a 4-channel
  mask that is 1 on the first latent frame (the start image's 4 "pixel frames") and 0 elsewhere:
  ``[mask (4), condition latents (16)]``, concatenated after the noisy latents on channels (16 + 20 =
  the transformer's 36 ``in_channels``). Nothing of the condition is noised.
* **CLIP image tokens (Wan 2.1 only).** The start image through ``CLIPImageProcessor`` (shortest
  side 224, centre crop, CLIP mean/std) and the CLIP ViT-H/14 vision tower; the penultimate hidden
  state (257 tokens of width 1280) is ``encoder_hidden_states_image``, which the transformer
  projects and prepends to the text for cross-attention. Wan 2.2 I2V A14B has no image encoder.

The start image is each training clip's own first frame (``pixel_values[:, :, 0]``), so it has the
clip's crop and flip by construction; the condition is cached with the clip's latents (the latents
part reads the pixels) and the CLIP tokens as a part of their own (``image``, read from the pixels,
so ``offload.park.cache_latents`` caches it and can drop the image encoder). The cost: a second VAE
encode of a full clip per sample (the zero frames are encoded too, as the pipeline does: the causal
VAE's later latent frames depend on the start image), paid once when latents are cached.

Samples (runner/families/wan/i2v_sampling.py) start from ``sample.references`` (one image per prompt) or,
unset, from training clip i's first frame for prompt i.
"""
from __future__ import annotations

from typing import Any

import torch

from runner.errors import UserError
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.wan import architecture as configs
from runner.families.wan.trainer import WanTrainer
from runner.trainer import Batch, EncodePart, ModelSet


class WanI2VTrainer(WanTrainer):
    """Wan 2.1 / 2.2 image-to-video transformer; see the module docstring."""

    display_name = "Wan I2V"

    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        if self.expert is not None:
            self.boundary = configs.i2v_boundary(self.source)  # Wan 2.2 I2V's 0.9, or the folder's
        self._image_processor: Any = None
        self.check_transformer()

    def check_transformer(self) -> None:
        """The transformer ``model.path`` gives must be this variant's (36 input channels; the image
        cross-attention exactly for Wan 2.1), refused before step 1 rather than at the first forward."""
        t = self.component_config("transformer")
        want = configs.MASK_CHANNELS + 2 * int(self.component_config("vae")["z_dim"])
        image_dim = t.get("image_dim")
        problem = None
        if int(t.get("in_channels", 0)) != want:
            problem = (f"takes {t.get('in_channels')} input channels, where image-to-video takes {want} (noisy latents, "
                       "the first-frame mask and the condition latents): it is a text-to-video model")
        elif self.image_encoder and image_dim is None:
            problem = "has no image cross-attention (image_dim): it is Wan 2.2 I2V A14B's, trainer.variant=i2v-2.2-a14b"
        elif not self.image_encoder and image_dim is not None:
            problem = f"has an image cross-attention (image_dim={image_dim}): it is Wan 2.1 I2V's, trainer.variant=i2v-2.1-14b"
        if problem:
            where = f"model.path={self.source[1]!r}" if self.source is not None else "the configured transformer"
            raise UserError(f"{where}: its transformer {problem}; trainer.variant={self.variant} needs "
                            f"{'Wan2.1-I2V-14B-480P/720P' if self.image_encoder else 'Wan2.2-I2V-A14B'} (diffusers "
                            "folder or original file). Give that model, or the trainer.variant that matches this one.")

    def check_expert(self, expert: Any) -> str | None:
        return configs.check_i2v_expert(self.variant, expert)

    @property
    def image_encoder(self) -> bool:
        """Whether the variant feeds CLIP image tokens (Wan 2.1 I2V)."""
        return configs.has_image_encoder(self.variant)

    def module_classes(self) -> dict[str, type]:
        classes = super().module_classes()
        if self.image_encoder:
            from transformers import CLIPVisionModel

            classes["image_encoder"] = CLIPVisionModel
        return classes

    def pipeline_class(self) -> type:
        return pipeline_class(configs.I2V_PIPELINE)

    def pipeline_kwargs(self) -> dict[str, Any]:
        """The pipeline's ``image_processor`` (Wan 2.1; the one this run's CLIP tokens come from)."""
        kw = super().pipeline_kwargs()
        if self.image_encoder:
            kw["image_processor"] = self.image_processor()
        return kw

    def sampling_family(self) -> Any:
        from runner.families.wan.i2v_sampling import WanI2VSampling

        return WanI2VSampling(self.spatial_factor() * 2)

    def image_processor(self) -> Any:
        """``CLIPImageProcessor``: the folder's ``image_processor/``, else the published settings at the
        image tower's input size (224 px at full size, 32 px for the tiny tower)."""
        if self._image_processor is None:
            # The PIL processor, which CLIPImageProcessor falls back to (with a warning) without torchvision.
            from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as CLIPImageProcessor

            if self._folder_has("image_processor"):
                self._image_processor = CLIPImageProcessor.from_pretrained(
                    self.source[1], subfolder="image_processor", local_files_only=True)
            else:
                side = int(self.component_config("image_encoder")["image_size"])
                self._image_processor = CLIPImageProcessor(**configs.image_processor_config(side))
        return self._image_processor

    # -- encoding --------------------------------------------------------------------------------
    def encode_parts(self) -> dict[str, EncodePart]:
        """Wan's parts (the latents part now also holds the condition) plus, for Wan 2.1, ``image``: the
        CLIP tokens of the first frame, read from the pixels."""
        parts = super().encode_parts()
        if self.image_encoder:
            parts["image"] = EncodePart(("image_encoder",), ("pixel_values",))
        return parts

    def cache_signature(self, part: str) -> dict[str, Any]:
        sig = super().cache_signature(part)
        if part == "image":
            p = self.image_processor()
            sig["image_processor"] = {"size": dict(p.size), "crop_size": dict(p.crop_size), "mean": list(p.image_mean),
                                      "std": list(p.image_std), "resample": int(p.resample)}
        return sig

    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """Latents: Wan's posterior plus ``condition_mean`` (:meth:`encode_condition` of the first frame);
        image: ``image_embeds`` (:meth:`encode_image`); text: Wan's."""
        if part == "latents":
            out = self.encode_latents(models, batch)
            pixels = batch["pixel_values"]
            out["condition_mean"] = self.encode_condition(models, pixels[:, :, 0], int(pixels.shape[2]))
            return out
        if part == "image":
            return {"image_embeds": self.encode_image(models, batch["pixel_values"][:, :, 0])}
        return super().encode_part(models, part, batch)

    @staticmethod
    def encode_condition(models: ModelSet, first: torch.Tensor, frames: int) -> torch.Tensor:
        """``[B, 3, H, W]`` start images -> the VAE mode of each followed by ``frames - 1`` zero frames,
        ``[B, C, F', h, w]``, not yet normalised (``WanImageToVideoPipeline.prepare_latents``)."""
        vae = models["vae"]
        b, c, h, w = first.shape
        video = torch.cat([first.unsqueeze(2), first.new_zeros(b, c, frames - 1, h, w)], dim=2)
        return vae.encode(video.to(compute_dtype(vae))).latent_dist.mode().contiguous()

    def encode_image(self, models: ModelSet, first: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` start images in [-1, 1] -> the CLIP tower's penultimate hidden state
        (``WanImageToVideoPipeline.encode_image``): each image back to its 8-bit RGB, through the image
        processor. On ``meta`` (the planner) a shape-only input of the processor's crop size."""
        encoder = models["image_encoder"]
        processor = self.image_processor()
        if first.device.type == "meta":
            crop = processor.crop_size
            pixels = torch.empty((first.shape[0], 3, crop["height"], crop["width"]), device=first.device)
        else:
            from runner.families.common.pixels import to_pil

            pixels = processor(images=[to_pil(f) for f in first], return_tensors="pt").pixel_values
        out = encoder(pixel_values=pixels.to(first.device, compute_dtype(encoder)), output_hidden_states=True)
        return out.hidden_states[-2].contiguous()

    def condition(self, condition_mean: torch.Tensor) -> torch.Tensor:
        """``[mask (4), normalised condition latents]`` on channels, float32: the mask is 1 on the
        first latent frame (the start image) and 0 on the others, as the pipeline builds it."""
        latents = self.normalize_latents(condition_mean.float())
        b, _, f, h, w = latents.shape
        mask = latents.new_zeros(b, configs.MASK_CHANNELS, f, h, w)
        mask[:, :, 0] = 1
        return torch.cat([mask, latents], dim=1)

    def finish_encode(self, parts: dict[str, dict[str, torch.Tensor]], batch: Batch) -> Batch:
        """Wan's, plus ``condition`` (:meth:`condition`) and, for Wan 2.1, ``image_embeds``."""
        out = super().finish_encode(parts, batch)
        out["condition"] = self.condition(parts["latents"]["condition_mean"])
        if "image" in parts:
            out["image_embeds"] = parts["image"]["image_embeds"]
        return out

    # -- the denoiser ----------------------------------------------------------------------------
    def transformer_inputs(self, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch,
                           dtype: torch.dtype) -> dict[str, Any]:
        """The pipeline's transformer call: noisy latents then the condition on channels, ``1000 t``, the
        text states and (Wan 2.1) the CLIP tokens, in the transformer's compute dtype."""
        kw: dict[str, Any] = {
            "hidden_states": torch.cat([noisy, batch["condition"].to(noisy.device)], dim=1).to(dtype),
            "timestep": timesteps.float() * 1000,  # the scheduler's scale; the time embedder is kept in float32
            "encoder_hidden_states": batch["prompt_embeds"].to(dtype),
        }
        if "image_embeds" in batch:
            kw["encoder_hidden_states_image"] = batch["image_embeds"].to(dtype)
        return kw

    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        transformer = models["transformer"]
        return transformer(**self.transformer_inputs(noisy, timesteps, batch, compute_dtype(transformer)),
                           return_dict=False)[0]

    # -- shapes for the planner ------------------------------------------------------------------
    def image_tokens(self) -> tuple[int, int]:
        """(tokens, width) of the CLIP tower's hidden states: one per patch plus the class token."""
        c = self.component_config("image_encoder")
        return (int(c["image_size"]) // int(c["patch_size"])) ** 2 + 1, int(c["hidden_size"])

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """Wan's encoded batch plus the condition (mask + latents channels, the clip's latent frames) and,
        for Wan 2.1, the CLIP tokens: the planner runs the 36-channel input and the image cross-attention."""
        batch = super().example_batch(batch_size, device)
        c, f, h, w = self.latent_shape()
        batch["condition"] = self.example_tensor((batch_size, configs.MASK_CHANNELS + c, f, h, w), device,
                                                 torch.float32, 8)
        if self.image_encoder:
            batch["image_embeds"] = self.example_tensor((batch_size, *self.image_tokens()), device,
                                                        self.storage_dtype, 9)
        return batch
