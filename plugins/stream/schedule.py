"""Which blocks of a module are streamed: :func:`plan_stream`, and the execution-order guess.

Budget in bytes, not blocks
---------------------------
``offload.stream.device_budget_gb`` (or ``offload.stream.device_fraction`` of the module's weight bytes) bounds
the module's *weights* on the device: resident bytes plus the streaming window, i.e. the blocks
that can be loaded at once (the one computing and ``prefetch`` ahead). :func:`plan_stream`
precomputes which blocks are streamed, like OneTrainer's layer-offload strategy, so U-Nets with
blocks of very different sizes work as well as DiTs. The window is bounded by the ``prefetch + 1``
*largest* streamed blocks, which holds whatever order the blocks run in. Streaming ``prefetch +
1`` blocks or fewer saves nothing (they can all be in flight at once), so the plan streams the
largest blocks first (fewest transfers for the bytes saved), spreading equal-size blocks evenly
through the model so that resident compute sits between streamed blocks to hide their copies.
Activations, gradients and optimizer state are not part of this budget (the planner adds them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runner.compat import is_fake
from runner.errors import UserError
from runner.plugins.host_buffers import GiB, fmt_bytes, tensor_bytes

ALIGN = 256  # byte alignment of each parameter inside a block's device buffer (CUDA's own granularity)


def align(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`: a parameter's share of a block's device buffer."""
    return -(-n // ALIGN) * ALIGN


@dataclass
class BlockPlan:
    index: int
    name: str
    nbytes: int  # bytes a load of this block occupies on the device (streamable parameters, aligned)
    fixed_bytes: int  # bytes of the block that stay resident anyway (buffers, adapters, ...)
    streamed: bool = False
    why_resident: str = ""  # non-empty when the block cannot be streamed
    raw_bytes: int = 0  # the streamable parameters' bytes without alignment (what they take when resident)


@dataclass
class StreamPlan:
    """Which blocks of one module are streamed, and the device weight bytes that results."""

    module: str
    blocks: list[BlockPlan]
    total_bytes: int  # every parameter and buffer of the module
    outside_bytes: int  # parameters and buffers outside every block (always resident)
    budget_bytes: int
    prefetch: int

    @property
    def streamed(self) -> list[BlockPlan]:
        return [b for b in self.blocks if b.streamed]

    @property
    def streamed_bytes(self) -> int:
        return sum(b.nbytes for b in self.streamed)

    @property
    def resident_bytes(self) -> int:
        """Weight bytes always on the device: outside the blocks, resident blocks, fixed parts."""
        return self.outside_bytes + sum(b.fixed_bytes + (0 if b.streamed else b.raw_bytes) for b in self.blocks)

    @property
    def window_bytes(self) -> int:
        """Upper bound of streamed bytes on the device at once: the prefetch+1 largest streamed blocks."""
        sizes = sorted((b.nbytes for b in self.streamed), reverse=True)
        return sum(sizes[: self.prefetch + 1])

    @property
    def device_weight_bytes(self) -> int:
        return self.resident_bytes + self.window_bytes

    def describe(self) -> str:
        n = len(self.streamed)
        return (f"{self.module}: {n} of {len(self.blocks)} blocks streamed ({fmt_bytes(self.streamed_bytes)} on the host), "
                f"{fmt_bytes(self.resident_bytes)} resident + {fmt_bytes(self.window_bytes)} window "
                f"(prefetch {self.prefetch}) = {fmt_bytes(self.device_weight_bytes)} of weights on the device, "
                f"budget {fmt_bytes(self.budget_bytes)}")


def _param_owners(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for n, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, n))
    return owners


def _block_members(block: nn.Module) -> tuple[list[tuple[nn.Module, str, nn.Parameter]], list[torch.Tensor]]:
    params = []
    seen: set[int] = set()
    for m in block.modules():
        for n, p in m._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                params.append((m, n, p))
    return params, [b for b in block.buffers()]


def _streamable(block: nn.Module, shared: set[int]) -> tuple[list[tuple[nn.Module, str, nn.Parameter]], int, str]:
    """(parameters to stream, bytes that stay resident, reason the block must stay resident)."""
    params, buffers = _block_members(block)
    fixed = sum(tensor_bytes(b) for b in buffers)
    odd = [p for _, _, p in params if type(p) is not nn.Parameter and not is_fake(p)]  # fake: the planner
    if odd:
        kinds = sorted({type(p).__name__ for p in odd})
        return [], fixed + sum(tensor_bytes(p) for _, _, p in params), f"holds {', '.join(kinds)} parameters (quantized)"
    if any(id(p) in shared for _, _, p in params):
        return [], fixed + sum(tensor_bytes(p) for _, _, p in params), "shares parameters with another module"
    has_frozen = any(not p.requires_grad for _, _, p in params)
    chosen, kept = [], 0
    for owner, name, p in params:
        if p.requires_grad and has_frozen:  # adapters (LoRA) in a frozen block: keep resident
            kept += tensor_bytes(p)
        else:
            chosen.append((owner, name, p))
    return chosen, fixed + kept, ""


def _spread_rank(i: int, n: int) -> float:
    """Bit-reversed position of i in 0..n-1: taking items in this order spreads them evenly."""
    bits = max(1, (n - 1).bit_length())
    rev = int(format(i, f"0{bits}b")[::-1], 2)
    return rev / (1 << bits)


