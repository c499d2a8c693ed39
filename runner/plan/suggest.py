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


def suggest(plan: Plan, cfg: Any) -> list[dict[str, Any]]:
    """Settings that would lower the peak the most, each with an *estimated* saving.

    Every figure is arithmetic on the measured breakdown at the peak; ``how`` says which. They
    do not add up (two suggestions may save the same bytes), and savings marked ``upper_bound``
    are at most the figure. Only options that exist in this installation are suggested.
    """
    cats, mods = plan.by_category, plan.by_module
    trained = set(plan.run["modules"]) & {t.strip() for t in plan.run["trained"].split(",")}
    frozen = [m for m in plan.run["modules"] if m not in trained]
    weights = {m: mods.get(m, {}).get("weights", 0) for m in plan.run["modules"]}
    out: list[dict[str, Any]] = []

    def add(override: str, saves: float, how: str, upper_bound: bool = False) -> None:
        if saves > 0:
            out.append({"override": override, "saves_bytes": int(saves), "how": how, "upper_bound": upper_bound,
                        "kind": "estimate"})

    chosen = {(kind, name): node for kind, name, node in registry.selected(cfg)}
    ckpt = "blocks" if ("checkpoint", "blocks") in chosen else ("none" if not cfg.get("checkpoint") else "other")
    if ckpt == "none" and "blocks" in _available("checkpoint"):
        acts = sum(mods.get(m, {}).get("activations", 0) for m in trained)
        add("checkpoint=blocks", acts, "activations of the trained modules alive at the peak; blocks keep "
            "only their inputs, so the saving is this minus the block boundaries", upper_bound=True)
    elif ckpt == "blocks" and chosen["checkpoint", "blocks"].get("mode") == "every_n":
        acts = sum(mods.get(m, {}).get("activations", 0) for m in trained)
        add("checkpoint.blocks.mode=full", acts * (1 - 1 / max(int(chosen["checkpoint", "blocks"].get("every_n", 2)), 1)),
            "the share of blocks every_n leaves unchecked, of the activations at the peak", upper_bound=True)
    train_mode, frozen_dtype, train_dtype = plan.run["model_train"], plan.run["model_dtype"], plan.run["train_dtype"]
    if train_mode == "full":
        base = _bytes_per_element(frozen_dtype)
        dn = sum(weights[m] for m in trained)
        saved = cats.get("gradients", 0) + cats.get("optimizer_state", 0) + dn * (1 - base / 4)
        add("model.train=lora", saved, f"gradients + optimizer state at the peak, and the trained weights stored in "
            f"model.dtype ({base} B) instead of float32 master weights; LoRA's own few MB not subtracted")
    if train_mode == "full" and train_dtype == "float32":
        adamw = str(cfg.optimizer.get("name", "adamw")) == "adamw"  # torch AdamW keeps moments in the weights' dtype
        trained_bytes = (sum(weights[m] for m in trained) + cats.get("gradients", 0)
                         + (cats.get("optimizer_state", 0) if adamw else 0))
        add("model.train_dtype=bfloat16", trained_bytes / 2, "trained weights and their gradients"
            + (" and AdamW moments" if adamw else "") + " in bfloat16 instead of float32 (kohya's --full_bf16); "
            "the autocast copies of the weights it also removes are not counted")
    if frozen_dtype == "float32":
        frozen_w = sum(weights[m] for m in frozen)
        if train_mode == "lora":
            frozen_w += sum(weights[m] for m in trained)  # the frozen base of a LoRA
        add("model.dtype=bfloat16", frozen_w / 2, "half of the float32 frozen weights at the peak")
    opt = str(cfg.optimizer.get("name", "adamw"))
    state = cats.get("optimizer_state", 0)
    if opt == "adamw" and state:
        names = _optimizer_names()
        if "adamw8bit" in names:
            add("optimizer=adamw8bit", state * 0.75 - state / 4 * 8 / 256 / 2,
                "AdamW's two float32 moments (8 B/param) become two uint8 moments plus absmax per 256 (~2.03 B/param)")
        if "adafactor" in names:
            add("optimizer=adafactor", state * 0.95, "no first moment and a factored second moment: ~5% of AdamW's "
                "state for matrices (upper bound: vectors keep a full moment)", upper_bound=True)
    if not cfg.get("quantization"):
        q = _available("quantization")
        frozen_w = sum(weights[m] for m in frozen)
        if train_mode == "lora":
            frozen_w += sum(weights[m] for m in trained)
        per = _bytes_per_element(frozen_dtype)
        for name, bytes_per in (("nf4", 0.5 + 4 / 64), ("int8", 1.0 + 4 / 64), ("fp8", 1.0)):
            if name in q:
                add(f"quantization={name}", frozen_w * max(0.0, 1 - bytes_per / per),
                    f"frozen weights at {bytes_per:.2f} B/param instead of {per} (Linear layers only: an upper bound)",
                    upper_bound=True)
                break
    if ("offload", "park") not in chosen and "park" in _available("offload") and frozen:
        frozen_w = sum(weights[m] for m in frozen)
        enc = 0
        if "encode" in plan.peak_phase:
            enc = cats.get("temporaries", 0) + cats.get("activations", 0)
        add("+offload=park" if cfg.get("offload") else "offload=park", frozen_w + enc, "frozen modules' weights on the device at the peak"
            + (" and the encode step's activations (the peak is in encode)" if enc else "")
            + "; with cached latents and embeddings they never reach the device")
    ema = cats.get("ema", 0)  # ema.device=device: the copy is on the device, and need not be
    if ema:
        add("ema.device=cpu", ema, "the EMA copy of the trained weights at the peak moves to host RAM; each update "
            "then copies the weights to the host (ema.every spaces the updates)")
    micro = int(plan.run["micro_batch_size"])
    if micro > 1:
        acts = cats.get("activations", 0) + cats.get("temporaries", 0)
        add(f"train.grad_accum={plan.run['batch_size']}", acts * (1 - 1 / micro),
            f"activations and temporaries scale with the micro-batch ({micro} -> 1)", upper_bound=True)
    out.sort(key=lambda s: -s["saves_bytes"])
    return out
