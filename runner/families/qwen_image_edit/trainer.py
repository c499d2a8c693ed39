"""Qwen-Image-Edit: train the edit MMDiT (fully or with LoRA) on targets with reference images.

Qwen/Qwen-Image-Edit (``trainer.variant=edit``) and its multi-image successors Qwen-Image-Edit-2509
and -2511 (``trainer.variant=plus``, ``QwenImageEditPlusPipeline``) have Qwen-Image's modules (the
20 B ``QwenImageTransformer2DModel``, the Wan-style VAE, Qwen2.5-VL-7B); everything Qwen-Image's is
reused from runner/families/qwen_image/trainer.py. What differs is exactly what the diffusers pipelines do:

* **The text encoder sees the reference.** The prompt template holds the image
  (``<|vision_start|><|image_pad|><|vision_end|>`` before the instruction; Plus writes
  ``Picture k: `` before each of its images); Qwen2.5-VL's vision tower encodes the reference's
  14 px patches (``pixel_values``, ``image_grid_thw`` from Qwen2-VL's image processor), each 2x2 of
  them becomes one ``<|image_pad|>`` token, and the language model's last hidden state after the
  template's first 64 tokens (the system line: ``prompt_template_encode_start_idx``; counted with
  this run's tokenizer) is the text stream. So the cached embedding is a function of (instruction,
  reference): the text part reads ``references`` and park keys it by both.
* **What the vision tower sees.** Edit: the reference as the VAE sees it (the pipeline resizes both
  to ~1 MP; here both are the reference at the target's bucket size, ~1 MP at the preset's 1024 px).
  Plus: each reference resized (Lanczos, as ``VaeImageProcessor.resize``) to an area of 384^2 at
  its aspect ratio (the pipeline's ``CONDITION_IMAGE_SIZE``), ~196 vision tokens each.
* **Reference tokens join the image stream.** The references' VAE posterior mean (``argmax``),
  normalised with the VAE's per-channel statistics and packed 2x2, follow the target's tokens; the
  transformer's ``img_shapes`` lists the target's grid then each reference's, so its RoPE frames
  tell them apart; the output is cut to the target's tokens (the loss is on the target alone).

2511 differs from 2509 by one transformer flag, ``zero_cond_t`` (the reference tokens are modulated at
t=0, from ``img_shapes``): a folder's config.json carries it, ``trainer.zero_cond_t=true`` sets it for a
single file or a random build; ``predict`` passes the pipeline's ``img_shapes``, so the model applies it.

Fixed length: the instruction is truncated to ``trainer.max_sequence_length`` tokens and each row
zero-padded (masked) to the template's fixed tokens plus that, for the batch's reference size (a
batch is one bucket, so one vision-token count). The trade-off is the same as Qwen-Image's: one
shape per bucket for the cache and the planner, paid with padded (masked) text tokens.
"""
from __future__ import annotations

import copy
import math
import os
from typing import Any

import numpy as np
import torch
from PIL import Image

from runner.compat import unset_fake_temporarily
from runner.errors import UserError
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.common.pixels import to_pil
from runner.families.common.tokenizers import qwen2_vl_tokenizer
from runner.families.qwen_image.trainer import QwenImageTrainer
from runner.families.qwen_image_edit.config import QwenImageEditTrainerConfig
from runner.families.qwen_image_edit.images import CONDITION_IMAGE_AREA, calculate_dimensions
from runner.trainer import Batch, EncodePart, ModelSet, batch_device

VARIANTS = {"edit": "QwenImageEditPipeline", "plus": "QwenImageEditPlusPipeline"}
MAX_REFERENCES = {"edit": 1, "plus": 3}  # QwenImageEditPipeline takes one image; Plus is trained with 1-3
REFERENCE_REPOS = {"edit": "Qwen/Qwen-Image-Edit", "plus": "Qwen/Qwen-Image-Edit-2509"}
# QwenImageEditPipeline.prompt_template_encode / QwenImageEditPlusPipeline's (diffusers 0.35+).
_SYSTEM = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
           "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
           "image that meets the user's requirements while maintaining consistency with the original input where "
           "appropriate.<|im_end|>\n<|im_start|>user\n")
