"""The models bench/offload_bench.py measures: a case (family, size, training), its denoiser built from the
runner's own configs with random bf16 weights, and its inputs. Split from the script to keep it readable."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


@dataclass
class Case:
    family: str  # sdxl | flux
    train: str  # full | lora
    resolution: int
    batch: int = 1
    quick: bool = False
    tiny: bool = False

    @property
    def label(self) -> str:
        size = "tiny config" if self.tiny else "small config" if self.quick else "full size"
        return f"{self.family} ({size}, {'full fine-tune' if self.train == 'full' else 'LoRA r16'}, {self.resolution} px, batch {self.batch})"


# ---- models -------------------------------------------------------------------------------------
def model_config(case: Case) -> tuple[str, dict[str, Any]]:
    from runner.families.denoisers import denoiser_config
    from runner.families.flux.architecture import flux_configs
    from runner.families.sdxl.architecture import sdxl_configs

    cls_name, cfg = denoiser_config(case.family)
    if case.tiny:  # the trainers' test-size configs: only for checking this harness on a CPU
        cfg = (sdxl_configs("tiny")["unet"] if case.family == "sdxl"
               else flux_configs("tiny")["transformer"])
    elif case.quick and case.family == "sdxl":
        cfg.update(layers_per_block=1, transformer_layers_per_block=[1, 1, 2])
    if case.quick and case.family == "flux":
        cfg.update(num_layers=2, num_single_layers=4)
    return cls_name, cfg


def build_empty(case: Case) -> nn.Module:
    import diffusers

    cls_name, cfg = model_config(case)
    with torch.device("meta"):
        model = getattr(diffusers, cls_name).from_config(cfg)
    return model


def random_weights(case: Case, device: torch.device) -> dict[str, torch.Tensor]:
    """A bf16 state dict with random values, generated on ``device`` (fast) and kept on the host."""
    model = build_empty(case)
    out = {}
    g = torch.Generator(device=device).manual_seed(0)
    for name, t in list(model.state_dict().items()):
        v = torch.empty(t.shape, dtype=torch.bfloat16 if t.is_floating_point() else t.dtype, device=device)
        if not t.is_floating_point():
            v.zero_()
        elif t.dim() == 1 and name.endswith("weight"):
            v.fill_(1.0)  # norm scales
        elif t.dim() == 1:
            v.zero_()
        else:
            v.normal_(0.0, 0.02, generator=g)
        out[name] = v.to("cpu")
        del v
    return out


def fresh_model(case: Case, weights: dict[str, torch.Tensor]) -> nn.Module:
    """The model on the host in bf16 with ``weights`` (copied), ready for a variant to place it."""
    model = build_empty(case).to_empty(device="cpu").to(torch.bfloat16)
    model.load_state_dict(weights, strict=True)
    model.train()
    if case.train == "full":
        model.requires_grad_(True)
    else:
        from peft import LoraConfig

        model.requires_grad_(False)
        targets = [t for t in LORA_TARGETS if any(n.endswith(t) for n, _ in model.named_modules())]
        torch.manual_seed(0)  # the same adapters in every variant: their gradients are compared
        model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=targets))
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    return model


def make_inputs(case: Case, device: torch.device) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    b, dt = case.batch, torch.bfloat16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    _, cfg = model_config(case)
    latent = case.resolution // 8
    if case.family == "sdxl":
        pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
        return dict(sample=randn(b, 4, latent, latent), timestep=torch.tensor([500] * b, device=device),
                    encoder_hidden_states=randn(b, 77, cfg["cross_attention_dim"]),
                    added_cond_kwargs={"text_embeds": randn(b, pooled), "time_ids": randn(b, 6)}, return_dict=False)
    tokens = (latent // 2) ** 2
    img_ids = torch.zeros(tokens, 3, device=device)
    side = latent // 2
    img_ids[:, 1] = torch.arange(side, device=device).repeat_interleave(side)
    img_ids[:, 2] = torch.arange(side, device=device).repeat(side)
    return dict(hidden_states=randn(b, tokens, cfg["in_channels"]), encoder_hidden_states=randn(b, 512, cfg["joint_attention_dim"]),
                pooled_projections=randn(b, cfg["pooled_projection_dim"]), timestep=torch.full((b,), 0.5, device=device, dtype=dt),
                img_ids=img_ids, txt_ids=torch.zeros(512, 3, device=device),
                guidance=torch.full((b,), 3.5, device=device, dtype=dt), return_dict=False)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    from runner.blocks import find_repeated_blocks

    return find_repeated_blocks(model)


def nbytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())
