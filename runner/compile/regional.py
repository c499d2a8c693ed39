"""``train.compile=true``: each repeated block's ``forward`` compiled once per block class.

Why regional: compiling a whole denoiser traces tens of blocks into one graph (minutes, and a
recompile for any change), while its blocks are a handful of classes repeated. Compiling the
block's ``forward`` gives one graph per class that every instance reuses (the parameters are the
graph's inputs, not constants), as diffusers' ``compile_repeated_blocks`` does; the peers report
+10-25% per step on the large DiTs.

What it composes with, and how:

* LoRA / LoKr / LoHa / DoRA: peft's layers are traced inside the block like any module;
* quantized bases: bitsandbytes' 4/8-bit layers run inside the graph where dynamo can trace
  them and as graph breaks (eager) where it cannot: same results, less speed-up;
* checkpoint=blocks: the compile happens before the plugins' ``wrap_execution``, so the
  checkpoint wrapper recomputes the *compiled* forward (runner/context.py orders it);
* offload=stream / park and activation offload: their module hooks stay outside the compiled
  ``forward`` and run eagerly; a compiled graph's saved tensors still pass through saved-tensor
  hooks, so offloading what autograd saves still works.

Trade-offs: the first call of each block class compiles (seconds on a GPU; tens of seconds
with inductor's C++ backend on a small CPU), logged once per class; a new input shape (another
bucket) compiles again, with dynamic shapes after the first change (torch.compile's default).
The planner plans the eager step (runner/plan/ keeps this a no-op): inductor's partitioner
saves at most what eager saves in the usual case, but that is not a bound it can prove, and it
knows of no memory a compiled graph adds beyond its kernels' workspaces.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from runner.blocks import find_repeated_blocks

if TYPE_CHECKING:
    from runner.context import RunContext

log = logging.getLogger("runner")

KIND = "compile"  # the ModuleHooks kind of a compiled block


class NoCompile:
    """``train.compile=false``: nothing is compiled."""

    enabled = False

    def apply(self, ctx: RunContext) -> None:
        return None


class RegionalCompile:
    """Compiles the repeated blocks of the trained modules (see the module docstring)."""

    enabled = True

    def __init__(self, mode: str = "default") -> None:
        self.mode = mode
        self.first_call_s: dict[str, float] = {}  # block class -> seconds of its first call (compile + run)

    def apply(self, ctx: RunContext) -> None:
        models = ctx.models
        if models is None:
            return
        done: dict[str, int] = {}
        for name in sorted(models.trained):
            blocks = models.blocks.get(name) or find_repeated_blocks(models[name])
            for block in blocks:
                self._compile(ctx, block)
            if blocks:
                done[name] = len(blocks)
        ctx.facts.compiled.update(done)
        classes = sorted({type(b).__name__ for n in done for b in (models.blocks.get(n) or find_repeated_blocks(models[n]))})
        if done:
            log.info("compile: %s (%s): each class compiles on its first call (mode=%s)",
                     ", ".join(f"{n}: {k} blocks" for n, k in done.items()), ", ".join(classes), self.mode)
        else:
            log.warning("compile: train.compile=true but no trained module has repeated blocks (%s): nothing compiled",
                        ", ".join(sorted(models.trained)) or "none trained")

    def _compile(self, ctx: RunContext, block: nn.Module) -> None:
        previous = block.__dict__.get("forward")  # an earlier wrapper of this instance, or None
        compiled = torch.compile(previous if previous is not None else block.forward, mode=self.mode)
        block.forward = self._timed(type(block).__name__, compiled)

        def undo(b: nn.Module = block, prev: Any = previous) -> None:
            if prev is None:
                b.__dict__.pop("forward", None)
            else:
                b.forward = prev

        ctx.hooks.add(block, KIND, "train.compile", undo=undo)

    def _timed(self, cls: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, logging how long the first call of each block class took (its compilation)."""
        stats = self.first_call_s

        def forward(*args: Any, **kwargs: Any) -> Any:
            if cls in stats:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            stats[cls] = time.perf_counter() - t0
            log.info("compile: %s compiled in %.1f s (its first call)", cls, stats[cls])
            return out

        return forward


def build_compiler(train: Any) -> NoCompile | RegionalCompile:
    """The run's compiler from ``train.compile`` / ``train.compile_mode`` (checked in runner/compile/config.py)."""
    get = train.get if hasattr(train, "get") else (lambda k, d=None: getattr(train, k, d))
    if not get("compile", False):
        return NoCompile()
    return RegionalCompile(str(get("compile_mode", "default")))
