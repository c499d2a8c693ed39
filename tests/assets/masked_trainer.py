"""A user's trainer whose text encoders take an attention mask (issue: a T5/CLIP encoder with a
mask could not be planned: transformers reads ``mask.all()`` before it builds the mask).

The built-in SDXL trainer, with its two CLIP text encoders given the tokenizer's attention mask,
as a user's own trainer that passes ``attention_mask=`` would. Run it with::

    PYTHONPATH=tests/assets python -m runner trainer._target_=masked_trainer.MaskedSDXLTrainer
"""
from __future__ import annotations

import torch

from runner.families.sdxl.trainer import SDXLTrainer
from runner.trainer import batch_device


def tokens(tokenizer, captions, length, device):
    enc = tokenizer(list(captions), padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    return enc.input_ids.to(device), enc.attention_mask.to(device)


class MaskedSDXLTrainer(SDXLTrainer):
    @torch.no_grad()
    def encode_part(self, models, part, batch):
        if part == "latents":
            return self.encode_latents(models, batch)
        device = batch_device(batch)
        te1, te2 = models["text_encoder"], models["text_encoder_2"]
        tok1, tok2 = self.tokenizer("tokenizer"), self.tokenizer("tokenizer_2")
        ids1, mask1 = tokens(tok1, batch["caption"], self.text_max_length(tok1, te1.config), device)
        ids2, mask2 = tokens(tok2, batch["caption"], self.text_max_length(tok2, te2.config), device)
        out1 = te1(ids1, attention_mask=mask1, output_hidden_states=True)
        out2 = te2(ids2, attention_mask=mask2, output_hidden_states=True)
        h1 = out1.hidden_states[-2]
        prompt_embeds = torch.cat([h1, out2.hidden_states[-2].to(h1.dtype)], dim=-1)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": out2.text_embeds}


class ValueReadingTrainer(SDXLTrainer):
    """Reads a value of its images in the encode step: a plan cannot know it (the error test)."""

    @torch.no_grad()
    def encode_part(self, models, part, batch):
        if part == "latents" and float(batch["pixel_values"].std()) > 1e6:  # a value only real data has
            raise ValueError("images out of range")
        return super().encode_part(models, part, batch)


class NoPipelineSDXL(SDXLTrainer):
    """The SDXL trainer as a user's trainer that names no diffusers pipeline (the export test)."""

    pipeline_class = None
