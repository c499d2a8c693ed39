"""The built-in SDXL trainer with an out-of-memory error injected on ONE rank, for multi-process tests.

``RUNNER_TEST_OOM="rank=1,step=2,above=1,block=3"`` (environment, read in each process): on the
process with ``RANK`` 1, while optimizer step 2 runs micro-batches of more than 1 sample, the
forward of the U-Net's 4th repeated block (index 3) raises a real ``torch.OutOfMemoryError``:
in the middle of the model's forward, after FSDP has all-gathered the blocks before it. The
other ranks run on; they must learn of it and retry the step with the same smaller micro-batch.
``block=-1`` raises in the trainer's loss instead, before the model is called. With ``val=1`` the
error is raised in the held-out pass instead (a forward without gradients, micro-batches of more
than ``above`` samples, whatever the step), where the other ranks are in the same forward too.

``RUNNER_TEST_COUNTS=<folder>``: each rank writes ``rank-<r>.json`` there with how many samples it
encoded through ``encode_part`` (the encoder cache's pre-pass), how many OOMs it raised, and
``built``: the parameter bytes each module this rank built holds at the step (parameters on ``meta``
hold none; the modules are kept referenced, so one park dropped still counts what it held, e.g. what
rank 0 broadcast into it).

Use with ``PYTHONPATH=tests/assets`` and ``trainer._target_=dist_trainer.OOMOnOneRankSDXL``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from runner.blocks import find_repeated_blocks
from runner.families.sdxl.trainer import SDXLTrainer


def _settings() -> dict[str, int]:
    raw = os.environ.get("RUNNER_TEST_OOM", "")
    return {k: int(v) for k, v in (kv.split("=") for kv in raw.split(",") if kv)}


class OOMOnOneRankSDXL(SDXLTrainer):
    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        self.oom = _settings()
        self.batch_size = int(cfg.train.batch_size)
        self.seed = int(cfg.train.seed)
        self.current: tuple[int, int] | None = None  # (step, micro-batch size) of the pass running now
        self.raised = 0
        self.encoded = 0
        self.modules_built: dict[str, Any] = {}

    def _due(self) -> bool:
        o = self.oom
        if not o or self.current is None or int(os.environ.get("RANK", "0")) != o.get("rank", 1):
            return False
        step, n = self.current
        if o.get("val", 0):  # the held-out pass: no gradients
            return not torch.is_grad_enabled() and n > o.get("above", 1)
        return torch.is_grad_enabled() and step == o.get("step", 2) and n > o.get("above", 1)

    def _raise(self) -> None:
        self.raised += 1
        self._write_counts()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected on one rank)")

    def build_models(self, device: Any = "cpu") -> Any:
        models = super().build_models(device)
        if str(device) != "meta":
            self.modules_built = dict(models.items())
        block = self.oom.get("block", 3)
        if self.oom and block >= 0 and str(device) != "meta":
            target = find_repeated_blocks(models["unet"])[block]

            def pre_hook(module: Any, args: Any) -> None:
                if self._due():
                    self._raise()

            target.register_forward_pre_hook(pre_hook)
        return models

    def encode_part(self, models: Any, part: str, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        self.encoded += len(batch["sample_seed"])
        return super().encode_part(models, part, batch)

    def _write_counts(self) -> None:
        folder = os.environ.get("RUNNER_TEST_COUNTS")
        if folder:
            rank = os.environ.get("RANK", "0")
            Path(folder).mkdir(parents=True, exist_ok=True)
            built = {name: sum(p.numel() * p.element_size() for p in m.parameters() if p.device.type != "meta")
                     for name, m in self.modules_built.items()}
            counts = {"encoded": self.encoded, "raised": self.raised, "built": built}
            (Path(folder) / f"rank-{rank}.json").write_text(json.dumps(counts))

    def loss(self, models: Any, batch: dict[str, Any]) -> torch.Tensor:
        self._write_counts()
        seeds = batch["sample_seed"].tolist()
        position = int(seeds[0]) - self.seed * 1_000_003
        self.current = (position // self.batch_size + 1, len(seeds))
        if self.oom.get("block", 3) < 0 and self._due():
            self._raise()
        return super().loss(models, batch)


class RecordsDtypesSDXL(SDXLTrainer):
    """The built-in SDXL trainer that records, per rank, the dtypes the U-Net computes with and stores.

    ``RUNNER_TEST_DTYPES=<folder>``: each rank writes ``rank-<r>.json`` after every loss with

    * ``forward``: the dtype, shape and tensor type of a Linear weight inside the first repeated block
      (an FSDP unit under ``dist=fsdp``), seen from a hook on that Linear while the block's forward runs;
    * ``stored``: the dtypes and tensor types of the U-Net's parameters outside the forward: under
      FSDP2 the sharded parameters the optimizer was built on.
    """

    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        self.seen: list[dict[str, Any]] = []

    def build_models(self, device: Any = "cpu") -> Any:
        models = super().build_models(device)
        if str(device) != "meta":
            block = find_repeated_blocks(models["unet"])[0]
            linear = next(m for m in block.modules() if isinstance(m, torch.nn.Linear))

            def pre_hook(module: Any, args: Any) -> None:
                if torch.is_grad_enabled():
                    w = module.weight
                    self.seen.append({"dtype": str(w.dtype), "shape": list(w.shape), "type": type(w).__name__})

            linear.register_forward_pre_hook(pre_hook)
        return models

    def loss(self, models: Any, batch: dict[str, Any]) -> torch.Tensor:
        stored = sorted({(str(p.dtype), type(p).__name__) for p in models["unet"].parameters()})
        self.seen.clear()
        out = super().loss(models, batch)
        folder = os.environ.get("RUNNER_TEST_DTYPES")
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / f"rank-{os.environ.get('RANK', '0')}.json").write_text(
                json.dumps({"forward": self.seen, "stored": stored}))
        return out