def _all_resident_plan(module: nn.Module, blocks: list[nn.Module], budget_bytes: int, prefetch: int,
                       name: str) -> StreamPlan:
    """Every block's streamable bytes and fixed part, nothing streamed yet."""
    owners = _param_owners(module)
    in_blocks = {id(p) for blk in blocks for p in blk.parameters()}
    # A parameter reachable from outside its block (tied weights) must not move under it.
    block_ids = {id(m) for blk in blocks for m in blk.modules()}
    shared = {pid for pid, where in owners.items() if pid in in_blocks and any(id(m) not in block_ids for m, _ in where)}
    total = sum(tensor_bytes(p) for p in module.parameters()) + sum(tensor_bytes(b) for b in module.buffers())
    inside = 0
    plans = []
    names = {id(m): n for n, m in module.named_modules()}
    for bi, blk in enumerate(blocks):
        params, fixed, why = _streamable(blk, shared)
        nbytes = sum(align(tensor_bytes(p)) for _, _, p in params)
        raw = sum(tensor_bytes(p) for _, _, p in params)
        inside += raw + fixed
        plans.append(BlockPlan(bi, names.get(id(blk), f"block{bi}"), nbytes, fixed, False, why, raw))
    return StreamPlan(name, plans, total, total - inside, int(budget_bytes), int(prefetch))


def _candidates(plan: StreamPlan) -> list[BlockPlan]:
    return [b for b in plan.blocks if not b.why_resident and b.nbytes > 0]


def plan_stream(module: nn.Module, blocks: list[nn.Module], budget_bytes: int, prefetch: int = 1,
                name: str = "module") -> StreamPlan:
    """Choose the streamed blocks of ``module`` so that its device weight bytes fit ``budget_bytes``.

    Works on ``meta`` modules (only shapes and dtypes are read), so the planner and validation can
    call it before anything is allocated. Raises :class:`UserError` when even streaming every
    block does not fit, naming the smallest budget that would.
    """
    if prefetch < 0:
        raise UserError(f"offload.stream.prefetch={prefetch} is not valid: it must be a whole number >= 0.")
    plan = _all_resident_plan(module, blocks, budget_bytes, prefetch, name)
    if plan.device_weight_bytes <= budget_bytes:
        return plan  # everything fits resident: nothing to stream
    candidates = _candidates(plan)
    # Largest first (fewest transfers per byte saved); equal sizes (within 1%) in spread order.
    def key(b: BlockPlan) -> tuple[float, float]:
        same = [c for c in candidates if abs(c.nbytes - b.nbytes) <= 0.01 * b.nbytes]
        pos = same.index(b)
        return (-max(c.nbytes for c in same), _spread_rank(pos, len(same)))
    for b in sorted(candidates, key=key):
        b.streamed = True
        if plan.device_weight_bytes <= budget_bytes:
            return plan
    minimum = plan.device_weight_bytes
    stuck = [b for b in plan.blocks if b.why_resident]
    why = ""
    if stuck:
        reasons = sorted({b.why_resident for b in stuck})
        why = (f" {len(stuck)} of {len(plan.blocks)} blocks cannot be streamed ({'; '.join(reasons)}): bitsandbytes "
               "nf4/int8 weights stay resident (quantization=fp8 streams).")
    raise UserError(
        f"offload=stream cannot fit {name}'s weights into the device budget of {fmt_bytes(budget_bytes)} "
        f"(offload.stream.device_budget_gb / offload.stream.device_fraction): even with all {len(candidates)} streamable blocks "
        f"streamed it needs {fmt_bytes(minimum)} ({fmt_bytes(plan.resident_bytes)} that stay resident + a "
        f"window of {plan.prefetch + 1} blocks of {fmt_bytes(plan.window_bytes)}).{why} Raise the budget to at least "
        f"{minimum / GiB:.3f} GiB or lower offload.stream.prefetch (now {prefetch})."
    )


def guess_execution_order(module: nn.Module, blocks: list[nn.Module]) -> list[int]:
    """Indices of ``blocks`` in the order a forward is expected to call them.

    Prefetching needs the execution order before the first forward has recorded it (the planner
    simulates only that one). Blocks usually come in module order, which for a diffusers U-Net is
    not the execution order: its ``up_blocks`` are registered before ``mid_block``, and each
    stage registers ``attentions`` before ``resnets`` but runs resnet 0, attention 0, resnet 1...
    For such a model the stages are put in down, mid, up order with resnets and attentions
    interleaved; anything else keeps the given order. The first forward records the real order.
    """
    base = module.get_base_model() if hasattr(module, "get_base_model") and not hasattr(module, "down_blocks") else module
    index = {id(b): i for i, b in enumerate(blocks)}
    if not (hasattr(base, "down_blocks") and hasattr(base, "up_blocks")):
        return list(range(len(blocks)))
    stages = list(base.down_blocks) + ([base.mid_block] if getattr(base, "mid_block", None) is not None else [])
    stages += list(base.up_blocks)
    order: list[int] = []
    for stage in stages:
        resnets = [m for m in (getattr(stage, "resnets", None) or []) if id(m) in index]
        attns = [m for m in (getattr(stage, "attentions", None) or []) if id(m) in index]
        for i in range(max(len(resnets), len(attns))):
            for group in (resnets, attns):
                if i < len(group):
                    order.append(index[id(group[i])])
    seen = set(order)
    return order + [i for i in range(len(blocks)) if i not in seen]


def minimum_device_bytes(module: nn.Module, blocks: list[nn.Module], prefetch: int = 1) -> int:
    """The smallest ``device_budget_bytes`` :func:`plan_stream` accepts: every streamable block
    streamed, so only what must stay resident and the window remain."""
    plan = _all_resident_plan(module, blocks, 0, prefetch, "module")
    for b in _candidates(plan):
        b.streamed = True
    return plan.device_weight_bytes
