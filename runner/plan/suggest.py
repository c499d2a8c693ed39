"""Suggestions for a plan that does not fit.

When a plan does not fit, :func:`suggest` ranks the settings that would save the most. The
figures are *estimates* from the measured breakdown (for example "an 8-bit AdamW keeps 2 of
its 8 bytes per parameter"), each labelled with how it was derived; re-planning every candidate
would cost a full simulation each. :func:`verify_suggestions` re-plans them when asked.
"""
from __future__ import annotations

from typing import Any

from runner import registry
from runner.optim.build import OPTIMIZERS
from runner.plan.result import Plan


def _available(kind: str) -> list[str]:
    return registry.plugin_names(kind)


def _optimizer_names() -> list[str]:
    return list(OPTIMIZERS)


def _bytes_per_element(dtype_name: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype_name, 4)


class _Estimates:
    """What every suggestion reads from the plan (its breakdown at the peak, the trained and frozen
    modules, the run's dtypes) and the list the suggestions are added to, in the order they are
    found; the ranking sorts stably, so ties keep that order."""

    def __init__(self, plan: Plan, cfg: Any) -> None:
        self.plan, self.cfg = plan, cfg
        self.cats, self.mods = plan.by_category, plan.by_module
        self.trained = set(plan.run["modules"]) & {t.strip() for t in plan.run["trained"].split(",")}
        self.frozen = [m for m in plan.run["modules"] if m not in self.trained]
        self.weights = {m: self.mods.get(m, {}).get("weights", 0) for m in plan.run["modules"]}
        self.train_mode = plan.run["model_train"]
        self.frozen_dtype, self.train_dtype = plan.run["model_dtype"], plan.run["train_dtype"]
        self.chosen = {(kind, name): node for kind, name, node in registry.selected(cfg)}
        self.out: list[dict[str, Any]] = []

    def add(self, override: str, saves: float, how: str, upper_bound: bool = False) -> None:
        if saves > 0:
            self.out.append({"override": override, "saves_bytes": int(saves), "how": how, "upper_bound": upper_bound,
                             "kind": "estimate"})

    def trained_activations(self) -> int:
        return sum(self.mods.get(m, {}).get("activations", 0) for m in self.trained)

    def frozen_weights(self) -> int:
        """Weights stored in ``model.dtype``: the frozen modules', and a LoRA's frozen base."""
        frozen_w = sum(self.weights[m] for m in self.frozen)
        if self.train_mode != "full":  # any adapter
            frozen_w += sum(self.weights[m] for m in self.trained)  # the frozen base of a LoRA
        return frozen_w

    def checkpointing(self) -> None:
        cfg, chosen = self.cfg, self.chosen
        ckpt = "blocks" if ("checkpoint", "blocks") in chosen else ("none" if not cfg.get("checkpoint") else "other")
        if ckpt == "none" and "blocks" in _available("checkpoint"):
            self.add("checkpoint=blocks", self.trained_activations(), "activations of the trained modules alive at "
                     "the peak; blocks keep only their inputs, so the saving is this minus the block boundaries",
                     upper_bound=True)
        elif ckpt == "blocks" and chosen["checkpoint", "blocks"].get("mode") == "every_n":
            every_n = max(int(chosen["checkpoint", "blocks"].get("every_n", 2)), 1)
            self.add("checkpoint.blocks.mode=full", self.trained_activations() * (1 - 1 / every_n),
                     "the share of blocks every_n leaves unchecked, of the activations at the peak", upper_bound=True)

    def dtypes(self) -> None:
        cats, weights, trained = self.cats, self.weights, self.trained
        if self.train_mode == "full":
            base = _bytes_per_element(self.frozen_dtype)
            dn = sum(weights[m] for m in trained)
            saved = cats.get("gradients", 0) + cats.get("optimizer_state", 0) + dn * (1 - base / 4)
            self.add("model.train=lora", saved, f"gradients + optimizer state at the peak, and the trained weights "
                     f"stored in model.dtype ({base} B) instead of float32 master weights; LoRA's own few MB not "
                     "subtracted")
        if self.train_mode == "full" and self.train_dtype == "float32":
            adamw = str(self.cfg.optimizer.get("name", "adamw")) == "adamw"  # torch AdamW keeps moments in the weights' dtype
            trained_bytes = (sum(weights[m] for m in trained) + cats.get("gradients", 0)
                             + (cats.get("optimizer_state", 0) if adamw else 0))
            self.add("model.train_dtype=bfloat16", trained_bytes / 2, "trained weights and their gradients"
                     + (" and AdamW moments" if adamw else "") + " in bfloat16 instead of float32 (kohya's "
                     "--full_bf16); the autocast copies of the weights it also removes are not counted")
        if self.frozen_dtype == "float32":
            self.add("model.dtype=bfloat16", self.frozen_weights() / 2, "half of the float32 frozen weights at the peak")

    def optimizer(self) -> None:
        opt = str(self.cfg.optimizer.get("name", "adamw"))
        state = self.cats.get("optimizer_state", 0)
        if opt == "adamw" and state:
            names = _optimizer_names()
            if "adamw8bit" in names:
                self.add("optimizer=adamw8bit", state * 0.75 - state / 4 * 8 / 256 / 2, "AdamW's two float32 moments "
                         "(8 B/param) become two uint8 moments plus absmax per 256 (~2.03 B/param)")
            if "adafactor" in names:
                self.add("optimizer=adafactor", state * 0.95, "no first moment and a factored second moment: ~5% of "
                         "AdamW's state for matrices (upper bound: vectors keep a full moment)", upper_bound=True)

    def quantization(self) -> None:
        if self.cfg.get("quantization"):
            return
        q = _available("quantization")
        frozen_w = self.frozen_weights()
        per = _bytes_per_element(self.frozen_dtype)
        for name, bytes_per in (("nf4", 0.5 + 4 / 64), ("int8", 1.0 + 4 / 64), ("fp8", 1.0)):
            if name in q:
                self.add(f"quantization={name}", frozen_w * max(0.0, 1 - bytes_per / per),
                         f"frozen weights at {bytes_per:.2f} B/param instead of {per} (Linear layers only: an upper "
                         "bound)", upper_bound=True)
                break

    def offload(self) -> None:
        cfg, cats = self.cfg, self.cats
        savers = [n for n in _available("offload") if registry.get_plugin("offload", n).plan_saving == "frozen_weights"]
        if savers and not any(("offload", n) in self.chosen for n in savers) and self.frozen:
            frozen_w = sum(self.weights[m] for m in self.frozen)
            enc = 0
            if "encode" in self.plan.peak_phase:
                enc = cats.get("temporaries", 0) + cats.get("activations", 0)
            self.add(f"+offload={savers[0]}" if cfg.get("offload") else f"offload={savers[0]}", frozen_w + enc,
                     "frozen modules' weights on the device at the peak"
                     + (" and the encode step's activations (the peak is in encode)" if enc else "")
                     + "; with cached latents and embeddings they never reach the device")
        ema = cats.get("ema", 0)  # ema.device=device: the copy is on the device, and need not be
        if ema:
            self.add("ema.device=cpu", ema, "the EMA copy of the trained weights at the peak moves to host RAM; each "
                     "update then copies the weights to the host (ema.every spaces the updates)")

    def prepass(self) -> None:
        """A plan that peaks in an encoder pre-pass run with each encoder whole on the device: the setting of
        the plugin that runs it block by block (offload.park.fill=stream), saving up to the pre-pass's excess
        over training's peak (the pre-pass then holds one block of each encoder's weights)."""
        fill = self.plan.cache_fill or {}
        if fill.get("run_peak") != "pre-pass" or "cache fill streamed" in self.plan.notes:
            return
        for kind, name in self.chosen:
            setting = getattr(registry.plugin_entry(kind, name).config, "prepass_by_block_setting", "")
            if setting:
                self.add(f"{kind}.{name}.{setting}", fill["peak_bytes"] - fill["training_peak_bytes"],
                         "the encoder pre-pass peaks above training; block by block it holds one block of each "
                         "encoder's weights on the device (the same bytes cross to it, a little slower)", upper_bound=True)

    def micro_batch(self) -> None:
        run = self.plan.run
        micro = int(run["micro_batch_size"])
        if micro > 1:
            acts = self.cats.get("activations", 0) + self.cats.get("temporaries", 0)
            self.add(f"train.grad_accum={run['batch_size']}", acts * (1 - 1 / micro),
                     f"activations and temporaries scale with the micro-batch ({micro} -> 1)", upper_bound=True)


def suggest(plan: Plan, cfg: Any) -> list[dict[str, Any]]:
    """Settings that would lower the peak the most, each with an *estimated* saving.

    Every figure is arithmetic on the measured breakdown at the peak; ``how`` says which. They
    do not add up (two suggestions may save the same bytes), and savings marked ``upper_bound``
    are at most the figure. Only options that exist in this installation are suggested.
    """
    est = _Estimates(plan, cfg)
    est.checkpointing()
    est.dtypes()
    est.optimizer()
    est.quantization()
    est.offload()
    est.prepass()
    est.micro_batch()
    est.out.sort(key=lambda s: -s["saves_bytes"])
    return est.out
