"""Built-in trainers whose encode step draws extra noise with the runner's helper from seeds it computes
(``per_sample_randn(seeds * 31 + 17, ...)``): what a user's trainer does, planned inside the step."""
from __future__ import annotations

from typing import Any

import torch

from runner.families.flux.trainer import FluxTrainer
from runner.families.flux_kontext.trainer import FluxKontextTrainer
from runner.trainer import per_sample_randn


def _noisy(out: dict[str, Any]) -> dict[str, Any]:
    lat = out["latents"]
    extra = per_sample_randn(out["sample_seed"] * 31 + 17, tuple(lat.shape[1:]), lat.device, lat.dtype)
    return {**out, "latents": lat + 1e-3 * extra}


class NoisyFlux(FluxTrainer):
    def finish_encode(self, parts: dict[str, dict[str, torch.Tensor]], batch: Any) -> Any:
        return _noisy(super().finish_encode(parts, batch))


class NoisyKontext(FluxKontextTrainer):
    def finish_encode(self, parts: dict[str, dict[str, torch.Tensor]], batch: Any) -> Any:
        return _noisy(super().finish_encode(parts, batch))