IMAGE_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
PLUS_IMAGE_PROMPT = "Picture {}: " + IMAGE_SLOT  # QwenImageEditPlusPipeline's img_prompt_template
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
# Qwen2.5-VL's preprocessor_config.json (what Qwen-Image-Edit's processor/ has): images between these pixel
# counts (transformers' own default caps at 28 * 28 * 1280, which would shrink a 1 MP reference to 980 px).
QWEN25_VL_PIXELS = {"min_pixels": 3136, "max_pixels": 12845056}
def vl_processor(image_processor: Any, tokenizer: Any) -> Any:
    """A ``Qwen2VLProcessor`` (the pipelines' ``processor``) without a video processor.

    transformers checks every processor attribute's class, and the video processor's base class is a
    placeholder without torchvision (which this runner does not need), so the check fails for ``None``
    too. The subclass skips the check for an absent attribute only; images and text go through the
    library's own processor code."""
    from transformers import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

        def save_pretrained(self, save_directory: str, **kwargs: Any) -> list[str]:
            """The files a Qwen2VLProcessor folder holds for images and text (preprocessor_config.json and
            the tokenizer's); the library's own save writes the absent video processor too, and fails."""
            os.makedirs(save_directory, exist_ok=True)
            return [*self.image_processor.save_pretrained(save_directory), *self.tokenizer.save_pretrained(save_directory)]

    return ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)


def vision_layout(encoder: Any, grid: torch.Tensor) -> dict[str, Any]:
    """The vision tower's patch layout (2-D positions, per-image and per-window attention bounds, the
    window order) computed on the host from ``image_grid_thw`` by transformers' own helpers, handed to
    the model as its precomputed ``image_*`` kwargs (``accepts_precomputed_kwargs``), on the host (the
    caller moves them).

    Why: the model computes them from the grid on the device, reading values back (``tolist``) and
    making index tensors there; computed from the host's grid, they are the same numbers without a
    device sync, and the planner, whose device tensors have no values, runs the same call (the
    moved host tensors keep theirs, runner/plan/known_values.py)."""
    from transformers.utils.generic import get_max_seqlen
    from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids, get_vision_window_index

    visual = encoder.model.visual
    grid = grid.cpu()
    positions = get_vision_position_ids(grid, visual.spatial_merge_size)
    cu, longest = get_vision_attention_seqlens(grid, visual.config)
    order, cu_window = get_vision_window_index(grid, spatial_merge_size=visual.spatial_merge_size,
                                               window_size=visual.window_size, patch_size=visual.patch_size)
    return {"image_position_ids": positions, "image_cu_seqlens": cu, "image_max_seqlen": longest,
            "image_window_index": order, "image_cu_window_seqlens": cu_window,
            "image_max_window_seqlen": get_max_seqlen(cu_window, visual.config)}


