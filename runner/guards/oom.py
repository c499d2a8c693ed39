"""Out-of-memory recovery: discard the step, halve the micro-batch, retry the whole step.

Why the *whole* step: by the time a later micro-batch runs out of memory, earlier micro-batches
of the same step have already added their gradients into ``param.grad``. Resuming mid-step
would need to know exactly which contributions landed (an OOM in backward can leave a gradient
half-accumulated), so the step starts over instead: every partial gradient is dropped, the RNG
is put back to where the step began, and the same samples (the runner's ``BatchOrder`` chose
them before the first attempt, all of one size: runner/data/order.py) are cut into smaller micro-batches. Because each micro-batch's
loss is weighted by ``len(micro-batch) / batch_size``, the step's gradient is the same sum in a
different order: a retried step equals a step run with the smaller micro-batch from the start
(bit for bit on CPU, see tests/runner/guards/test_oom.py), and matches the un-split step up to float
summation order.

What is retried and what is not:

* the forward and backward passes of a step (trainer ``encode`` and ``loss`` included) are;
* gradient clipping and the optimizer step are *not*: they change parameters and optimizer
  state in place (one parameter at a time for ``foreach=False`` AdamW), so an OOM half-way
  leaves a state that no retry can undo, and their memory does not depend on the micro-batch
  anyway. Such an OOM ends the run with a clear message and no new checkpoint.

After a split the smaller micro-batch stays for the rest of the run (memory that did not fit
once will not fit next step either): it is logged once per split, written to every
``metrics.jsonl`` row (``micro_batch_size``) and saved in the checkpoint's ``state.json``, which
resume honours. At micro-batch 1 there is nothing left to split: :class:`OutOfMemoryGiveUp`
(a :class:`~runner.errors.UserError`, so the CLI prints it without a traceback) ends the run,
after the loop saved the last completed step.

Plugins hear about every OOM through ``on_oom(ctx, step, error)``, after the step's memory was
freed and before the retry. A plugin that keeps gradients or per-step buffers outside
``param.grad`` (e.g. host-side gradient copies) must discard them there, or they would be
counted twice.
"""
from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runner.errors import ResumableStop

if TYPE_CHECKING:
    from runner.context import RunContext

log = logging.getLogger("runner")

# torch >= 2.5 exposes torch.OutOfMemoryError; older releases only torch.cuda.OutOfMemoryError.
TorchOOM: type[BaseException] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

# Substrings (lower case) of allocator failures that do not use torch.OutOfMemoryError:
# "CUDA error: out of memory" (kernels, bitsandbytes), "MPS backend out of memory",
# "DefaultCPUAllocator: can't allocate memory" (CPU), "CUBLAS_STATUS_ALLOC_FAILED" (a cuBLAS
# workspace that could not be allocated), "CUDNN_STATUS_ALLOC_FAILED".
OOM_MESSAGES: tuple[str, ...] = ("out of memory", "can't allocate memory", "status_alloc_failed")

GIVE_UP_EXIT_CODE = 3


def is_out_of_memory(error: BaseException) -> bool:
    """True for allocator failures on any device: torch's OOM error, Python's MemoryError, or a
    RuntimeError whose message says the allocator failed."""
    if isinstance(error, (TorchOOM, MemoryError)):
        return True
    if isinstance(error, RuntimeError):
        text = str(error).lower()
        return any(m in text for m in OOM_MESSAGES)
    return False


