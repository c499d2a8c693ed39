"""A user's edit trainer on the public protocol only: "target = instruction applied to the reference".

Run it with::

    PYTHONPATH=tests/assets python -m runner trainer=custom trainer._target_=edit_trainer.PixelKontextTrainer

It trains a diffusers ``FluxTransformer2DModel`` (tiny, built from a config dict, random init, nothing
downloaded) with a rectified-flow loss directly on pixels, as Flux.1 Kontext trains on latents: the
target's 4x4 pixel patches are the image tokens, each reference's patches join the sequence after
them with their own position ids (first id axis = the reference's number, 1-based, as Kontext's
reference carries 1), and the loss reads the target's tokens only. The caption (the instruction)
is one-hot bytes: the transformer's ``context_embedder`` is then its embedding table, so there is no
text encoder to build. The trade-off: no VAE and no text model (what a preset may assume of a
trainer is only runner/trainer.py's protocol), at the price of a model that learns pixels, not latents.

What it uses of the runner is the public protocol alone (runner/trainer.py): it declares
``max_references``/``default_references``, reads its count with :func:`runner.trainer.reference_count`,
builds its data with :func:`runner.data.build_dataset` (references cropped, bucketed and flipped with
their targets) and sizes its example batch with :func:`runner.data.planned_size`.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers import FluxTransformer2DModel

from runner.data import build_dataset, planned_size
from runner.errors import UserError
from runner.trainer import ModelSet, per_sample_rand, per_sample_randn, reference_count

PATCH = 4  # pixels per token side: a token is 3 x 4 x 4 = 48 values
TEXT_TOKENS = 16  # instruction bytes kept (padded with byte 0)
VOCAB = 256  # one-hot bytes
CONFIG: dict[str, Any] = {
    "patch_size": 1, "in_channels": 3 * PATCH * PATCH, "num_layers": 2, "num_single_layers": 2,
    "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": VOCAB,
    "pooled_projection_dim": VOCAB, "guidance_embeds": False, "axes_dims_rope": (4, 6, 6),
}


def patchify(images: torch.Tensor) -> torch.Tensor:
    """``[B, 3, H, W]`` -> ``[B, (H/4)*(W/4), 48]`` tokens, row-major, as Flux packs 2x2 latent patches."""
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def position_ids(h: int, w: int, image: int, device: torch.device) -> torch.Tensor:
    """``[(h/4)*(w/4), 3]`` ids: (image number, row, column); 0 for the target, k for reference k."""
    rows = torch.arange(h // PATCH).repeat_interleave(w // PATCH)
    cols = torch.arange(w // PATCH).repeat(h // PATCH)
    return torch.stack([torch.full_like(rows, image), rows, cols], dim=-1).float().to(device)


def instruction_tokens(captions: list[str], device: torch.device) -> torch.Tensor:
    """One-hot UTF-8 bytes of each caption, ``[B, 16, 256]`` (cut or padded with byte 0)."""
    ids = [list(c.encode("utf-8")[:TEXT_TOKENS].ljust(TEXT_TOKENS, b"\0")) for c in captions]
    return torch.eye(VOCAB)[torch.tensor(ids, dtype=torch.int64)].to(device)


class PixelKontextTrainer:
    """A Kontext-style edit transformer on pixels, taking up to two reference images per target."""

    max_references = 2  # the most it takes per target (data.references above is refused)
    default_references = 1  # an edit model: an unset data.references trains on one reference per target

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.references = reference_count(self, cfg)  # data.references, or 1 when unset
        if self.references < 1:
            raise UserError("edit_trainer.PixelKontextTrainer trains an edit model, but data.references=0: set "
                            "data.references=1 (or 2) and give each image its reference (control/<stem>.png).")

    def build_models(self, device: str | torch.device = "cpu") -> ModelSet:
        with torch.device(device):  # on "meta" (the planner) nothing is allocated
            transformer = FluxTransformer2DModel(**CONFIG)
        transformer.train()
        return ModelSet({"transformer": transformer}, trained={"transformer"})

    def dataset(self) -> Any:
        return build_dataset(self.cfg.data, references=self.references)

    def loss(self, models: ModelSet, batch: dict[str, Any]) -> torch.Tensor:
        x0, refs, seeds = batch["pixel_values"], batch["references"], batch["sample_seed"]
        device, (h, w) = x0.device, x0.shape[-2:]
        noise = per_sample_randn(seeds, tuple(x0.shape[1:]), device, x0.dtype)
        t = per_sample_rand(seeds, salt=1, device=device).clamp(1e-3, 1 - 1e-3)
        tb = t.view(-1, 1, 1, 1).to(x0.dtype)
        noisy = (1 - tb) * x0 + tb * noise  # rectified flow: straight path from the image to noise
        n = patchify(noisy).shape[1]
        tokens = torch.cat([patchify(noisy), *(patchify(refs[:, k]) for k in range(refs.shape[1]))], dim=1)
        ids = torch.cat([position_ids(h, w, k, device) for k in range(refs.shape[1] + 1)])
        text = instruction_tokens(list(batch["caption"]), device)
        pred = models["transformer"](
            hidden_states=tokens, encoder_hidden_states=text, pooled_projections=text.mean(1), timestep=t,
            img_ids=ids, txt_ids=torch.zeros(TEXT_TOKENS, 3, device=device)).sample[:, :n]
        return F.mse_loss(pred.float(), patchify(noise - x0).float())  # velocity on the target's tokens only

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> dict[str, Any]:
        """What a batch of the data holds at the largest size it can have (buckets included), references
        too, so the planner counts their tokens; seeds stay on the CPU (read with ``tolist()``)."""
        (h, w), _ = planned_size(self.cfg.data)
        meta = torch.device(device).type == "meta"
        g = torch.Generator().manual_seed(0)

        def images(*shape: int) -> torch.Tensor:
            return torch.empty(shape, device="meta") if meta else torch.randn(shape, generator=g).to(device)

        return {"pixel_values": images(batch_size, 3, h, w),
                "references": images(batch_size, self.references, 3, h, w),
                "caption": ["make the square red"] * batch_size,
                "sample_seed": torch.arange(batch_size, dtype=torch.int64, device="cpu" if meta else device)}