class QwenImageEditTrainer(QwenImageTrainer):
    """Qwen-Image-Edit MMDiT: reference tokens join the image stream, the VL encoder sees the reference."""

    Config = QwenImageEditTrainerConfig
    display_name = "Qwen-Image-Edit"
    default_references = 1  # an edit model: data.references unset trains on one reference per target (a class
    # attribute, so the data check of validation reads it before the trainer is built: runner/data/references.py)

    def __init__(self, cfg: Any, run: Any = None) -> None:
        self.variant = str(cfg.trainer.get("variant", "edit"))
        if self.variant not in VARIANTS:
            raise UserError(f"trainer.variant={self.variant!r} is not valid for trainer=qwen_image_edit: edit "
                            "(Qwen-Image-Edit, one reference) or plus (Qwen-Image-Edit-2509/2511, up to 3 references).")
        self.max_references = MAX_REFERENCES[self.variant]
        self.reference_repo = REFERENCE_REPOS[self.variant]
        self.zero_cond_t = cfg.trainer.get("zero_cond_t")
        if self.zero_cond_t and self.variant != "plus":
            raise UserError("trainer.zero_cond_t=true is Qwen-Image-Edit-2511's transformer flag, and 2511 runs in "
                            "QwenImageEditPlusPipeline: set trainer.variant=plus, or leave trainer.zero_cond_t unset.")
        super().__init__(cfg, run)
        self.check_zero_cond_t()
        if self.references < 1:
            raise UserError(
                "trainer=qwen_image_edit trains an edit model: each target needs its reference image, but "
                "data.references=0. Set data.references=1 and give each image a reference (control/<stem>.png or "
                "<stem>_ref1.png beside it; without data.path the built-in demo set is paired), or use "
                "trainer=qwen_image for plain captioned images.")
        self._processor: Any = None

    def pipeline_class(self) -> type:
        return pipeline_class(VARIANTS[self.variant])

    def size_configs(self) -> dict[str, dict[str, Any]]:
        """Qwen-Image's, with 2511's ``zero_cond_t`` on the transformer when ``trainer.zero_cond_t=true`` (what
        a random build and a single file are built with; a folder's config.json carries its own)."""
        configs = super().size_configs()
        if getattr(self, "zero_cond_t", None):
            configs = {**configs, "transformer": {**configs["transformer"], "zero_cond_t": True}}
        return configs

    def check_zero_cond_t(self) -> None:
        """``trainer.zero_cond_t`` against a model.path folder's transformer config: a contradiction is refused,
        since one of the two would be ignored (the folder's config.json is what the transformer is built with)."""
        if self.zero_cond_t is None or not self._folder_has("transformer"):
            return
        folder = bool(self.component_config("transformer").get("zero_cond_t", False))
        if folder != bool(self.zero_cond_t):
            raise UserError(
                f"trainer.zero_cond_t={str(self.zero_cond_t).lower()} but model.path's transformer/config.json says "
                f"zero_cond_t: {str(folder).lower()} (Qwen-Image-Edit-2511: true; Qwen-Image-Edit and -2509: false). "
                "The folder's config is what the transformer is built with: leave trainer.zero_cond_t unset (null) "
                "to use it, or point model.path at the model you mean.")

    def default_tokenizer(self, name: str) -> Any:
        return qwen2_vl_tokenizer(4096)

    def image_processor(self) -> Any:
        """Qwen2-VL's image processor (the PIL one: this runner has no torchvision): the folder's
        ``processor/`` settings, else Qwen2.5-VL's published ones (14 px patches, 2x2 merge, up to 12.8 MP)."""
        if self._processor is None:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            if self._folder_has("processor"):
                self._processor = Qwen2VLImageProcessorPil.from_pretrained(
                    os.path.join(self.source[1], "processor"), local_files_only=True)
            else:
                self._processor = Qwen2VLImageProcessorPil(**QWEN25_VL_PIXELS)
        return self._processor

    def pipeline_kwargs(self) -> dict[str, Any]:
        """The pipeline's ``processor``: this run's tokenizer and image processor (what encode uses)."""
        # A copy of the tokenizer: the pipeline's processor call may change state of the one it is given,
        # and the run's (cached, shared by every run in this process) must stay as encode uses it.
        return {"processor": vl_processor(copy.deepcopy(self.image_processor()), copy.deepcopy(self.tokenizer("tokenizer")))}

    def pipeline(self, models: ModelSet) -> Any:
        """The family's pipeline, dropping this run's count of system-line tokens (the pipeline's fixed
        ``prompt_template_encode_start_idx`` = 64 is Qwen's tokenizer's; the tiny byte-level one spells more)."""
        pipe = super().pipeline(models)
        pipe.prompt_template_encode_start_idx = self.template_tokens()
        # model_index.json: the processor/ folder is a Qwen2VLProcessor's (the class the published folder names)
        pipe.register_to_config(processor=("transformers", "Qwen2VLProcessor"))
        return pipe

    def sampling_family(self) -> Any:
        from runner.families.qwen_image_edit.sampling import QwenImageEditSampling

        return QwenImageEditSampling()

    # -- encoding --------------------------------------------------------------------------------
    def encode_parts(self) -> dict[str, EncodePart]:
        """The latents part reads the pixels and references; the text part the caption *and* the
        references (the VL encoder sees them), so a cache entry is keyed by both."""
        return {"latents": EncodePart(("vae",), self.image_inputs()),
                "text": EncodePart(("text_encoder",), ("caption", "references"))}

    def template_tokens(self) -> int:
        """Tokens the pipeline drops (the system line; 64 with Qwen's tokenizer), counted with this run's."""
        return len(self.tokenizer("tokenizer")(_SYSTEM).input_ids)

    def vl_images(self, references: torch.Tensor) -> list[Image.Image]:
        """``[N, 3, H, W]`` references -> what the VL encoder is handed: Edit the reference itself, Plus each
        resized to 384^2 pixels' area. On ``meta`` (the planner) a blank image of that size: shapes and
        token ids do not depend on the pixels."""
        out = []
        for ref in references:
            h, w = int(ref.shape[-2]), int(ref.shape[-1])
            image = Image.new("RGB", (w, h)) if ref.device.type == "meta" else to_pil(ref)
            if self.variant == "plus":
                cw, ch = calculate_dimensions(CONDITION_IMAGE_AREA, w / h)
                image = image.resize((cw, ch), resample=Image.LANCZOS)
            out.append(image)
        return out

    def vision_inputs(self, references: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``image_grid_thw`` and ``pixel_values`` of :meth:`vl_images` from Qwen2-VL's image processor, as
        host tensors made from its arrays (real ones even inside the planner's fake mode, so the grid's
        values stay readable); on ``meta`` the pixels are a shape-only tensor."""
        vision = self.image_processor()(images=self.vl_images(references), return_tensors="np")
        grid = torch.from_numpy(np.asarray(vision["image_grid_thw"], dtype=np.int64))
        pixels = np.asarray(vision["pixel_values"], dtype=np.float32)
        if references.device.type == "meta":
            return grid, torch.empty(pixels.shape, dtype=torch.float32, device="meta")
        return grid, torch.from_numpy(pixels)

    def prompt_ids(self, caption: str, grid: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Token ids of the template with the images' ``<|image_pad|>`` runs expanded (the processor's
        ``grid.prod() // merge^2`` each) and the instruction cut to ``max_sequence_length`` tokens, and
        the fixed length of the kept part (everything after the system line, the instruction at its cap)."""
        tok = self.tokenizer("tokenizer")
        merge = int(self.image_processor().merge_size) ** 2
        slots = [IMAGE_SLOT.replace("<|image_pad|>", "<|image_pad|>" * (math.prod(g) // merge)) for g in grid.tolist()]
        images = "".join(f"Picture {k + 1}: {s}" for k, s in enumerate(slots)) if self.variant == "plus" else slots[0]
        head = tok(_SYSTEM + images).input_ids
        text = tok(caption).input_ids[: self.max_sequence_length]
        tail = tok(SUFFIX).input_ids
        fixed = len(head) - self.template_tokens() + len(tail) + self.max_sequence_length
        return torch.from_numpy(np.asarray([head + text + tail], dtype=np.int64)), fixed

    @torch.no_grad()
    def encode_text(self, models: ModelSet, captions: list[str], references: torch.Tensor,
                    device: torch.device) -> dict[str, torch.Tensor]:
        """Each (instruction, references) through Qwen2.5-VL alone (no padding enters the causal model),
        the kept hidden states zero-padded to the bucket's fixed length, with their mask."""
        encoder = models["text_encoder"]
        drop = self.template_tokens()
        rows, masks = [], []
        for caption, refs in zip(captions, references):
            with unset_fake_temporarily():  # host bookkeeping: real tensors, also in the planner's simulated step
                grid, pixels = self.vision_inputs(refs)
                ids, length = self.prompt_ids(caption, grid)
                layout = vision_layout(encoder, grid)
            layout = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in layout.items()}
            hidden = encoder.model(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                                   pixel_values=pixels.to(device, compute_dtype(encoder)), image_grid_thw=grid.to(device),
                                   **layout).last_hidden_state[0, drop:]
            n = int(hidden.shape[0])
            rows.append(torch.cat([hidden, hidden.new_zeros(length - n, hidden.shape[1])]))
            masks.append(torch.tensor([True] * n + [False] * (length - n)))
        return {"prompt_embeds": torch.stack(rows), "prompt_embeds_mask": torch.stack(masks).to(device)}

    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """Latents: Qwen-Image's posterior of the target plus ``reference_mean`` (the references' mean,
        ``[B, N, C, h, w]``); text: :meth:`encode_text` of each caption with its references."""
        if part == "latents":
            out = super().encode_part(models, part, batch)
            out["reference_mean"] = self.encode_references(models, batch["references"])
            return out
        return self.encode_text(models, list(batch["caption"]), batch["references"], batch_device(batch))

    @staticmethod
    def encode_references(models: ModelSet, references: torch.Tensor) -> torch.Tensor:
        """``[B, N, 3, H, W]`` pixels -> ``[B, N, C, h, w]`` posterior means of the one-frame clips (the
        pipeline's ``retrieve_latents(..., sample_mode="argmax")``), not yet normalised."""
        vae = models["vae"]
        b, n = references.shape[:2]
        flat = references.flatten(0, 1).to(compute_dtype(vae)).unsqueeze(2)
        mean = vae.encode(flat).latent_dist.mean[:, :, 0].contiguous()
        return mean.view(b, n, *mean.shape[1:])

    def finish_encode(self, parts: dict[str, dict[str, torch.Tensor]], batch: Batch) -> Batch:
        """Qwen-Image's, plus ``reference_latents``: the references' means normalised per channel."""
        out = super().finish_encode(parts, batch)
        mean = parts["latents"]["reference_mean"].float()  # [B, N, C, h, w]: the statistics are over C
        out["reference_latents"] = self.normalize_latents(mean.flatten(0, 1)).view(mean.shape)
        return out

    # -- the denoiser ----------------------------------------------------------------------------
    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The pipelines' transformer call: target tokens then each reference's, ``img_shapes`` listing
        each grid, and the output cut back to the target's tokens."""
        transformer = models["transformer"]
        dt = compute_dtype(transformer)
        b, _, h, w = noisy.shape
        refs = batch["reference_latents"]
        packed = self.pack(noisy).to(dt)
        tokens = packed.shape[1]
        seq = [packed] + [self.pack(refs[:, k].to(noisy.device)).to(dt) for k in range(refs.shape[1])]
        shapes = [(1, h // 2, w // 2)] + [(1, int(refs.shape[-2]) // 2, int(refs.shape[-1]) // 2)] * refs.shape[1]
        hidden = torch.cat(seq, dim=1)
        del seq, packed
        return transformer(
            hidden_states=hidden,
            timestep=timesteps.to(dt),  # t in (0, 1): the pipeline's timestep / 1000
            encoder_hidden_states=batch["prompt_embeds"].to(dt),
            encoder_hidden_states_mask=batch["prompt_embeds_mask"],
            img_shapes=[shapes] * b,
            return_dict=False,
        )[0][:, :tokens]

    # -- shapes for the planner ------------------------------------------------------------------
    def planned_text_length(self) -> int:
        """The fixed text length at the planned reference size (vision tokens + template + instruction cap)."""
        h, w = self.planned_size()
        refs = torch.empty((self.references, 3, h, w), device="meta")
        return self.prompt_ids("", self.vision_inputs(refs)[0])[1]

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """Qwen-Image's example batch with the text at the edit prompt's fixed length and the reference
        latents at the target's size: the planner runs the longer sequences."""
        b, length = batch_size, self.planned_text_length()
        lat = self.example_latents(b, device)
        return {
            "latents": lat,
            "prompt_embeds": self.example_tensor((b, length, self.text_hidden_size()), device, self.storage_dtype, 1),
            "prompt_embeds_mask": torch.ones((b, length), dtype=torch.bool, device=device),
            "reference_latents": self.example_tensor((b, self.references, *lat.shape[1:]), device, torch.float32, 7),
            "sample_seed": self.example_seeds(b, device),
        }
