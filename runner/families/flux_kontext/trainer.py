"""Flux.1 Kontext: train the edit transformer (fully or with LoRA) on targets with reference images.

FLUX.1 Kontext dev (black-forest-labs/FLUX.1-Kontext-dev) is FLUX.1 dev's architecture
(``FluxTransformer2DModel``, the same config, CLIP + T5, the 16-channel VAE, guidance-distilled)
trained to edit: the reference image joins the image tokens. Everything Flux's is reused from
runner/families/flux/trainer.py; what differs is exactly what diffusers' ``FluxKontextPipeline`` does:

* the reference is VAE-encoded with the posterior's *mode* (``retrieve_latents(...,
  sample_mode="argmax")``, the mean), normalised ``(z - shift_factor) * scaling_factor``, packed
  2x2 like the target and concatenated after the target's tokens along the sequence;
* its position ids are the target grid's with the first coordinate set to 1 (the target's is 0), so
  the rotary embedding tells the two images apart while their pixels stay aligned;
* the transformer's output is cut back to the target's tokens (``noise_pred[:, :latents.size(1)]``):
  the loss is on the target only, the reference is conditioning.

Data: ``data.references=1`` (runner/data/references.py), a ``control/`` folder or ``*_ref1`` files,
the caption is the instruction. Trade-offs: the reference is cropped and bucketed with its target,
so both have one size (a batch stacks them); the pipeline instead resizes the reference to one of
Kontext's preferred resolutions, which for a bucketed target is the same size or close to it.
The reference costs a second image's tokens in every block (about twice the image sequence): the
planner counts it because :meth:`example_batch` carries the reference latents at the planned size.
"""
from __future__ import annotations

from typing import Any

import torch

from runner.errors import UserError
from runner.families.common.loading import compute_dtype, pipeline_class
from runner.families.flux.dit import _image_ids, _pack_latents
from runner.families.flux.trainer import FluxTrainer
from runner.families.flux_kontext.config import FluxKontextTrainerConfig
from runner.trainer import Batch, ModelSet


def reference_ids(h: int, w: int, k: int, device: torch.device) -> torch.Tensor:
    """Position ids of reference ``k`` (1-based) on an ``h x w`` latent grid: the target's ids with the
    first coordinate ``k`` (``FluxKontextPipeline.prepare_latents`` sets it to 1 for its one image)."""
    ids = _image_ids(h, w, device)
    ids[..., 0] = k
    return ids


def join_references(packed: torch.Tensor, references: torch.Tensor, h: int, w: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's packed tokens followed by each reference's (``[B, N, C, h', w']`` normalised latents),
    and the ids of the whole sequence: what ``FluxKontextPipeline`` feeds its transformer."""
    device = packed.device
    seq, ids = [packed], [_image_ids(h, w, device)]
    for k in range(references.shape[1]):
        ref = references[:, k]
        seq.append(_pack_latents(ref.to(device)).to(dtype))
        ids.append(reference_ids(int(ref.shape[-2]), int(ref.shape[-1]), k + 1, device))
    return torch.cat(seq, dim=1), torch.cat(ids, dim=0)


class FluxKontextTrainer(FluxTrainer):
    """Flux.1 Kontext transformer: reference tokens join the sequence, flow-matching loss on the target."""

    Config = FluxKontextTrainerConfig
    display_name = "Flux.1 Kontext"
    family = "flux"  # BFL's flux1-kontext-dev.safetensors has FLUX.1 dev's layout (runner/families/common/single_file.py)
    reference_repo = "black-forest-labs/FLUX.1-Kontext-dev"
    max_references = 1  # FluxKontextPipeline takes one image
    default_references = 1  # an edit model: data.references unset trains on one reference per target

    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        if self.references < 1:
            raise UserError(
                "trainer=flux_kontext trains an edit model: each target needs its reference image, but "
                "data.references=0. Set data.references=1 and give each image a reference (control/<stem>.png or "
                "<stem>_ref1.png beside it; without data.path the built-in demo set is paired), or use trainer=flux "
                "for plain captioned images.")

    def pipeline_class(self) -> type:
        return pipeline_class("FluxKontextPipeline")

    def sampling_family(self) -> Any:
        from runner.families.flux_kontext.sampling import FluxKontextSampling

        return FluxKontextSampling()

    # -- protocol -------------------------------------------------------------------------
    @torch.no_grad()
    def encode_part(self, models: ModelSet, part: str, batch: Batch) -> dict[str, torch.Tensor]:
        """The text part as Flux's; the latents part adds the references' posterior mean (the
        pipeline's ``argmax``), ``[B, N, C, h, w]``, cached beside the target's moments."""
        out = super().encode_part(models, part, batch)
        if part == "latents":
            out["reference_mean"] = self.encode_references(models, batch["references"])
        return out

    @staticmethod
    def encode_references(models: ModelSet, references: torch.Tensor) -> torch.Tensor:
        """``[B, N, 3, H, W]`` pixels -> ``[B, N, C, h, w]`` posterior means (not yet normalised)."""
        vae = models["vae"]
        b, n = references.shape[:2]
        flat = references.flatten(0, 1).to(compute_dtype(vae))
        mean = vae.encode(flat).latent_dist.mean.contiguous()
        return mean.view(b, n, *mean.shape[1:])

    def finish_encode(self, parts: dict[str, dict[str, torch.Tensor]], batch: Batch) -> Batch:
        """Flux's, plus ``reference_latents``: the references' means normalised as the target's latents."""
        out = super().finish_encode(parts, batch)
        out["reference_latents"] = self.normalize_latents(parts["latents"]["reference_mean"].float())
        return out

    def dit_inputs(self, transformer: Any, noisy: torch.Tensor, batch: Batch,
                   dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """``FluxKontextPipeline``'s transformer inputs: target then reference tokens, target and reference ids
        (the output is cut back to the target's tokens by ``predict``), and FLUX.1's guidance and pooled input."""
        _, _, h, w = noisy.shape
        hidden, ids = join_references(_pack_latents(noisy).to(dt), batch["reference_latents"], h, w, dt)
        return hidden, ids, self.flux_inputs(transformer, noisy, batch, dt)

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> Batch:
        """Flux's example batch plus the reference latents at the target's size (the planned sequence
        is target + references)."""
        batch = super().example_batch(batch_size, device)
        lat = batch["latents"]
        refs = self.example_tensor((batch_size, self.references, *lat.shape[1:]), device, torch.float32, 7)
        return {**batch, "reference_latents": refs}
