"""Wan 2.2 A14B with both experts in one run (``trainer=wan trainer.variant=2.2-a14b trainer.experts=both``).

Wan2.2-T2V-A14B denoises t >= ``boundary`` (0.875, or ``boundary_ratio`` of the folder's
``model_index.json``) with its high-noise expert (``transformer/``) and the rest with its
low-noise one (``transformer_2/``). This trainer builds both as two trained modules of one
:class:`~runner.trainer.ModelSet`, ``transformer`` (high) and ``transformer_2`` (low), each with its own
LoRA, and trains one of them per optimizer step.

Which expert a step trains (the design choice, and why):

* **One expert per step, for the whole batch.** Every micro-batch of a step (gradient
  accumulation, the OOM recovery's splits) must run the same expert, or both would need their
  weights and gradients on the device at once, which is what this mode exists to avoid. So the
  expert is drawn per *step*, not per sample: :meth:`WanExpertsTrainer.expert_of_step` draws it from
  the run's seed and the step number alone (resume and any micro-batch split see the same expert),
  with probability equal to its share of the timestep range (``1 - boundary`` = 0.125 for the
  high-noise expert, ``boundary`` for the low-noise one). Each sample's t is then the family's
  draw scaled into that expert's range, exactly as a one-expert run (``trainer.experts=high|low``)
  draws it, so the two modes train each expert on the same noise levels.
* **Why random per step rather than "switch every N steps"** (ai-toolkit's ``switch_boundary_every``):
  a fixed alternation gives each expert half of the steps whatever its share of the schedule,
  and every N steps pays a switch. The per-step draw trains each expert in proportion to the part of
  the schedule it denoises, with no extra key to tune. Its cost: a switch is drawn on about
  ``2 b (1 - b)`` = 22% of the steps at b = 0.875, each moving one expert's weights (and its LoRA's
  optimizer state) host -> device: ~7 GiB for an nf4 14 B expert, ~0.3 s over PCIe 4, against a
  step of tens of seconds at 49 frames of 832x480.

Where the inactive expert is: on the host, whole (frozen weights, quantized or not; its LoRA
parameters; their optimizer state), pinned when the run is on CUDA, as ``offload=park`` keeps a
frozen module. Unlike park, whose frozen weights leave the device by a pointer swap to a host copy
kept for the run, a switch here copies the outgoing expert device -> host: keeping a host copy of
the *active* expert too would hold a second expert in pinned host RAM (7 GiB more at nf4) for a
saving of one copy on ~22% of the steps. Quantized layers (bitsandbytes' parameter types carry
their quantization state) move with their leaf module's ``Module.to`` (not pinned), the rest
tensor by tensor in place, so the optimizer keeps its parameter objects.
:meth:`WanExpertsTrainer.place_models` keeps the inactive expert out of the runner's placement
(``ctx.facts.placed``), and :meth:`WanExpertsTrainer.on_step_start` switches before a step whose
expert is the parked one: park the active first (its device memory is freed before the other's
arrives), then bring the other in.

One optimizer holds both LoRAs. That keeps the optimizer state correct because the parked expert's
LoRA parameters have no gradient (``grad`` is set to None when it is parked, and the loop zeroes
gradients with ``set_to_none``): AdamW (torch's, bitsandbytes', and the others the runner builds)
skips a parameter without a gradient, so neither its moments nor its weight decay nor its step
count move while the other expert trains (tests/runner/families/wan/test_wan_experts.py checks the
LoRA bit for bit). Two optimizers would need two schedulers and two state files for the same
result. Checkpoints therefore hold both LoRAs (``trainable.safetensors``: ``transformer.*`` and
``transformer_2.*``) and both experts' optimizer state; a resume loads the parked expert's state
on the host, where its parameters are.

Exports (runner/export/checkpoint.py calls :meth:`WanExpertsTrainer.write_lora_exports`): one
LoRA per expert, each in the layouts ``export.lora_format`` asks for, named with the
``_high_noise`` / ``_low_noise`` suffixes Wan 2.2 LoRAs are published with (the two words the
ComfyUI workflows and the trainers use for the two models): the diffusers files
``pytorch_lora_weights_high_noise.safetensors`` / ``..._low_noise.safetensors`` hold
``transformer.*`` keys, as diffusers' ``WanLoraLoaderMixin`` reads them: the first with
``pipe.load_lora_weights(file)``, the second with ``load_into_transformer_2=True``; the ComfyUI
files ``lora_comfy_high_noise.safetensors`` / ``lora_comfy_low_noise.safetensors`` in the Wan
ComfyUI layout of a one-expert run, each loaded onto its own model.

Not supported (refused before step 1): a full fine-tune (two 14 B experts' weights and optimizer
state), ``offload=stream`` and ``offload=optimizer`` (they place the trained weights or their
state themselves), samples during training (the two-expert pipeline is not wired to the sampler),
``ema.enabled`` (its export writes one LoRA), a held-out validation loss (``data.val_fraction`` /
``data.val_path``: it would be the active expert's alone), a single-file ``model.path`` (one
expert's weights), ``dist=ddp|fsdp`` (their wrappers hold every trained
module on the device).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from runner.compat import has_compatible_shallow_copy_type
from runner.adapters import lora_alpha
from runner.context import Transfer
from runner.errors import UserError
from runner.families.common.loading import attach_lora
from runner.families.wan.architecture import A14B_FOLDER, EXPERTS
from runner.families.wan.trainer import WanTrainer
from runner.trainer import Batch, ModelSet

log = logging.getLogger("runner")

MODULE = {"high": "transformer", "low": "transformer_2"}  # each expert's name in the ModelSet (= its diffusers folder)
SUFFIX = {"high": "_high_noise", "low": "_low_noise"}  # export file names (module docstring)
TRANSFER_KEY = "trainer/experts"  # ctx.facts.transfers: the expert switch's host -> device copies
EXPERT_SALT = 0x5EED_E4E7  # the per-step expert draw, apart from every per-sample draw
REFUSED_PLUGINS = {
    "offload/stream": "it streams each trained module's blocks from the host itself",
    "offload/optimizer": "it keeps the optimizer state on the host and steps it there itself",
}


class WanExpertsTrainer(WanTrainer):
    """Both Wan 2.2 A14B experts, one trained per step (module docstring)."""

    def __init__(self, cfg: Any, run: Any = None) -> None:
        super().__init__(cfg, run)
        self.refuse_unsupported(cfg, run)
        self.seed = int(run.seed if run is not None else cfg.train.seed)
        self.active = "high"  # the expert on the device; the planner plans its step (both have one architecture)
        self.switches = 0
        self.steps_by_expert = {e: 0 for e in EXPERTS}

    def refuse_unsupported(self, cfg: Any, run: Any) -> None:
        """What both experts in one run do not do, refused before anything is built (module docstring)."""
        if str(cfg.model.train) == "full":
            raise UserError("trainer.experts=both trains a LoRA (model.train=lora, lokr, loha) of each Wan 2.2 A14B expert; "
                            "model.train=full would keep two 14 B experts' weights and optimizer state. Use model.train=lora, "
                            "or fine-tune one expert per run with trainer.experts=high or low.")
        if self.source is not None and self.source[0] == "file":
            raise UserError(f"model.path={self.source[1]} is one file, which holds one Wan 2.2 A14B expert; "
                            "trainer.experts=both reads both from a Wan2.2-T2V-A14B-Diffusers folder (transformer/ and "
                            "transformer_2/). Give the folder, or train this expert alone (trainer.experts=high or low).")
        sample = cfg.get("sample") if hasattr(cfg, "get") else None
        if sample is not None and int(sample.get("every", 0) or 0) > 0:
            raise UserError(f"sample.every={sample.get('every')}: samples during training are not built for "
                            "trainer.experts=both (the sampler renders one transformer). Set sample.every=0, or sample the "
                            "exported LoRAs in WanPipeline (transformer and transformer_2).")
        from runner.val.config import val_source

        fraction, path = val_source(cfg)
        if fraction > 0 or path is not None:
            raise UserError(f"{'data.val_fraction' if fraction > 0 else 'data.val_path'} (a held-out validation loss) is "
                            "not built for trainer.experts=both: the loss would be each step's active expert's, on its "
                            "range of t only. Unset it, or validate the exported LoRAs of each expert.")
        ema = cfg.get("ema") if hasattr(cfg, "get") else None
        if ema is not None and bool(ema.get("enabled", False)):
            raise UserError("ema.enabled=true is not built for trainer.experts=both (the EMA export writes one LoRA). Set "
                            "ema.enabled=false, or train one expert per run (trainer.experts=high or low).")
        dist = getattr(getattr(run, "dist", None), "name", "none")
        if dist != "none":
            raise UserError(f"dist={dist} is not built for trainer.experts=both: the inactive expert's weights wait on the "
                            "host, which a DDP/FSDP wrapper of the trained modules does not allow. Train in one process, "
                            "or one expert per run (trainer.experts=high or low) with dist.")
        from runner import registry

        for kind, name, _ in registry.selected(cfg):
            why = REFUSED_PLUGINS.get(f"{kind}/{name}")
            if why is not None:
                raise UserError(f"{kind}={name} is not built for trainer.experts=both: {why}, while this trainer parks "
                                "the inactive expert with its LoRA and optimizer state on the host. Remove it "
                                "(offload=[park,activations] and quantization=[nf4] is the 24 GB setup), or train one "
                                "expert per run (trainer.experts=high or low).")

    # -- modules ----------------------------------------------------------------------------------
    def folder_name(self, name: str) -> str:
        """Each expert from its own subfolder: ``transformer/`` (high) and ``transformer_2/`` (low)."""
        return name

    def module_classes(self) -> dict[str, type]:
        classes = super().module_classes()
        return {**classes, MODULE["low"]: classes["transformer"]}

    def size_configs(self) -> dict[str, dict[str, Any]]:
        configs = super().size_configs()
        return {**configs, MODULE["low"]: dict(configs["transformer"])}  # the experts share one architecture

    def build_models(self, device: str | torch.device = "cpu") -> ModelSet:
        """Both experts, each with its own LoRA, both trained (one optimizer holds the two LoRAs)."""
        missing = [f for f in A14B_FOLDER.values() if self.source is not None and self.source[0] == "folder"
                   and not self._folder_has(f)]
        if missing:
            raise UserError(f"model.path '{self.source[1]}' has no '{missing[0]}/' subfolder: trainer.experts=both reads "
                            "the high-noise expert from transformer/ and the low-noise one from transformer_2/.")
        models = super().build_models(device)  # the high-noise expert with its LoRA, the low-noise one frozen
        m, low = self.cfg.model, models[MODULE["low"]]
        attach_lora(low, m.lora_rank, lora_alpha(m), list(m.lora_targets), self.train_dtype,
                    dora=bool(m.get("lora_dora", False)), kind=str(m.train), factor=int(m.get("lokr_factor", -1)))
        low.train()
        models.trained = set(MODULE.values())
        models.blocks = self.repeated_blocks(models)
        return models

    def repeated_blocks(self, models: ModelSet) -> dict[str, list[nn.Module]]:
        from runner.blocks import find_repeated_blocks

        return {name: find_repeated_blocks(models[name]) for name in MODULE.values() if name in models}

    # -- which expert ------------------------------------------------------------------------------
    def expert_of_step(self, step: int) -> str:
        """The expert optimizer step ``step`` (0-based) trains: high with probability ``1 - boundary``,
        from the run's seed and the step alone (resume- and split-invariant; module docstring)."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + int(step) * 7_919 + EXPERT_SALT) % (1 << 62))
        return "high" if float(torch.rand((), generator=g)) < 1.0 - self.boundary else "low"

    def timesteps(self, seeds: torch.Tensor, seq_len: int = 4096) -> torch.Tensor:
        """The family's t, scaled into the active expert's range (as a one-expert run of it)."""
        t = super(WanTrainer, self).timesteps(seeds, seq_len)
        b = self.boundary
        return b + (1.0 - b) * t if self.active == "high" else b * t

    def predict(self, models: ModelSet, noisy: torch.Tensor, timesteps: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The active expert's prediction (the other's weights are on the host)."""
        return super().predict({"transformer": models[MODULE[self.active]]}, noisy, timesteps, batch)

    # -- placement and switching (runner/context.py and runner/loop.py call these) -------------------
    def place_models(self, ctx: Any) -> None:
        """Before the runner moves the modules: the inactive expert stays on the host (pinned on CUDA)."""
        parked = MODULE[other(self.active)]
        move_expert(ctx.models[parked], ctx.host, pin=_pins(ctx))
        ctx.facts.placed.add(parked)
        nbytes = module_bytes(ctx.models[parked])
        if ctx.run.on_cuda:  # page-locked on the target GPU (the planner counts what a real run pins)
            ctx.note_pinned_bytes(pinned_bytes(ctx.models[parked]))
        # The step-time model's copies: a switch (probability 2 b (1 - b) per step) brings one expert in.
        b = self.boundary
        ctx.facts.transfers[TRANSFER_KEY] = Transfer(h2d_bytes=int(2 * b * (1 - b) * nbytes))
        ctx.notes["parked on the host"] = (
            f"trainer.experts=both: {MODULE[self.active]} ({self.active}-noise expert) is the step planned; "
            f"{parked} ({other(self.active)}-noise) waits on the host: {nbytes / 2**30:.2f} GiB of weights and LoRA "
            "(in the host figures), and its LoRA's optimizer state once it has trained (as large as the active "
            "expert's, not in the host figures); a switch moves one expert in on ~"
            f"{200 * b * (1 - b):.0f}% of the steps")
        ctx.notes["parked expert bytes"] = nbytes
        log.info("trainer.experts=both: %s (%s-noise) on the device, %s parked on %s (%.1f MiB)", MODULE[self.active],
                 self.active, parked, ctx.host, nbytes / 2**20)

    def on_step_start(self, ctx: Any, step: int) -> None:
        """Switch experts when step ``step`` (0-based) draws the parked one."""
        want = self.expert_of_step(step)
        self.steps_by_expert[want] += 1
        if want == self.active:
            ctx.facts.transfers[TRANSFER_KEY] = Transfer()
            return
        state = optimizer_state(ctx.optimizer)
        out, back = ctx.models[MODULE[self.active]], ctx.models[MODULE[want]]
        move_expert(out, ctx.host, state, pin=_pins(ctx))  # first: its device memory is free before the other arrives
        move_expert(back, ctx.device, state)
        ctx.facts.transfers[TRANSFER_KEY] = Transfer(h2d_bytes=module_bytes(back))  # this step's copies (step time)
        log.debug("step %d: %s-noise expert (%s) on %s, %s parked", step + 1, want, MODULE[want], ctx.device,
                  MODULE[self.active])
        self.active = want
        self.switches += 1

    # -- exports (runner/export/checkpoint.py) -----------------------------------------------------
    def write_lora_exports(self, pipeline_class: type, models: ModelSet, folder: Any, info: dict[str, Any],
                           ec: Any) -> list[str]:
        """Each expert's LoRA files (``export.lora_format``), suffixed ``_high_noise`` / ``_low_noise``."""
        from runner.export.lora import write_lora_files

        files: list[str] = []
        for expert, name in MODULE.items():
            written = write_lora_files(self, pipeline_class, "transformer", models[name], folder,
                                       info, ec)
            for f in written:
                stem, ext = f.rsplit(".", 1)
                target = f"{stem}{SUFFIX[expert]}.{ext}"
                (folder / f).rename(folder / target)
                files.append(target)
        return files


