"""When streamed weights are loaded and released: the forward, saved-tensor and backward hooks.

These methods are one half of :class:`~runner.plugins.stream.handle.StreamHandle`, split off so
each half reads on its own: the handle (handle.py) owns the state, the copies and the lifecycle;
:class:`_StreamHooks` decides, from hooks on the module, its blocks, autograd's saved tensors and
the streamed parameters' gradients, *when* each block is loaded, prefetched and released. It is a
mixin: it uses the handle's attributes and is never instantiated alone.

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
  and blocks in another order than they run: :func:`~runner.plugins.stream.schedule.guess_execution_order`)
  and recorded by it.
* **Gradients of streamed trained parameters** (full fine-tune) are copied device->host on a
  second side stream from a post-accumulate-grad hook, accumulated over micro-batches on the
  host, and exposed as the host parameter's ``.grad`` when backward ends; the optimizer then
  steps those parameters (and keeps their state) on the host, ZeRO-offload style. Clipping
  works on the host gradients like on any other. Frozen weights are never copied back: dropping
  them is a pointer swap to the pinned host copy. In a block that has frozen weights (LoRA), the
  trained adapters stay resident and keep their usual device gradients and optimizer.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch
from torch import nn

from runner.side_streams import is_simulated_cuda, record_stream
from runner.compat import (
    current_graph_task_id,
    outer_saved_tensors_hooks,
    queue_engine_callback,
    tree_flatten,
)
from runner.module_changes import composable, is_composable
from runner.plugins.host_buffers import HostRegion, tensor_bytes
from runner.plugins.stream.state import RELEASED, _Block, _Slot

log = logging.getLogger("runner")


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
    return composable(fn)  # saved-tensor hooks of ours: nest with each other (runner.module_changes)


def _in_backward() -> bool:
    return current_graph_task_id() != -1


def _autocast_on(device: torch.device) -> bool:
    if device.type == "meta" or is_simulated_cuda(device):  # autocast emulated (planner, cuda_sim); cache cleared by the plugin
        return True
    try:
        return torch.is_autocast_enabled(device.type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return False


class _StreamHooks:
    """The hooks half of :class:`~runner.plugins.stream.handle.StreamHandle` (see the module docstring)."""

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
        outer = outer_saved_tensors_hooks()
        hooks = None
        if outer is None or is_composable(outer[0]):
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
        task = current_graph_task_id()
        if task != -1 and task != self._callback_task:
            self._callback_task = task
            queue_engine_callback(self._finish_backward)

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
        self.stats.d2h_bytes += tensor_bytes(g)
        if not self.async_copies:
            return g.detach().to(self.host, copy=True)
        if staging:
            if s.staging_region is None:
                s.staging_region = HostRegion(tensor_bytes(g), self.pin)
                self.regions.append(s.staging_region)
                s.staging = s.staging_region.view(0, s.host)
            buf = s.staging
        else:
            if s.grad_region is None:
                s.grad_region = HostRegion(tensor_bytes(g), self.pin)
                self.regions.append(s.grad_region)
            buf = s.grad_region.view(0, s.host)
        current = self._api.current_stream(self.device)
        with self._api.stream(self._d2h):
            self._d2h.wait_stream(current)  # the gradient was produced on the compute stream
            timing = self._timing is not None
            if timing:
                start = self._d2h.record_event(self._api.Event(enable_timing=True))
            buf.copy_(g, non_blocking=True)
            record_stream(g, self._d2h)  # its memory is not reused before the copy has read it
            end = self._d2h.record_event(self._api.Event(enable_timing=True) if timing else None)
            self._pending.append((end, None))
            if timing:
                self._timing.append(("d2h", start, end, tensor_bytes(g)))
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
