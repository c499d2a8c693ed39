"""A user's trainer that sends its token ids to ``next(text_encoder.parameters()).device``.

Run it with::

    PYTHONPATH=tests/assets python -m runner trainer=custom trainer._target_=host_ids_trainer.HostIdsTrainer

The common pattern of third-party code (diffusers' own prompt helpers did it): ask the encoder
where its weights are and put the ids there. Under ``offload=park`` the weights are on the host
between calls, so the ids go to the host; park moves them to the device for the call and gives the
outputs back on the host (plugins/park/align.py). A tiny CLIP text encoder (byte tokens, random
init, nothing downloaded) conditions a pixel-space diffusers ``UNet2DModel`` through its identity
class embedding. Its encode step is cacheable: a text part and a pixel part (no module: the pixels
themselves, so a fully cached run still has them). Its loss sends the denoiser's inputs to
``next(unet.parameters()).device`` too: streamed, quantized or offloaded, the parameters must say the card.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel
from transformers import CLIPTextConfig, CLIPTextModel

from runner.data import build_dataset, planned_size
from runner.trainer import EncodePart, ModelSet, per_sample_rand, per_sample_randn

TOKENS, WIDTH = 16, 64  # byte ids per caption; the encoder's width = the UNet's time embedding width


def byte_ids(captions: list[str]) -> torch.Tensor:
    rows = [list(c.encode()[:TOKENS]) + [0] * max(0, TOKENS - len(c.encode())) for c in captions]
    return torch.tensor(rows, dtype=torch.int64)


class HostIdsTrainer:
    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.scheduler = DDPMScheduler(num_train_timesteps=1000)
        self.size = planned_size(cfg.data)[0]

    def build_models(self, device: str | torch.device = "cpu") -> ModelSet:
        torch.manual_seed(0)  # the frozen encoder's weights are part of the cache key's trainer name
        text = CLIPTextConfig(vocab_size=256, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, max_position_embeddings=TOKENS, bos_token_id=0, eos_token_id=1,
                              pad_token_id=0)
        with torch.device(device):
            encoder = CLIPTextModel(text).eval().requires_grad_(False)
            unet = UNet2DModel(sample_size=self.size[0], in_channels=3, out_channels=3, block_out_channels=(16, 32),
                               layers_per_block=1, norm_num_groups=8, class_embed_type="identity",
                               down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"))
        return ModelSet({"unet": unet, "text_encoder": encoder}, trained={"unet"})

    def dataset(self) -> Any:
        return build_dataset(self.cfg.data)

    # ---- the cacheable encode step ----
    def encode_parts(self) -> dict[str, EncodePart]:
        return {"text": EncodePart(("text_encoder",), ("caption",)), "pixels": EncodePart((), ("pixel_values",))}

    def encode_part(self, models: ModelSet, part: str, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        if part == "pixels":
            return {"pixels": batch["pixel_values"]}
        encoder = models["text_encoder"]
        ids = byte_ids(list(batch["caption"])).to(next(encoder.parameters()).device)  # the pattern under test
        return {"embeds": encoder(input_ids=ids).last_hidden_state.mean(dim=1)}

    def finish_encode(self, parts: dict[str, dict[str, torch.Tensor]], batch: dict[str, Any]) -> dict[str, Any]:
        return {"pixels": parts["pixels"]["pixels"], "embeds": parts["text"]["embeds"], "sample_seed": batch["sample_seed"]}

    def encode(self, models: ModelSet, batch: dict[str, Any]) -> dict[str, Any]:
        return self.finish_encode({p: self.encode_part(models, p, batch) for p in self.encode_parts()}, batch)

    def cache_signature(self, part: str) -> dict[str, Any]:
        return {"trainer": "host_ids_trainer.HostIdsTrainer/1", "part": part, "size": list(self.size)}

    def loss(self, models: ModelSet, batch: dict[str, Any]) -> torch.Tensor:
        x0, seeds = batch["pixels"], batch["sample_seed"]
        noise = per_sample_randn(seeds, tuple(x0.shape[1:]), x0.device, x0.dtype)
        t = (per_sample_rand(seeds, salt=1, device=x0.device) * 999).long()
        unet = models["unet"]
        # The same pattern for the trained denoiser (streamed, quantized, its activations offloaded by the presets):
        # its inputs go where its parameters say, and must be on the card.
        at = next(unet.parameters()).device
        noisy = self.scheduler.add_noise(x0, noise, t).to(at)
        embeds = batch["embeds"].to(at, x0.dtype)  # on the host when the ids were sent there
        pred = unet(noisy, t.to(at), class_labels=embeds).sample
        return F.mse_loss(pred.float(), noise.float())

    def example_batch(self, batch_size: int, device: str | torch.device = "meta") -> dict[str, Any]:
        h, w = self.size
        seeds_on = "cpu" if torch.device(device).type == "meta" else device
        return {"pixels": torch.zeros(batch_size, 3, h, w, device=device),
                "embeds": torch.zeros(batch_size, WIDTH, device=device),
                "sample_seed": torch.arange(batch_size, dtype=torch.int64, device=seeds_on)}

    def example_raw_batch(self, batch_size: int, device: str | torch.device = "meta") -> dict[str, Any]:
        h, w = self.size
        seeds_on = "cpu" if torch.device(device).type == "meta" else device
        return {"pixel_values": torch.zeros(batch_size, 3, h, w, device=device),
                "caption": ["an example caption"] * batch_size,
                "index": torch.arange(batch_size, dtype=torch.int64, device=seeds_on),
                "sample_seed": torch.arange(batch_size, dtype=torch.int64, device=seeds_on)}
