"""Sampling for Qwen-Image-Edit: ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` with the prompt's reference.

Qwen-Image-Edit's text encoder sees the reference, so a prompt cannot be encoded without it: the
sampler calls :meth:`QwenImageEditSampling.encode_reference` with the prompt and the negative prompt
(``text_sees_reference``), at the start, while the text encoder is still there (plugins may drop it
later). The embeddings are the pipeline's own ``encode_prompt`` of the reference as the pipeline's
``__call__`` prepares it (Edit: resized to ~1 MP; Plus: to 384^2 pixels' area), so a sample is what
the pipeline gives for that prompt and image. The denoising is the pipeline's, handed the reference
as an image: it resizes it to ~1 MP and VAE-encodes it itself (its ``image`` argument reads
``image.size``, so latents cannot be handed in). The trade-off: a sample's reference costs ~1 MP of
tokens whatever ``sample.resolution`` is, as in the pipeline; the decode is ours (``vae_on_device``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.families.qwen_image.sampling import QwenImageSampling
from runner.sampling.pipelines import decode_video
from runner.trainer import ModelSet

PIPELINE_AREA = 1024 * 1024  # the pipelines' calculate_dimensions(1024 * 1024, ratio) for the reference


class QwenImageEditSampling(QwenImageSampling):
    """Qwen-Image's sampling with each prompt's reference seen by the text encoder and the transformer."""

    takes_references = True
    text_sees_reference = True

    def encode(self, trainer: Any, models: ModelSet, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        """Nothing without the reference: :meth:`encode_reference` encodes the prompt with it."""
        return {}

    @staticmethod
    def pipeline_images(trainer: Any, pipe: Any, pixels: torch.Tensor) -> tuple[list[Any], list[Any]]:
        """``[N, 3, H, W]`` references -> (what the pipeline's ``encode_prompt`` sees, what its ``__call__`` is
        handed): Edit's prompt image is the reference resized to ~1 MP, Plus's each resized to 384^2 area."""
        from runner.families.common.pixels import to_pil
        from runner.families.qwen_image_edit.images import CONDITION_IMAGE_AREA, calculate_dimensions

        images = [to_pil(p) for p in pixels]
        area = CONDITION_IMAGE_AREA if trainer.variant == "plus" else PIPELINE_AREA
        seen = []
        for im in images:
            w, h = calculate_dimensions(area, im.size[0] / im.size[1])
            seen.append(pipe.image_processor.resize(im, h, w))
        return seen, images

    @torch.no_grad()
    def encode_reference(self, trainer: Any, models: ModelSet, pixels: torch.Tensor, device: torch.device, *,
                         prompt: str, negative: str | None) -> dict[str, torch.Tensor]:
        """``[1, N, 3, H, W]`` reference pixels -> the prompt's (and negative prompt's) embeddings from the
        pipeline's ``encode_prompt`` with the reference, and the pixels themselves, on the host."""
        pipe = trainer.pipeline_class()(scheduler=self.scheduler(trainer), vae=models["vae"],
                                        text_encoder=models["text_encoder"], tokenizer=trainer.tokenizer("tokenizer"),
                                        transformer=None, **trainer.pipeline_kwargs())
        pipe.prompt_template_encode_start_idx = trainer.template_tokens()  # as trainer.pipeline sets it
        seen, _ = self.pipeline_images(trainer, pipe, pixels[0])
        image = seen if trainer.variant == "plus" else seen[0]
        out = {"reference_pixels": pixels.detach().to("cpu")}
        for key, text in (("prompt_embeds", prompt), ("negative_prompt_embeds", negative)):
            if text is not None:
                emb, _ = pipe.encode_prompt(prompt=text, image=image, device=device)
                out[key] = emb.detach().to("cpu")  # one prompt: every token valid
        return out

    def generate(self, trainer: Any, modules: Mapping[str, nn.Module], cond: dict[str, torch.Tensor],
                 negative: dict | None, *, steps: int, guidance: float, resolution: int, generator: torch.Generator,
                 device: torch.device, vae_on_device: Any) -> Any:
        vae = modules["vae"]
        pipe = trainer.pipeline_class()(scheduler=self.scheduler(trainer), vae=vae, text_encoder=None, tokenizer=None,
                                        processor=None, transformer=modules["transformer"])
        pipe.set_progress_bar_config(disable=True)
        _, images = self.pipeline_images(trainer, pipe, cond["reference_pixels"][0])
        emb = cond["prompt_embeds"].to(device)
        kw: dict[str, Any] = {}
        if "negative_prompt_embeds" in cond:
            neg = cond["negative_prompt_embeds"].to(device)
            kw = {"negative_prompt_embeds": neg,
                  "negative_prompt_embeds_mask": torch.ones(neg.shape[:2], device=device, dtype=torch.long)}
        with vae_on_device():  # the pipeline VAE-encodes the reference itself
            packed = pipe(image=images if trainer.variant == "plus" else images[0], prompt_embeds=emb,
                          prompt_embeds_mask=torch.ones(emb.shape[:2], device=device, dtype=torch.long),
                          true_cfg_scale=guidance, num_inference_steps=steps, height=resolution, width=resolution,
                          generator=generator, output_type="latent", return_dict=False, **kw)[0]
        latents = pipe._unpack_latents(packed, resolution, resolution, pipe.vae_scale_factor)
        image = decode_video(vae, latents, vae_on_device)[:, :, 0]
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]
