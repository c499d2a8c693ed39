"""Z-Image: train the 6.2 B single-stream DiT (fully or with LoRA) with the rectified-flow loss.

Z-Image (Tongyi-MAI/Z-Image-Turbo) puts image patches and caption tokens into one sequence
(``ZImageTransformer2DModel``: refiner blocks for each stream, then 30 joint blocks), conditioned
on Qwen3-4B and decoded by FLUX.1's VAE (``(z - shift_factor) * scaling_factor``, as Flux).

Conditioning as diffusers' ``ZImagePipeline._encode_prompt`` computes it: each caption rendered by
the tokenizer's chat template (one user turn, ``add_generation_prompt=True``,
``enable_thinking=True``), tokenized to ``max_sequence_length`` with padding, run through Qwen3
with the tokenizer's mask, and the **second-to-last** hidden state kept for the caption's tokens
only. The pipeline hands the transformer a list of unpadded per-caption tensors; the transformer
pads each to a multiple of 32 with a learnt pad token that *is* attended to, so a caption's
length changes the result. Here the embeddings are zero-padded to a fixed length with a mask (a
cache entry has one shape whatever batch it lands in) and ``predict`` cuts each caption back to
its mask's length before the call, which gives the pipeline's exact input.

Two conventions differ from the other flow families, and ``predict`` converts both:

* the transformer's timestep is ``1 - sigma`` (the pipeline passes ``(1000 - t) / 1000``): 1 is
  clean, 0 is noise;
* it predicts ``x0 - noise``, the negative of the velocity the scheduler steps with (the pipeline
  negates its output), so ``predict`` returns minus the output.

Trade-off: reading the caption lengths needs the mask's values. The planner's tensors have none,
so there every caption counts as the longest caption of the run's data (:meth:`ZImageTrainer.
longest_caption_tokens`: the data set's captions, and the empty one with caption dropout, through the
same chat template and tokenizer): the step whose batch holds the data's longest captions. Where the
captions cannot be listed (``data.shuffle_tags``: each visit joins the tags anew; data the planning
machine cannot read) it is ``max_sequence_length``, the longest any caption can be, and the log says so.

Loss: the flow-matching family's (runner/families/common/flow.py), ``t`` logit-normal and unshifted by
default (``loss.*`` changes it).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from runner.compat import is_fake, without_dispatch_modes
from runner.errors import UserError
from runner.families.common.flow import FlowMatchTrainer
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.common.tokenizers import qwen3_tokenizer
from runner.families.z_image import architecture as z_image_configs
from runner.families.z_image.config import ZImageTrainerConfig
from runner.trainer import Batch, EncodePart, ModelSet, batch_device

# Z-Image-Turbo's scheduler/scheduler_config.json (diffusers 0.36: num_train_timesteps 1000, use_dynamic_shifting
# false, shift 3.0, as mirrors of the folder show it); ComfyUI's Z-Image samples with shift 3.0 too.
log = logging.getLogger("runner")

Z_IMAGE_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


def text_model(text_encoder: Any) -> Any:
    """Qwen3's decoder without its LM head (``Qwen3ForCausalLM.model``): the pipeline reads a hidden
    state, so the head's logits over the 152 k vocabulary are never computed."""
    return getattr(text_encoder, "model", text_encoder)


def chat_texts(tok: Any, captions: list[str]) -> list[str]:
    """Each caption as the pipeline renders it: one user turn, generation prompt, thinking enabled."""
    return [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True,
                                    enable_thinking=True) for c in captions]


def simulated(t: torch.Tensor) -> bool:
    """A planner's tensor: a shape without values."""
    return t.device.type == "meta" or is_fake(t)


def caption_lengths(mask: torch.Tensor, longest: int | None = None) -> list[int]:
    """Valid tokens per caption from its mask; without values (the planner's simulated tensors)
    every caption is taken at ``longest`` tokens (the run's longest caption), at most the padded length."""
    if simulated(mask):
        width = int(mask.shape[1])
        return [width if longest is None else min(int(longest), width)] * int(mask.shape[0])
    return [int(n) for n in mask.sum(dim=1).tolist()]