class OutOfMemoryGiveUp(ResumableStop):
    """Out of memory at micro-batch 1: the run cannot go on without using less memory.

    Exit status 3 (not 2) so scripts can tell "does not fit" from "bad input".
    """

    exit_code = GIVE_UP_EXIT_CODE
    status = "oom"
    advice = "after lowering memory"

    def __init__(self, message: str, step: int, device: str) -> None:
        super().__init__(message, step)
        self.device = device


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def discard_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Drop every gradient of a partial step (``None``, like ``zero_grad(set_to_none=True)``)."""
    for p in params:
        p.grad = None


def release_memory(device: torch.device, card: Any = None) -> None:
    """Collect garbage (autograd graphs in reference cycles) and return cached CUDA blocks.

    ``empty_cache`` matters after an OOM: the failed attempt's blocks are free but still
    reserved in sizes the smaller micro-batch may not reuse (fragmentation).
    """
    gc.collect()
    if card is not None and card.active:  # train.device=cuda_sim: the simulated card's allocator
        card.empty_cache()
    elif device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def rng_snapshot(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def restore_rng(snapshot: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    cpu, cuda = snapshot
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


class MicroBatchRecovery:
    """Runs the forward/backward passes of each step and recovers from out-of-memory errors.

    ``run(step, passes)`` calls ``passes(micro_batch_size)``, which must do every forward and
    backward of the step with micro-batches of that size and return the step's loss. On an
    OOM: gradients dropped, memory released, plugins' ``on_oom`` called, micro-batch halved,
    RNG restored, ``passes`` called again from the start.
    """

    def __init__(self, ctx: RunContext, micro_batch_size: int, batch_size: int,
                 params: list[torch.nn.Parameter], unsplittable_because: str | None = None) -> None:
        self.ctx = ctx
        self.unsplittable_because = unsplittable_because  # set: an OOM ends the run at any micro-batch (fused backward)
        self.micro_batch_size = micro_batch_size
        self.batch_size = batch_size
        self.params = params
        self.retries_this_step = 0
        self.total_retries = 0

    def run(self, step: int, passes: Callable[[int], float]) -> float:
        """Do step ``step`` (1-based, as in metrics.jsonl); return its loss."""
        device = self.ctx.device
        rng = rng_snapshot(device)
        self.retries_this_step = 0
        while True:
            error: BaseException | None = None
            try:
                return passes(self.micro_batch_size)
            except Exception as e:  # only allocator failures are handled; anything else re-raised below
                if not is_out_of_memory(e):
                    raise
                error = e
            self._recover(step, error)
            del error
            restore_rng(rng, device)

    def _recover(self, step: int, error: BaseException) -> None:
        # The traceback references the frames of the failed attempt, and through them its
        # activations, loss and micro-batch: drop it before collecting, or nothing is freed.
        log.debug("out of memory in step %d", step, exc_info=error)
        error.__traceback__ = None
        error.__context__ = None
        discard_gradients(self.params)
        release_memory(self.ctx.device, self.ctx.card)
        self.ctx.run_phase("on_oom", step, error)
        old = self.micro_batch_size
        if old <= 1 or self.unsplittable_because:
            raise self._give_up(step, error)
        new = max(1, old // 2)
        passes = -(-self.batch_size // new)
        log.warning(
            "out of memory in step %d: micro-batch %d -> %d (%d passes for %s=%d); the step is retried "
            "from its start and the run keeps micro-batch %d. (%s)",
            step, old, new, passes, "train.batch_size" if not self.ctx.run.dist.active else "this rank's share of train.batch_size",
            self.batch_size, new, first_line(error),
        )
        self.micro_batch_size = new
        self.retries_this_step += 1
        self.total_retries += 1

    def update(self, step: int, apply: Callable[[], None], latest: Path | None) -> None:
        """Run the parameter update (clipping + optimizer step); an OOM there ends the run.

        Not retried (see the module docstring); ``latest`` is the newest saved checkpoint, named
        in the message.
        """
        error: BaseException | None = None
        try:
            apply()
            return
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            error = e
        error.__traceback__ = None
        line = first_line(error)
        discard_gradients(self.params)
        release_memory(self.ctx.device, self.ctx.card)
        self.ctx.run_phase("on_oom", step, error)
        saved = (f" The last saved checkpoint is {latest} (train.resume={latest})." if latest is not None
                 else " No checkpoint was saved in this run.")
        raise OutOfMemoryGiveUp(
            f"Out of memory in the optimizer step of step {step}. That memory (optimizer state, clipping buffers) "
            "does not depend on the micro-batch and the parameters may be half-updated, so the step is not "
            "retried and no checkpoint is written now. Use a smaller optimizer state (model.train=lora, an 8-bit "
            f"or offloaded optimizer) or free memory elsewhere.{saved} The allocator said: {line}.",
            step=step, device=str(self.ctx.device),
        )

    def _give_up(self, step: int, error: BaseException) -> OutOfMemoryGiveUp:
        cfg = self.ctx.cfg
        budget = cfg.get("budget_gb") if hasattr(cfg, "get") else None
        where = f"{self.ctx.device}" + (f" (budget_gb={budget})" if budget else "")
        if self.unsplittable_because and self.micro_batch_size > 1:
            return OutOfMemoryGiveUp(
                f"Out of memory in step {step} at micro-batch {self.micro_batch_size} on {where}: "
                f"{self.unsplittable_because}. Use a smaller train.batch_size, or optimizer.fused_backward=false with "
                "train.grad_accum to keep the batch; the planner (mode=plan, mode=fit) shows what fits. "
                f"The allocator said: {first_line(error)}.",
                step=step, device=str(self.ctx.device),
            )
        return OutOfMemoryGiveUp(
            f"Out of memory in step {step} even with micro-batch 1 (train.batch_size={self.batch_size} in passes of one "
            f"sample): the weights, gradients, optimizer state and one sample's activations do not fit on {where}. "
            "Use less memory per sample, e.g. checkpoint=blocks, model.train=lora, model.dtype=bfloat16, "
            "a quantization= or offload= plugin, or a smaller data.resolution. "
            f"The allocator said: {first_line(error)}.",
            step=step, device=str(self.ctx.device),
        )
