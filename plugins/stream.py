"""Streamed weight offload (``offload=stream``): train a denoiser larger than the device budget.

The weights of a chosen set of repeated blocks live in (pinned) host memory and are copied to
the device just before each block runs, on a side stream, ``offload.prefetch`` blocks ahead;
they are dropped from the device when the block is done. The rest of the model stays resident.

Budget in bytes, not blocks
---------------------------
``offload.device_budget_gb`` (or ``offload.device_fraction`` of the module's weight bytes) bounds
the module's *weights* on the device: resident bytes plus the streaming window, i.e. the blocks
that can be loaded at once (the one computing and ``prefetch`` ahead). :func:`plan_stream`
precomputes which blocks are streamed, like OneTrainer's layer-offload strategy, so U-Nets with
blocks of very different sizes work as well as DiTs. The window is bounded by the ``prefetch + 1``
*largest* streamed blocks, which holds whatever order the blocks run in. Streaming ``prefetch +
1`` blocks or fewer saves nothing (they can all be in flight at once), so the plan streams the
largest blocks first (fewest transfers for the bytes saved), spreading equal-size blocks evenly
through the model so that resident compute sits between streamed blocks to hide their copies.
Activations, gradients and optimizer state are not part of this budget (the planner adds them).

How training stays correct (where accelerate's cpu_offload and diffusers' group offloading fail)
-------------------------------------------------------------------------------------------------
* **Parameter identity.** Each streamed parameter keeps its ``nn.Parameter`` object, whose data
  lives on the host: the optimizer, ``state_dict`` and checkpoints see it. While a block is
  loaded, its module holds a *device twin* (a second, persistent ``nn.Parameter``) in
  ``module._parameters`` instead (the FSDP2 approach); between uses the twin's data is an empty
  tensor, so the device memory is really returned. Twins persist, so the autograd graph of a
  forward (which holds the twin, e.g. in ``AccumulateGrad``) stays valid when the block is
  reloaded for backward.
* **Saved weights.** Autograd saves weights, or views of them (``F.linear`` saves
  ``weight.t()``), for backward; such a view would keep the device copy alive and defeat the
  offload. While a streamed block runs forward, ``saved_tensors_hooks`` replace a saved twin, a
  view of it, or (full fine-tune under autocast) its low-precision cast by a reference, which is
  resolved in backward from the reloaded weights, loading the block on demand if it is not
  there: a weight can never be read while it is not on the device. Other saved tensors go to
  the hooks that were active before (activation offload), so both compose.
* **Backward order.** A hook on each block's outputs fires when backward reaches the block: the
  block is loaded there, ``prefetch`` blocks further in backward order are started, and the
  blocks that ran *after* it in forward are released. That last rule needs no hook on the
  inputs: the autograd engine runs the ready node with the highest sequence number first and a
  node only depends on nodes created after it, so when a block's output node runs, every node
  of later blocks has run. (An identity node on the block inputs would also tell, but it changes
  the order in which a shared input's gradient is summed, e.g. the time embedding's in every
  block, and with it the last bits.) With activation checkpointing the recomputation runs inside
  the block's backward, i.e. after the load; this holds whether checkpointing wraps ``forward``
  (plugins/checkpoint.py, either order) or calls the module (diffusers). The end of backward
  releases whatever is left. The last ``prefetch + 1`` streamed blocks stay loaded across the
  forward->backward turn (backward needs them first; this stays within the window). The
  execution order is guessed before the first forward (diffusers U-Nets register their stages
  and blocks in another order than they run: :func:`guess_execution_order`) and recorded by it.
* **Gradients of streamed trained parameters** (full fine-tune) are copied device->host on a
  second side stream from a post-accumulate-grad hook, accumulated over micro-batches on the
  host, and exposed as the host parameter's ``.grad`` when backward ends; the optimizer then
  steps those parameters (and keeps their state) on the host, ZeRO-offload style. Clipping
  works on the host gradients like on any other. Frozen weights are never copied back: dropping
  them is a pointer swap to the pinned host copy. In a block that has frozen weights (LoRA), the
  trained adapters stay resident and keep their usual device gradients and optimizer.

Pinned memory
-------------
Host copies are page-locked with ``cudaHostRegister`` on page-aligned anonymous mappings rather
than ``pin_memory()``: PyTorch's pinned allocator rounds every allocation up to a power of two
(up to 2x the host RAM for a 12 B model). The frozen weights of a block share one region (one
copy per block, so host->device copies run at full bandwidth); each trained parameter gets its
own region (its own storage, so safetensors can save it). Pinning only happens when CUDA is
available; on CPU and under the planner's fake tensors everything is synchronous and nothing is
pinned, with the same code path otherwise (``always_copy`` lets CPU tests exercise real copies).

One offload option per run: ``offload=stream`` therefore also does ``offload=park``'s work on the
frozen modules (``offload.park``, default true, with park's own keys ``cache_latents``,
``cache_text``, ``cache_dir``, ``encode_batch_size``), and with ``offload.activations=true`` /
``offload.optimizer=true`` (+ ``offload.step_on_host``) the work of ``offload=activations`` and
``offload=optimizer``, through those plugins' twin functions. Combined with the optimizer offload,
gradients stay on the device until the step (``offload_gradients`` off), so the runner's clipping
sees every gradient: the streamed blocks' on the host, the resident ones' on the device.

Planner (``ctx.simulate``): the same code runs synchronously on fake tensors (device ``meta``,
host fake ``cpu``), so the planned device bytes contain exactly the resident weights and the
window, and the streamed bytes are reported as pinned host memory (``ctx.state
["pinned_host_bytes"]``); a weight read in backward after its release would be a fake-tensor
device mismatch, so every planned step also checks the load/release order.

Trade-offs: every streamed byte crosses PCIe twice per step (forward and backward; frozen
blocks without backward work are not reloaded), so the saving is paid in bandwidth; it is free
only while resident compute hides the copies (bench/offload_bench.py measures it). Full
fine-tune also runs the streamed parameters' optimizer step on the host CPU. Under autocast with
float32 master weights, each streamed block's bf16 weight casts are kept out of the autocast
cache (it is cleared after the block), which costs nothing because each weight is used once.
Blocks holding quantized parameters (bitsandbytes) or parameters shared with other modules stay
resident.
"""
from __future__ import annotations