class ZImageTrainer(FlowMatchTrainer):
    """Z-Image single-stream DiT, rectified-flow matching loss."""

    Config = ZImageTrainerConfig
    denoiser = "transformer"
    display_name = "Z-Image"
    reference_repo = "Tongyi-MAI/Z-Image-Turbo"
    kohya_lora = False  # no kohya layout for Z-Image: the diffusers file, and the ComfyUI one below
    comfy_layout = "z_image"  # diffusion_model.<diffusers name> + .alpha (runner/export/comfy.py)
    family = "z_image"

    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        length = cfg.trainer.get("max_sequence_length")
        default = z_image_configs.Z_IMAGE_MAX_SEQUENCE_LENGTH
        self.max_sequence_length = int(default if length is None else length)
        if self.max_sequence_length < 1 or (length is not None and int(length) != float(length)):
            raise UserError(f"trainer.max_sequence_length={length!r} is not valid: give a whole number of tokens "
                            f">= 1 (the caption with its chat template), or null for {default}.")
        self._longest: int | None = None

    def module_classes(self) -> dict[str, type]:
        from diffusers import AutoencoderKL, ZImageTransformer2DModel
        from transformers import Qwen3ForCausalLM

        return {"transformer": ZImageTransformer2DModel, "vae": AutoencoderKL, "text_encoder": Qwen3ForCausalLM}

    def size_configs(self) -> dict[str, dict[str, Any]]:
        return z_image_configs.z_image_configs(self.size)

    def default_tokenizer(self, name: str) -> Any:
        return qwen3_tokenizer(max(z_image_configs.Z_IMAGE_MAX_SEQUENCE_LENGTH, self.max_sequence_length))

    def pipeline_class(self) -> type:
        return pipeline_class("ZImagePipeline")

    def inference_scheduler(self) -> Any:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER)

    def sampling_family(self) -> Any:
        from runner.families.z_image.sampling import ZImageSampling

        return ZImageSampling()

    # -- encoding --------------------------------------------------------------------------------
    def encode_parts(self) -> dict[str, EncodePart]:
        return {"latents": EncodePart(("vae",), self.image_inputs()), "text": EncodePart(("text_encoder",), ("caption",))}

    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The VAE posterior, or Qwen3's second-to-last hidden state of the chat-formatted caption
        (padding zeroed) with the mask of its tokens, as ``ZImagePipeline._encode_prompt``."""
        if part == "latents":
            return self.encode_latents(models, batch)
        device = batch_device(batch)
        tok = self.tokenizer("tokenizer")
        tokens = tok(chat_texts(tok, batch["caption"]), padding="max_length", max_length=self.max_sequence_length, truncation=True,
                     return_tensors="pt")
        mask = tokens.attention_mask.to(device).bool()
        hidden = text_model(models["text_encoder"])(input_ids=tokens.input_ids.to(device), attention_mask=mask,
                                                    output_hidden_states=True).hidden_states[-2]
        return {"prompt_embeds": hidden.masked_fill(~mask.unsqueeze(-1), 0.0), "prompt_embeds_mask": mask}

    def longest_caption_tokens(self) -> int:
        """Tokens (chat template included, at most ``max_sequence_length``) of the longest caption this
        run's data can train on: what the planner counts for every caption of a batch (module
        docstring). Computed once; ``max_sequence_length`` where the captions cannot be listed."""
        if self._longest is None:
            with without_dispatch_modes():  # asked inside the planner's simulation: data and tokenizer are real work
                self._longest = self._longest_listed()
        return self._longest

    def _longest_listed(self) -> int:
        texts, why = self._listed_captions()
        if texts is None:
            log.info("Z-Image plan: every caption counted at trainer.max_sequence_length=%d tokens (%s).",
                     self.max_sequence_length, why)
            return self.max_sequence_length
        tok = self.tokenizer("tokenizer")
        longest = max(len(x) for x in tok(chat_texts(tok, sorted(texts)), truncation=True, max_length=self.max_sequence_length).input_ids)
        log.info("Z-Image plan: every caption counted at the data's longest, %d tokens of %d "
                 "(trainer.max_sequence_length).", longest, self.max_sequence_length)
        return longest

    def _listed_captions(self) -> tuple[set[str] | None, str]:
        """Every caption text a visit of this run's data can train on, or None and why not."""
        if self.cfg.data.get("shuffle_tags", False):
            return None, "data.shuffle_tags=true joins the tags anew on every visit"
        try:
            data = self.dataset()
        except UserError as e:  # a plan made on a machine without the data: the longest a caption can be
            return None, f"the data set could not be read here: {str(e).splitlines()[0]}"
        if not callable(getattr(data, "caption", None)):
            return None, "the data set does not list its captions"
        extra = data.extra_captions() if callable(getattr(data, "extra_captions", None)) else set()
        return {data.caption(i) for i in range(len(data))} | (extra or set()), ""

    # -- the denoiser ----------------------------------------------------------------------------
    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The velocity (``noise - x0``) for latents ``(B, 16, H, W)``: the transformer's output
        negated, called as the pipeline calls it (per-sample lists, ``1 - t``, unpadded captions)."""
        transformer = models["transformer"]
        dt = compute_dtype(transformer)
        embeds = batch["prompt_embeds"]
        mask = batch["prompt_embeds_mask"]
        lengths = caption_lengths(mask, self.longest_caption_tokens() if simulated(mask) else None)
        caps = [embeds[i, :n].to(dt) for i, n in enumerate(lengths)]
        out = transformer(list(noisy.to(dt).unsqueeze(2).unbind(0)), 1.0 - timesteps.float(), caps,
                          return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    # -- shapes for the planner ------------------------------------------------------------------
    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """An encoded batch with the shapes ``encode`` gives at ``data.resolution``."""
        b, length = batch_size, self.max_sequence_length
        width = int(self.component_config("text_encoder")["hidden_size"])
        return {
            "latents": self.example_latents(b, device),
            "prompt_embeds": self.example_tensor((b, length, width), device, self.storage_dtype, 1),
            "prompt_embeds_mask": torch.ones((b, length), dtype=torch.bool, device=device),
            "sample_seed": self.example_seeds(b, device),
        }