def other(expert: str) -> str:
    return "low" if expert == "high" else "high"


def _pins(ctx: Any) -> bool:
    """Host copies are page-locked on a real CUDA run (asynchronous copies back), as park pins."""
    return bool(ctx.run.on_cuda) and torch.cuda.is_available() and not ctx.simulate


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def pinned_bytes(module: nn.Module) -> int:
    """What :func:`move_expert` page-locks on the host: every tensor but those of quantized layers
    (bitsandbytes' packed 4/8-bit weights, and the planner's simulation of them: integer storage)."""
    def quantized(sub: nn.Module) -> bool:
        return any(t.dtype in (torch.uint8, torch.int8) for t in [*sub.parameters(recurse=False),
                                                                  *sub.buffers(recurse=False)])

    return sum(module_bytes_own(sub) for sub in module.modules() if not quantized(sub))


def module_bytes_own(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)])


def optimizer_state(optimizer: Any) -> dict[Any, dict[str, Any]]:
    """The per-parameter state of ``optimizer`` or of the optimizer a wrapper holds (fused backward,
    8-bit, accelerate's); empty before the optimizer exists."""
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        state = getattr(optimizer, "state", None)
        if isinstance(state, dict):
            return state
        optimizer = getattr(optimizer, "inner", None) or getattr(optimizer, "optimizer", None)
    return {}