import logging
import mmap
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from runner.errors import UserError, valid_list
from runner.plugin import Plugin, PluginConfig
from runner.registry import register_plugin

if TYPE_CHECKING:
    from runner.context import RunContext

log = logging.getLogger("runner")

GiB = 2**30
ALIGN = 256  # byte alignment of each parameter inside a block's device buffer (CUDA's own granularity)
PAGE = mmap.PAGESIZE


# ---- config ----------------------------------------------------------------------------------
@dataclass
class StreamConfig(PluginConfig):
    """``offload=stream``: repeated blocks' weights streamed from pinned host memory to the device."""

    name: str = "stream"
    device_budget_gb: Optional[float] = None  # GiB of the streamed modules' weights on the device; null: device_fraction
    device_fraction: float = 0.5  # used when device_budget_gb is null: this share of the modules' weight bytes
    prefetch: int = 1  # blocks copied ahead of the one computing (window = prefetch + 1 blocks)
    modules: list[str] = field(default_factory=list)  # modules to stream; empty = the trained ones
    pin_memory: bool = True  # page-lock host copies (CUDA only) so copies run asynchronously
    activations: bool = False  # also offload saved activations to the host (offload=activations)
    optimizer: bool = False  # also keep the remaining optimizer state on the host (offload=optimizer)
    step_on_host: bool = True  # with optimizer=true: run that optimizer step on the host too
    park: bool = True  # also offload=park's work: frozen modules on the host, their outputs cached
    cache_latents: bool = True  # with park: as offload.cache_latents of offload=park
    cache_text: bool = True  # with park: as offload.cache_text of offload=park
    cache_dir: Optional[str] = None  # with park: as offload.cache_dir of offload=park
    encode_batch_size: Optional[int] = None  # with park: as offload.encode_batch_size of offload=park