def move_expert(module: nn.Module, device: torch.device | str, state: dict[Any, dict[str, Any]] | None = None,
                pin: bool = False) -> None:
    """Every parameter and buffer of ``module`` onto ``device``, in place (the optimizer keeps its
    parameter objects), with their optimizer ``state``; moving to the host drops the gradients.

    Quantized layers (bitsandbytes' parameter types) move with their leaf module's ``Module.to``;
    the rest by ``tensor.data = copy`` (``torch.utils.swap_tensors`` where the two devices' tensor
    types differ, as the planner's ``meta``), pinned on the host when ``pin``."""
    device = torch.device(device)
    seen: set[int] = set()
    for sub in module.modules():
        own = list(sub.parameters(recurse=False))
        if any(type(p) is not nn.Parameter for p in own):
            sub.to(device)
            continue
        for t in [*own, *sub.buffers(recurse=False)]:
            if id(t) in seen:
                continue
            seen.add(id(t))
            _move(t, device, pin)
            if isinstance(t, nn.Parameter) and state and t in state:
                for k, v in state[t].items():
                    # "step": left where the optimizer keeps it (a host scalar, or fused AdamW's device one)
                    if isinstance(v, torch.Tensor) and k != "step" and v.device != device:
                        state[t][k] = _copy(v, device, pin)
    if device.type == "cpu":
        for p in module.parameters():
            p.grad = None  # the parked LoRA has no gradient: the optimizer skips it (module docstring)


def _copy(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    if device.type == "cpu":  # to the host: a blocking copy (a pinned buffer must not be read before it lands)
        out = t.detach().to(device)
        return out.pin_memory() if pin else out
    return t.detach().to(device, non_blocking=t.is_pinned())


def _move(t: torch.Tensor, device: torch.device, pin: bool) -> None:
    if t.device == device:  # already there (the parked expert at setup): page-locked in place when asked
        if pin and device.type == "cpu" and not t.is_pinned():
            t.data = t.data.pin_memory()
        return
    new = _copy(t.data, device, pin)
    if has_compatible_shallow_copy_type(t.data, new):
        t.data = new
        return
    holder = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
    torch.utils.swap_tensors(t, holder)