# ---- pinned host memory -------------------------------------------------------------------------
class HostRegion:
    """A page-aligned host buffer, page-locked with ``cudaHostRegister`` when asked and possible.

    Why not ``torch.empty(..., pin_memory=True)``: the caching host allocator rounds each
    allocation up to a power of two, which for long-lived weights and gradients wastes up to half
    of the pinned RAM. An anonymous ``mmap`` is page-aligned by construction, so registering it
    never overlaps another allocation's pages; ``close()`` unregisters it (the memory stays valid
    and pageable as long as tensors use it).
    """

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = max(PAGE, -(-int(nbytes) // PAGE) * PAGE)
        self._mm = mmap.mmap(-1, self.nbytes)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.pinned = False
        if pin and torch.cuda.is_available():
            try:
                err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
                self.pinned = int(err) == 0
            except Exception as e:  # pragma: no cover - depends on the CUDA runtime
                log.warning("stream: cudaHostRegister unavailable (%s); host copies stay pageable", e)
            if not self.pinned:
                log.warning("stream: could not page-lock %.1f MiB of host memory (ulimit -l?); copies will be slower",
                            self.nbytes / 2**20)

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like ``like`` at byte ``offset`` of this region (not yet filled)."""
        n = like.numel() * like.element_size()
        return self.tensor[offset:offset + n].view(like.dtype).view(like.shape)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False


def host_copy(t: torch.Tensor, pin: bool) -> tuple[torch.Tensor, HostRegion | None]:
    """A host copy of ``t`` in its own (optionally page-locked) region; other modules reuse this
    for long-lived host buffers (optimizer masters and gradients)."""
    if not pin or not torch.cuda.is_available() or _is_fake(t):
        return t.detach().to("cpu", copy=True), None
    region = HostRegion(t.numel() * t.element_size(), pin=True)
    out = region.view(0, t)
    out.copy_(t.detach())
    return out, region


def _is_fake(t: Any) -> bool:
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, FakeTensor)


def fmt_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2**20:.1f} MiB"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- the plan: which blocks are streamed ---------------------------------------------------------
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
    fixed = sum(_nbytes(b) for b in buffers)
    odd = [p for _, _, p in params if type(p) is not nn.Parameter and not _is_fake(p)]  # fake: the planner
    if odd:
        kinds = sorted({type(p).__name__ for p in odd})
        return [], fixed + sum(_nbytes(p) for _, _, p in params), f"holds {', '.join(kinds)} parameters (quantized)"
    if any(id(p) in shared for _, _, p in params):
        return [], fixed + sum(_nbytes(p) for _, _, p in params), "shares parameters with another module"
    has_frozen = any(not p.requires_grad for _, _, p in params)
    chosen, kept = [], 0
    for owner, name, p in params:
        if p.requires_grad and has_frozen:  # adapters (LoRA) in a frozen block: keep resident
            kept += _nbytes(p)
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
    total = sum(_nbytes(p) for p in module.parameters()) + sum(_nbytes(b) for b in module.buffers())
    inside = 0
    plans = []
    names = {id(m): n for n, m in module.named_modules()}
    for bi, blk in enumerate(blocks):
        params, fixed, why = _streamable(blk, shared)
        nbytes = sum(_align(_nbytes(p)) for _, _, p in params)
        raw = sum(_nbytes(p) for _, _, p in params)
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
        raise UserError(f"offload.prefetch={prefetch} is not valid: it must be a whole number >= 0.")
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
        f"(offload.device_budget_gb / offload.device_fraction): even with all {len(candidates)} streamable blocks "
        f"streamed it needs {fmt_bytes(minimum)} ({fmt_bytes(plan.resident_bytes)} that stay resident + a "
        f"window of {plan.prefetch + 1} blocks of {fmt_bytes(plan.window_bytes)}).{why} Raise the budget to at least "
        f"{minimum / GiB:.3f} GiB or lower offload.prefetch (now {prefetch})."
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


# ---- streaming runtime -------------------------------------------------------------------------
RELEASED, INFLIGHT, LOADED = 0, 1, 2


class _Slot:
    """One streamed parameter: its host parameter (the real one) and its device twin."""

    __slots__ = ("block", "owner", "name", "host", "dev", "trainable", "offset", "nbytes", "installed",
                 "staging", "grad_region", "staging_region")

    def __init__(self, block: _Block, owner: nn.Module, name: str, host: nn.Parameter, dev: nn.Parameter,
                 offset: int) -> None:
        self.block = block
        self.owner = owner
        self.name = name
        self.host = host
        self.dev = dev
        self.trainable = host.requires_grad
        self.offset = offset
        self.nbytes = _nbytes(host)
        self.installed = False
        self.staging: torch.Tensor | None = None
        self.grad_region: HostRegion | None = None
        self.staging_region: HostRegion | None = None


class _Block:
    __slots__ = ("index", "module", "name", "slots", "streamed", "state", "flat", "event", "flat_bytes",
                 "arena", "arena_bytes", "region", "__weakref__")

    def __init__(self, index: int, module: nn.Module, name: str, streamed: bool) -> None:
        self.index = index
        self.module = module
        self.name = name
        self.slots: list[_Slot] = []
        self.streamed = streamed
        self.state = RELEASED
        self.flat: torch.Tensor | None = None
        self.event: Any = None
        self.flat_bytes = 0
        self.arena: torch.Tensor | None = None  # host bytes of the frozen slots, laid out like `flat`
        self.arena_bytes = 0
        self.region: HostRegion | None = None


class _WeightRef:
    """What a streamed block's saved-tensor hook stores instead of a weight (or a view/cast of it)."""

    __slots__ = ("slot", "cast", "geometry")

    def __init__(self, slot: _Slot, cast: torch.dtype | None, geometry: tuple | None) -> None:
        self.slot = slot
        self.cast = cast
        self.geometry = geometry


class _Delegated:
    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed


def _composable(fn: Callable) -> Callable:
    fn._runner_composable = True  # saved-tensor hooks of ours: nest with each other
    return fn


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _autocast_on(device: torch.device) -> bool:
    if device.type == "meta":  # the planner simulates autocast itself; its cache is cleared by the plugin
        return True
    try:
        return torch.is_autocast_enabled(device.type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return False


@dataclass
class StreamStats:
    loads: int = 0  # block loads issued (forward + backward)
    waited: int = 0  # loads that were still in flight when needed (the copy was not hidden)
    on_demand: int = 0  # loads issued only when the block was needed (no prefetch)
    late: int = 0  # loads forced by a saved weight needed after its block was released
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    peak_device_bytes: int = 0  # most streamed-weight bytes on the device at once (<= the plan's window)


class StreamHandle:
    """A module whose blocks stream their weights; created by :func:`apply_stream_offload`."""

    def __init__(self, module: nn.Module, blocks: list[nn.Module], plan: StreamPlan, device: torch.device,
                 host: torch.device, prefetch: int, pin_memory: bool, always_copy: bool,
                 clear_cast_cache: Callable[[], None] = torch.clear_autocast_cache) -> None:
        self.module = module
        self.clear_cast_cache = clear_cast_cache
        self.plan = plan
        self.device = device
        self.host = host
        self.prefetch = prefetch
        self.stats = StreamStats()
        self.regions: list[HostRegion] = []
        self._hooks: list[Any] = []
        fake = any(_is_fake(p) for p in module.parameters()) or device.type == "meta"
        self.async_copies = device.type != "cpu" and device.type != "meta" and not fake and device.type != host.type
        self.pin = bool(pin_memory) and self.async_copies and device.type == "cuda"
        self.same_storage = device == host and not always_copy
        self._api = torch.get_device_module(device) if self.async_copies else None
        self._h2d = self._api.Stream(device=device) if self.async_copies else None
        self._d2h = self._api.Stream(device=device) if self.async_copies else None
        self._empties: dict[torch.dtype, torch.Tensor] = {}
        self._pending: list[tuple[Any, _Slot | None]] = []  # (event, slot to add staging into) of d2h copies
        self._callback_task: int | None = None
        self._owners: dict[int, _Slot] = {}  # id(device twin) -> slot
        self.blocks: list[_Block] = []
        self._order: list[int] = []  # block indices in recorded forward execution order
        self._seen: list[int] = []  # blocks called in this forward, in order (one entry per call)
        self._first_pos: dict[int, int] = {}  # block -> position of its first call in this forward
        self._call_pos: dict[int, int] = {}  # block -> position of its call in progress
        self._bwd_seq: list[tuple[int, int]] = []  # (position, block) of calls whose outputs need backward
        self._keep: set[int] = set()
        self._ahead: dict[int, list[int]] = {}
        self._stack: list[tuple[int, Any]] = []  # saved-tensor hooks entered by block pre hooks
        self._learned = False  # the execution order has been recorded by one forward
        self._timing: list[tuple[str, Any, Any, int]] | None = None  # (direction, start, end, bytes) when timed
        self.removed = False
        self._build(blocks)
        self._finalizer = weakref.finalize(self, _close_regions, self.regions)

    # -- construction -----------------------------------------------------------------------
    def _empty(self, dtype: torch.dtype) -> torch.Tensor:
        t = self._empties.get(dtype)
        if t is None:
            t = self._empties[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return t

    def _build(self, blocks: list[nn.Module]) -> None:
        names = {id(m): n for n, m in self.module.named_modules()}
        streamed_slots: set[int] = set()
        for bp, blk in zip(self.plan.blocks, blocks):
            b = _Block(bp.index, blk, names.get(id(blk), bp.name), bp.streamed)
            self.blocks.append(b)
            if not bp.streamed:
                continue
            params, _, _ = _streamable(blk, set())
            # Frozen slots first: they share one host region, laid out exactly like the device buffer.
            params.sort(key=lambda t: t[2].requires_grad)
            offset = 0
            for owner, name, p in params:
                dev = nn.Parameter(self._empty(p.dtype), requires_grad=p.requires_grad)
                s = _Slot(b, owner, name, p, dev, offset)
                offset += _align(s.nbytes)
                b.slots.append(s)
                self._owners[id(dev)] = s
                streamed_slots.add(id(p))
            b.flat_bytes = offset
        # Place everything that is not streamed on the device (identity kept where torch allows).
        for m in self.module.modules():
            for n, p in list(m._parameters.items()):
                if p is not None and id(p) not in streamed_slots:
                    _move_param(m, n, p, self.device)
            for n, buf in list(m._buffers.items()):
                if buf is not None:
                    m._buffers[n] = buf.to(self.device)
        for b in self.blocks:
            if b.streamed:
                self._host_layout(b)
        for s in self._all_slots():
            if s.trainable:
                self._hooks.append(s.dev.register_post_accumulate_grad_hook(self._make_grad_hook(s)))
        self._set_order(guess_execution_order(self.module, [b.module for b in self.blocks]))
        self._hooks.append(self.module.register_forward_pre_hook(self._root_pre))
        self._hooks.append(self.module.register_forward_hook(self._root_post, always_call=True))
        for b in self.blocks:
            self._hooks.append(b.module.register_forward_pre_hook(self._make_pre(b)))
            self._hooks.append(b.module.register_forward_hook(self._make_post(b), always_call=True))

    def _host_layout(self, b: _Block) -> None:
        """Move the block's host parameters to (pinned) host memory; frozen ones share one region."""
        frozen = [s for s in b.slots if not s.trainable]
        frozen_bytes = (frozen[-1].offset + _align(frozen[-1].nbytes)) if frozen else 0
        if self.pin and frozen:
            region = HostRegion(frozen_bytes, pin=True)
            self.regions.append(region)
            b.region = region
            b.arena = region.tensor[:frozen_bytes]
            b.arena_bytes = frozen_bytes
            for s in frozen:
                view = region.view(s.offset, s.host)
                view.copy_(s.host.detach())
                s.host.data = view
        for s in b.slots:
            if s.trainable and self.pin:
                copy, region = host_copy(s.host, pin=True)
                if region is not None:
                    self.regions.append(region)
                s.host.data = copy
            elif s.host.device != self.host:
                _move_param(s.owner, s.name, s.host, self.host)
                s.host = s.owner._parameters[s.name]

    def _all_slots(self) -> Iterable[_Slot]:
        for b in self.blocks:
            yield from b.slots

    def _set_order(self, order: list[int]) -> None:
        self._order = list(order)
        streamed = [i for i in self._order if self.blocks[i].streamed]
        self._keep = set(streamed[-(self.prefetch + 1):]) if streamed else set()
        self._ahead = {}
        for pos, i in enumerate(self._order):
            nxt = [j for j in self._order[pos + 1:] if self.blocks[j].streamed][: self.prefetch]
            self._ahead[i] = nxt

    # -- loading and releasing --------------------------------------------------------------
    def _flat_view(self, b: _Block, s: _Slot) -> torch.Tensor:
        return b.flat[s.offset:s.offset + s.nbytes].view(s.host.dtype).view(s.host.shape)

    def _issue(self, b: _Block) -> None:
        """Start copying block ``b`` to the device (on the side stream when there is one)."""
        if b.state != RELEASED or not b.streamed:
            return
        self.stats.loads += 1
        if self.same_storage:
            b.state = LOADED
            return
        stream_ctx = self._api.stream(self._h2d) if self.async_copies else nullcontext()
        with stream_ctx:
            timing = self._timing is not None and self.async_copies
            if timing:
                start = self._h2d.record_event(self._api.Event(enable_timing=True))
            flat = torch.empty(b.flat_bytes, dtype=torch.uint8, device=self.device)
            b.flat = flat
            rest = b.slots
            if b.arena is not None:
                flat[:b.arena_bytes].copy_(b.arena, non_blocking=self.async_copies)
                rest = [s for s in b.slots if s.trainable]
            for s in rest:
                self._flat_view(b, s).copy_(s.host.detach(), non_blocking=self.async_copies)
            if self.async_copies:
                b.event = self._h2d.record_event(self._api.Event(enable_timing=True) if timing else None)
                if timing:
                    self._timing.append(("h2d", start, b.event, b.flat_bytes))
        self.stats.h2d_bytes += b.flat_bytes
        b.state = INFLIGHT if self.async_copies else LOADED
        now = self.device_bytes()
        if now > self.stats.peak_device_bytes:
            self.stats.peak_device_bytes = now

    def _use(self, b: _Block) -> None:
        """Make block ``b``'s weights usable on the current stream and install its device twins."""
        if not b.streamed:
            return
        if b.state == RELEASED:
            self.stats.on_demand += 1
            self._make_room()
            self._issue(b)
        if b.state == INFLIGHT:
            self.stats.waited += int(not b.event.query())
            current = self._api.current_stream(self.device)
            current.wait_event(b.event)
            b.flat.record_stream(current)  # allocated on the copy stream, used on this one
            b.event = None
            b.state = LOADED
        for s in b.slots:
            if not s.installed:
                s.dev.data = s.host.data if self.same_storage else self._flat_view(b, s)
                s.owner._parameters[s.name] = s.dev
                s.installed = True

    def _release_slot(self, s: _Slot) -> None:
        if s.installed:
            s.owner._parameters[s.name] = s.host
            s.dev.data = self._empty(s.host.dtype)
            s.installed = False

    def _release(self, b: _Block) -> None:
        if not b.streamed or b.state == RELEASED:
            return
        if b.state == INFLIGHT:  # prefetched but never used: finish the copy before dropping it
            b.event.synchronize()
            b.event = None
        for s in b.slots:
            self._release_slot(s)
        if not any(s.installed for s in b.slots):
            b.flat = None
            b.state = RELEASED

    def _loaded(self) -> list[_Block]:
        return [b for b in self.blocks if b.state != RELEASED]

    def _make_room(self) -> None:
        """Keep at most prefetch+1 blocks loaded: drop prefetched blocks nobody uses yet (a wrong
        guess of the order) before loading one that is needed now."""
        loaded = self._loaded()
        for other in loaded:
            if len(loaded) <= self.prefetch:
                break
            if not any(s.installed for s in other.slots):
                self._release(other)
                loaded.remove(other)

    def _prefetch(self, indices: Iterable[int]) -> None:
        for i in indices:
            b = self.blocks[i]
            if b.state == RELEASED and len(self._loaded()) > self.prefetch:
                break  # the window is full
            self._issue(b)

    # -- forward hooks ------------------------------------------------------------------------
    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if _in_backward():
            return
        self._seen = []
        self._first_pos = {}
        self._bwd_seq = []
        first = self._order[0] if self._order else None
        wanted = set(self._ahead.get(first, [])) | ({first} if first is not None else set())
        for b in self.blocks:  # a forward starts: only the first window stays
            if b.index not in wanted:
                self._release(b)

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if _in_backward():
            return
        if self._seen and len(set(self._seen)) == len(self._seen) and set(self._seen) == set(range(len(self.blocks))):
            if self._seen != self._order:
                log.debug("stream: execution order recorded; it differs from the guess")
                self._set_order(self._seen)  # the recorded execution order drives prefetch from now on
            self._learned = True

    def _make_pre(self, b: _Block) -> Callable:
        def pre(module: nn.Module, args: tuple) -> None:
            if _in_backward():  # recomputation through the module call (diffusers checkpointing)
                self._queue_final()
                self._use(b)
                return None
            pos = len(self._seen)
            self._seen.append(b.index)
            self._first_pos.setdefault(b.index, pos)
            self._call_pos[b.index] = pos
            self._use(b)
            self._prefetch(self._ahead.get(b.index, ()))
            if b.streamed and torch.is_grad_enabled():
                self._push_saved_hooks(b)
            return None

        return pre

    def _make_post(self, b: _Block) -> Callable:
        def post(module: nn.Module, args: tuple, output: Any) -> None:
            if _in_backward():
                return None
            self._pop_saved_hooks(b)
            grad_on = torch.is_grad_enabled()
            outs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if grad_on and outs:
                pos = self._call_pos.get(b.index, len(self._seen) - 1)
                self._bwd_seq.append((pos, b.index))
                torch.autograd.graph.register_multi_grad_hook(outs, self._make_pre_backward(b, pos), mode="any")
            if not b.streamed:
                return None
            if any(s.trainable for s in b.slots) and _autocast_on(self.device):
                self.clear_cast_cache()  # drop the cached low-precision casts of the streamed weights
            if not (grad_on and outs and self._learned and b.index in self._keep):
                self._release(b)
            return None

        return post

    # -- saved tensors -------------------------------------------------------------------------
    def _push_saved_hooks(self, b: _Block) -> None:
        """Enter this block's saved-tensor hooks (popped by the post hook, strictly nested)."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        hooks = None
        if outer is None or getattr(outer[0], "_runner_composable", False):
            # Otherwise someone else's hooks are active (a checkpoint region that calls the
            # module): they already keep nothing alive, so every tensor is left to them.
            hooks = torch.autograd.graph.saved_tensors_hooks(self._make_pack(outer), self._make_unpack(outer))
            try:
                hooks.__enter__()
            except RuntimeError:  # saved-tensor hooks are disabled in this region
                hooks = None
        self._stack.append((b.index, hooks))

    def _pop_saved_hooks(self, b: _Block) -> None:
        if self._stack and self._stack[-1][0] == b.index:
            _, hooks = self._stack.pop()
            if hooks is not None:
                hooks.__exit__(None, None, None)

    def _slot_of(self, t: torch.Tensor) -> tuple[_Slot, torch.dtype | None] | None:
        owners = self._owners
        s = owners.get(id(t))
        if s is not None:
            return s, None
        base = t._base
        if base is not None:
            s = owners.get(id(base))
            if s is not None:
                return s, None
        src = base if base is not None else t
        fn = src.grad_fn
        if fn is not None and type(fn).__name__ == "ToCopyBackward0":  # autocast cast of a trained weight
            nxt = fn.next_functions[0][0] if fn.next_functions else None
            var = getattr(nxt, "variable", None)
            if var is not None:
                s = owners.get(id(var))
                if s is not None:
                    return s, src.dtype
        return None

    def _make_pack(self, outer: tuple | None) -> Callable:
        outer_pack = outer[0] if outer is not None else None

        def pack(t: torch.Tensor) -> Any:
            found = self._slot_of(t)
            if found is not None:
                s, cast = found
                ref = s.dev if cast is None else t._base if t._base is not None else t
                if t is s.dev:
                    return _WeightRef(s, None, None)
                base_off = s.dev.storage_offset() if cast is None else ref.storage_offset()
                geometry = (tuple(t.shape), tuple(t.stride()), t.storage_offset() - base_off)
                return _WeightRef(s, cast, geometry)
            if outer_pack is not None:
                return _Delegated(outer_pack(t))
            return t

        return _composable(pack)

    def _make_unpack(self, outer: tuple | None) -> Callable:
        outer_unpack = outer[1] if outer is not None else None

        def unpack(x: Any) -> torch.Tensor:
            if isinstance(x, _WeightRef):
                s = x.slot
                if not s.installed:
                    self.stats.late += 1
                    self._queue_final()
                    self._use(s.block)
                if x.geometry is None:
                    return s.dev
                base = s.dev.detach()
                if x.cast is not None:
                    base = base.to(x.cast)
                    off = x.geometry[2]
                else:
                    off = base.storage_offset() + x.geometry[2]
                return base.as_strided(x.geometry[0], x.geometry[1], off)
            if isinstance(x, _Delegated):
                return outer_unpack(x.packed)
            return x

        return _composable(unpack)

    # -- backward ---------------------------------------------------------------------------
    def _queue_final(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._callback_task:
            self._callback_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _make_pre_backward(self, b: _Block, pos: int) -> Callable:
        """Backward has reached the call of block ``b`` at forward position ``pos``.

        The autograd engine runs the ready node with the highest sequence number first, and
        every node depends only on nodes created after it, so when this call's output node runs,
        every node created after it in forward has run: blocks whose first call came later are
        done with backward and are released here. This leaves the graph untouched (an identity
        node on the inputs would change the order in which a shared input's gradient, e.g. the
        time embedding's, is summed, and so its last bits).
        """
        ref = weakref.ref(self)

        def pre_backward(grad: Any) -> None:
            me = ref()
            if me is None:
                return
            me._queue_final()
            for other in me.blocks:
                if other.state != RELEASED and me._first_pos.get(other.index, -1) > pos:
                    me._release(other)
            me._use(b)
            ahead: list[int] = []
            for p, j in reversed(me._bwd_seq):
                if p < pos and me.blocks[j].streamed and j != b.index and j not in ahead:
                    ahead.append(j)
                    if len(ahead) >= me.prefetch:
                        break
            me._prefetch(ahead)

        return pre_backward

    def _make_grad_hook(self, s: _Slot) -> Callable:
        ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            me = ref()
            g = param.grad
            if me is None or g is None:
                return
            param.grad = None  # the device gradient goes to the host parameter
            me._queue_final()
            if s.host.grad is None:
                s.host.grad = me._to_host(s, g, staging=False)
            else:  # a later micro-batch: accumulate on the host, like AccumulateGrad would on the device
                staged = me._to_host(s, g, staging=True)
                if me.async_copies:
                    event, _ = me._pending[-1]
                    me._pending[-1] = (event, s)  # added once the copy has landed
                else:
                    s.host.grad.add_(staged)
            me._release_slot(s)  # every use of this weight in this backward is done
            b = s.block
            if not any(x.installed for x in b.slots):
                b.flat = None
                b.state = RELEASED

        return hook

    def _to_host(self, s: _Slot, g: torch.Tensor, staging: bool) -> torch.Tensor:
        """``g`` on the host: the same tensor on a CPU run, else a copy into the slot's persistent
        host buffer (``staging`` when it must be added to an existing gradient)."""
        if self.same_storage:
            return g
        self.stats.d2h_bytes += _nbytes(g)
        if not self.async_copies:
            return g.detach().to(self.host, copy=True)
        if staging:
            if s.staging_region is None:
                s.staging_region = HostRegion(_nbytes(g), self.pin)
                self.regions.append(s.staging_region)
                s.staging = s.staging_region.view(0, s.host)
            buf = s.staging
        else:
            if s.grad_region is None:
                s.grad_region = HostRegion(_nbytes(g), self.pin)
                self.regions.append(s.grad_region)
            buf = s.grad_region.view(0, s.host)
        current = self._api.current_stream(self.device)
        with self._api.stream(self._d2h):
            self._d2h.wait_stream(current)  # the gradient was produced on the compute stream
            timing = self._timing is not None
            if timing:
                start = self._d2h.record_event(self._api.Event(enable_timing=True))
            buf.copy_(g, non_blocking=True)
            g.record_stream(self._d2h)  # its memory is not reused before the copy has read it
            end = self._d2h.record_event(self._api.Event(enable_timing=True) if timing else None)
            self._pending.append((end, None))
            if timing:
                self._timing.append(("d2h", start, end, _nbytes(g)))
        return buf

    def _finish_backward(self) -> None:
        """End of backward: finish gradient copies, expose host gradients, release every block."""
        self._callback_task = None
        for event, slot in self._pending:
            event.synchronize()
            if slot is not None:
                slot.host.grad.add_(slot.staging)
        self._pending.clear()
        if self.async_copies and any(s.trainable for s in self._all_slots()):
            # The optimizer is about to update the trained host parameters on the CPU; copies of
            # them that only the GPU has waited for may still be reading them.
            self._h2d.synchronize()
        for b in self.blocks:
            self._release(b)

    # -- lifecycle ------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget a failed step (OOM): drop pending copies and every loaded block."""
        if self.async_copies:
            self._h2d.synchronize()
            self._d2h.synchronize()
        for event, _ in self._pending:
            event.synchronize()
        self._pending.clear()
        self._callback_task = None
        while self._stack:
            _, hooks = self._stack.pop()
            if hooks is not None:
                hooks.__exit__(None, None, None)
        for b in self.blocks:
            self._release(b)

    def time_copies(self, enabled: bool = True) -> None:
        """Record CUDA events around every copy (for benchmarks; costs two events per copy)."""
        self._timing = [] if enabled and self.async_copies else None

    def copy_seconds(self) -> dict[str, tuple[float, int]]:
        """{"h2d"|"d2h": (seconds the copy stream spent copying, bytes)} since :meth:`time_copies`.

        Synchronizes. Bytes over seconds is the bandwidth the copies achieved while streaming,
        to compare with a plain pinned copy of the same size.
        """
        out: dict[str, tuple[float, int]] = {}
        for direction, start, end, nbytes in self._timing or []:
            end.synchronize()
            secs, total = out.get(direction, (0.0, 0))
            out[direction] = (secs + start.elapsed_time(end) / 1000.0, total + nbytes)
        if self._timing is not None:
            self._timing.clear()
        return out

    def device_bytes(self) -> int:
        """Bytes of streamed weights on the device right now."""
        return sum(b.flat_bytes for b in self.blocks if b.state != RELEASED and b.flat is not None)

    def pinned_bytes(self) -> int:
        """Host bytes page-locked for this module (0 without CUDA)."""
        return sum(r.nbytes for r in self.regions if r.pinned)

    def host_bytes(self) -> int:
        """Host bytes of streamed weights (pinned or not): what the planner reports as pinned host RAM."""
        return sum(s.nbytes for s in self._all_slots())

    def remove(self, to_device: bool = False) -> None:
        """Detach every hook and drop the streamed weights from the device.

        Streamed parameters stay on the host (unpinned) unless ``to_device``: then they move to
        the device and the module is a plain device module again. Resident parts stay where
        they are.
        """
        if self.removed:
            return
        self.reset()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for s in self._all_slots():
            if to_device:
                _move_param(s.owner, s.name, s.host, self.device)
        self._finalizer()
        self.removed = True


def _close_regions(regions: list[HostRegion]) -> None:
    for r in regions:
        r.close()


def _move_param(owner: nn.Module, name: str, p: nn.Parameter, device: torch.device) -> None:
    """Move one parameter like ``Module.to`` does: same object where torch allows, else a new one."""
    if p.device == device:
        return
    new = p.detach().to(device)
    if torch._has_compatible_shallow_copy_type(p, new):
        p.data = new
    else:  # e.g. fake cpu -> fake meta in the planner
        owner._parameters[name] = nn.Parameter(new, requires_grad=p.requires_grad)


def apply_stream_offload(
    module: nn.Module,
    blocks: list[nn.Module],
    device_budget_bytes: int,
    prefetch: int = 1,
    device: torch.device | str = "cuda",
    host: torch.device | str = "cpu",
    *,
    pin_memory: bool = True,
    always_copy: bool = False,
    name: str = "module",
    plan: StreamPlan | None = None,
    clear_cast_cache: Callable[[], None] = torch.clear_autocast_cache,
) -> StreamHandle:
    """Stream the weights of ``blocks`` (in execution order) of ``module`` within a byte budget.

    Everything outside the streamed blocks is moved to ``device``; the streamed blocks' weights
    go to ``host`` (page-locked when CUDA is available and ``pin_memory``). ``always_copy`` makes
    a CPU run copy weights between host and "device" tensors anyway (tests use it to exercise
    the copy paths). Returns a handle; ``handle.remove()`` undoes the hooks.
    """
    device, host = torch.device(device), torch.device(host)
    if getattr(module, "_runner_stream_handle", None) is not None:
        raise ValueError("apply_stream_offload: this module is already streamed; call handle.remove() first")
    plan = plan or plan_stream(module, blocks, device_budget_bytes, prefetch, name)
    handle = StreamHandle(module, blocks, plan, device, host, prefetch, pin_memory, always_copy, clear_cast_cache)
    module._runner_stream_handle = handle
    _orig_remove = handle.remove

    def remove(to_device: bool = False) -> None:
        _orig_remove(to_device)
        module.__dict__.pop("_runner_stream_handle", None)

    handle.remove = remove  # type: ignore[method-assign]
    return handle


# ---- the plugin --------------------------------------------------------------------------------
def check_config(c: Any) -> None:
    if c.device_budget_gb is not None and not c.device_budget_gb > 0:
        raise UserError(f"offload.device_budget_gb={c.device_budget_gb!r} is not valid: give a number of GiB > 0, "
                        "or null to use offload.device_fraction.")
    if c.device_budget_gb is None and not 0 < c.device_fraction <= 1:
        raise UserError(f"offload.device_fraction={c.device_fraction!r} is not valid: give a share of the weight "
                        "bytes in (0, 1] (0.5 keeps half of them on the device), or set offload.device_budget_gb.")
    if not isinstance(c.prefetch, int) or isinstance(c.prefetch, bool) or c.prefetch < 0:
        raise UserError(f"offload.prefetch={c.prefetch!r} is not valid: give a whole number of blocks >= 0 "
                        "(1 copies the next block while one computes).")


@register_plugin
class StreamOffload(Plugin):
    kind = "offload"
    name = "stream"
    Config = StreamConfig
    description = ("repeated blocks' weights in pinned host memory, streamed to the device ahead of use "
                   "within a byte budget (offload.device_budget_gb); +activations/+optimizer offload")

    def _park(self) -> Plugin | None:
        """offload=park's plugin with our settings, when ``offload.park`` (one offload option per run)."""
        c = self.config
        if not c.park:
            return None
        from runner.plugins.park import Park, ParkConfig

        return Park(ParkConfig(cache_latents=bool(c.cache_latents), cache_text=bool(c.cache_text),
                               cache_dir=c.cache_dir, encode_batch_size=c.encode_batch_size,
                               pin_memory=bool(c.pin_memory)))

    def validate(self, cfg: Any) -> None:
        c = self.config
        check_config(c)
        park = self._park()
        if park is not None:
            park.validate(cfg)
        if cfg is None:
            return
        full = str(cfg.model.get("train", "full")) == "full"
        if full and str(cfg.train.get("mixed_precision", "no")) == "fp16":
            raise UserError(
                "offload=stream with model.train=full and train.mixed_precision=fp16: the streamed parameters' "
                "gradients live on the host, where fp16 gradient scaling (GradScaler) does not unscale them. "
                "Use train.mixed_precision=bf16 (or no), or model.train=lora."
            )
        if c.activations:
            from runner.plugins.offload_activations import ActivationOffloadConfig, check_config as check_act

            check_act(ActivationOffloadConfig())
        if c.optimizer:
            from runner.plugins.offload_optimizer import OptimizerOffloadConfig, check_run

            check_run(OptimizerOffloadConfig(step_on_host=c.step_on_host), cfg, "offload.step_on_host")

    def _targets(self, ctx: RunContext) -> list[str]:
        names = list(self.config.modules) or sorted(ctx.models.trained)
        unknown = [n for n in names if n not in ctx.models]
        if unknown:
            raise UserError(f"offload.modules names {', '.join(map(repr, unknown))}, which the trainer does not build. "
                            f"Valid names: {valid_list(unknown[0], ctx.models.modules)}.")
        return names

    def place_models(self, ctx: RunContext) -> None:
        # The trainers' discovery: a U-Net's resnets and attentions, not only its transformer blocks.
        from runner.blocks import find_repeated_blocks

        c = self.config
        check_config(c)
        handles: dict[str, StreamHandle] = {}
        names = self._targets(ctx)
        park = self._park()
        if park is not None:
            frozen = [n for n in names if n not in ctx.models.trained]
            if frozen:
                raise UserError(f"offload.modules names {', '.join(map(repr, frozen))}, a frozen module that "
                                "offload.park=true already keeps on the host (visiting the device per call); set "
                                "offload.park=false to stream it instead, or leave it out of offload.modules.")
            park.place_models(ctx)  # first: its encode pre-pass runs while the denoiser is still on the host
            ctx.state.setdefault(self.key, {})["park"] = park
        sizes = {n: sum(_nbytes(p) for p in ctx.models[n].parameters()) + sum(_nbytes(b) for b in ctx.models[n].buffers())
                 for n in names}
        total = sum(sizes.values()) or 1
        for n in names:
            module = ctx.models[n]
            blocks = ctx.models.blocks.get(n) or find_repeated_blocks(module)
            if not blocks:
                raise UserError(f"offload=stream found no repeated blocks in {n} ({type(module).__name__}) to stream; "
                                "give the trainer's ModelSet.blocks or choose offload.modules.")
            if c.device_budget_gb is not None:  # one budget, shared in proportion to weight bytes
                budget = int(c.device_budget_gb * GiB * sizes[n] / total)
            else:
                budget = int(c.device_fraction * sizes[n])
            handle = apply_stream_offload(module, blocks, budget, int(c.prefetch), ctx.device, ctx.host,
                                          pin_memory=bool(c.pin_memory), name=n, clear_cast_cache=_cast_cache_clearer(ctx))
            module._runner_placed = True
            handles[n] = handle
            log.info("stream: %s", handle.plan.describe())
        ctx.state.setdefault(self.key, {})["handles"] = handles
        host = sum(h.host_bytes() for h in handles.values())
        _note_pinned(ctx, host if c.pin_memory else 0)  # pinned on the target GPU (the planner's contract)
        ctx.notes["stream: weight bytes on the host"] = host
        ctx.notes["stream: planned device weight bytes"] = sum(h.plan.device_weight_bytes for h in handles.values())
        ctx.notes["stream: planned window bytes"] = sum(h.plan.window_bytes for h in handles.values())

    def wrap_execution(self, ctx: RunContext) -> None:
        if self.config.activations:
            from runner.plugins.offload_activations import ActivationOffloadConfig, install

            install(ctx, ActivationOffloadConfig(), self.key)

    def wrap_optimizer(self, ctx: RunContext) -> None:
        if self.config.optimizer:
            from runner.plugins.offload_optimizer import OptimizerOffloadConfig, wrap

            wrap(ctx, OptimizerOffloadConfig(step_on_host=bool(self.config.step_on_host)), self.key)

    def on_oom(self, ctx: RunContext, step: int, error: BaseException) -> None:
        state = ctx.state.get(self.key, {})
        for h in state.get("handles", {}).values():
            h.reset()
        if state.get("activations") is not None:
            state["activations"].reset()
        if hasattr(state.get("optimizer"), "discard_gradients"):
            state["optimizer"].discard_gradients()

    def teardown(self, ctx: RunContext) -> None:
        state = ctx.state.pop(self.key, {})
        for undo in reversed(state.get("undo", [])):
            undo()
        if state.get("activations") is not None:
            from runner.plugins.offload_activations import report as report_activations

            report_activations(ctx, state["activations"], True)
        if state.get("optimizer") is not None:
            from runner.plugins.offload_optimizer import report as report_optimizer

            report_optimizer(ctx, state["optimizer"], True)
        handles = state.get("handles", {})
        if handles:
            ctx.notes["stream: peak streamed bytes on the device"] = sum(h.stats.peak_device_bytes for h in handles.values())
            ctx.notes["stream: host-to-device bytes"] = sum(h.stats.h2d_bytes for h in handles.values())
        for h in handles.values():
            h.remove()
        if state.get("park") is not None:
            state["park"].teardown(ctx)


def _note_pinned(ctx: RunContext, nbytes: int) -> None:
    try:
        from runner.plan import note_pinned_bytes
    except ImportError:  # pragma: no cover - the planner is part of the runner
        ctx.state["pinned_host_bytes"] = int(ctx.state.get("pinned_host_bytes", 0) or 0) + int(nbytes)
        return
    note_pinned_bytes(ctx, nbytes)


def _cast_cache_clearer(ctx: RunContext) -> Callable[[], None]:
    """Clears torch's autocast weight-cast cache, and in simulation the planner's own copy of it
    (``DeviceSemantics.cache``: ``meta`` has no torch autocast, so the planner keeps the cache)."""
    def clear() -> None:
        torch.clear_autocast_cache()
        cache = getattr(getattr(ctx.accelerator, "semantics", None), "cache", None)
        if ctx.simulate and isinstance(cache, dict):
            cache.clear()

    return clear
