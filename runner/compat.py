"""PyTorch's private internals, imported in one place.

The planner simulates a step with fake tensors, the live-bytes tracker is a dispatch mode, and
the offload plugins hook the autograd engine: all of that needs parts of PyTorch that are not
public API and may change in any release. Every such import in runner/ and plugins/ comes from
here, so a new PyTorch breaks in one file, with an error that says what is missing, instead of
deep inside a simulated step. The range the runner is tested with is :data:`TESTED_TORCH` (also
declared in pyproject.toml): CI and the CPU setup use torch 2.13.0 (Makefile), the GPU machine
2.11.

Each internal, what it is used for, and what happens where it is missing (``FALLBACKS`` lists
the fallbacks in use in this process; empty on the torch CI uses):

Fake tensors (no fallback: importing this module fails with :class:`MissingTorchInternal`)
    ``torch._subclasses.fake_tensor``: ``FakeTensor``, ``FakeTensorMode``,
    ``FakeTensorConverter``, ``unset_fake_temporarily``: the planner's simulated tensors
    (runner/plan), the tracker's device queries, and the ``ctx.simulate`` checks of the plugins
    (:func:`is_fake`).
    ``torch.utils._python_dispatch.TorchDispatchMode``: the base class of the live-bytes tracker;
    ``_disable_current_modes`` (as ``without_dispatch_modes``): work inside a plan that must run
    as if outside it (runner/plan/simulate.py).
    ``torch.utils._pytree``: ``tree_flatten`` and ``tree_map`` (the planner's known values, runner/plan/known_values.py; offload=stream finds a block's output tensors,
    including diffusers' output classes, which register themselves as pytree nodes) and
    ``tree_iter`` (the tracker's per-op walk; fallback: iterate ``tree_flatten``'s leaves).

The planner's fast path through the fake-tensor cache (fallback: the stock ``FakeTensorMode``,
slower, same figures; tests/runner/plan/test_planner.py checks the two agree)
    ``torch._subclasses.fake_tensor``: ``_DISPATCH_HANDLE_DIRECTLY``,
    ``_DISPATCH_META_HANDLERS``, ``_DispatchCacheKey`` and ``FakeTensorMode``'s
    ``_cached_dispatch_impl`` and ``_cache_key``, which runner/plan/fake.py's ``SimulationMode``
    overrides; ``torch.fx.experimental.proxy_tensor.get_proxy_mode`` (part of the stock cache
    key). All present: :data:`FAKE_CACHE_FAST_PATHS`. Also ``_get_output_tensor_from_cache_entry``
    (overridden to build outputs without ``FakeTensor.__new__``), ``torch._C._DisableTorchDispatch``,
    ``Tensor._make_subclass(..., dispatch_device=, device_for_backend_keys=)`` and
    ``torch._C._set_{throw_on,warn_deprecated_on}_mutable_data_ptr``: :data:`FAKE_OUTPUT_FAST_PATH`.
    ``torch._C._get_default_device``: part of the cache key (fallback: the public
    ``torch.get_default_device``, as a string).

Fake parameters without dispatched ops (fallback: ``torch.empty_strided`` under the fake mode,
then ``nn.Parameter``: two dispatched ops per tensor, same tensors)
    ``FakeTensor(..., requires_grad=, _is_param=)`` (recent PyTorch, 2.13; 2.11 takes the
    fallback) and ``torch._C._DisableTorchDispatch``: :data:`FAKE_TENSOR_PARAM_KWARGS`.
    ``torch._C._get_dispatch_mode`` with ``_TorchDispatchModeKey.FAKE``: the active fake mode
    (:func:`active_fake_mode`; no fallback: an error when called).

The target device's semantics in the planner (runner/memory/semantics.py)
    ``torch._C._get_sdp_priority_order``: the order PyTorch tries attention kernels in
    (fallback: PyTorch's documented default, flash, efficient, math, cuDNN).
    ``torch.autograd.graph._engine_run_backward``: backward without the torch-function mode
    being switched off (fallback: ``Variable._execution_engine.run_backward``, the engine call
    it wraps).
    ``torch._foreach_norm``, ``torch._foreach_mul_``: gradient clipping with the foreach kernels
    a GPU run uses (fallback: one op per gradient, same values and bytes, slower).
    ``torch._foreach_lerp_``: the EMA update of runner/ema/average.py, one kernel per chunk (fallback:
    ``Tensor.lerp_`` per tensor, same values, slower).

Autograd hooks of the offload plugins (no fallback: an error when called)
    ``torch._C._current_graph_task_id``: whether backward is running, and which one.
    ``torch.autograd.Variable._execution_engine.queue_callback``: run code when backward ends.
    ``torch._C._autograd._top_saved_tensors_default_hooks``: the saved-tensor hooks already
    active, so offload=stream composes with activation offload.
    ``torch._C.DisableTorchFunction``: the tracker keeps torch-function modes out of its own
    bookkeeping.
    ``torch._has_compatible_shallow_copy_type``: whether ``param.data = t`` works between two
    devices (offload=park, offload=stream; ``meta`` and ``cpu`` are not compatible).

Sharded tensors in the live-bytes tracker (fallback: none needed where DTensor is missing)
    ``DTensor._local_tensor``: the shard a rank holds, read inside the tracker's dispatch mode,
    where ``DTensor.to_local()`` (an autograd function) must not run: :func:`dtensor_local`.

One parameter's AdamW update (runner/optim/fused.py; no fallback: an error when called)
    ``torch.optim.Adam._init_group``: the optimizer's own lazy state set-up, so fused backward calls
    the public functional ``torch.optim.adamw.adamw`` for one parameter with the state ``step`` would make;
    ``torch.optim.optimizer._global_optimizer_post_hooks`` and ``Optimizer._optimizer_step_post_hooks``: the
    post-step hooks, run once after such updates (:func:`run_step_post_hooks`).

FSDP2's collectives (runner/distributed/agree.py; fallback: none needed, ranks then agree on an
out-of-memory retry only at the end of each attempt, see there)
    ``torch.distributed.fsdp._fully_shard._fsdp_collectives``: ``DefaultAllGather`` and
    ``DefaultReduceScatter``, the communication objects FSDP2 uses unless
    ``FSDPModule.set_custom_all_gather``/``set_custom_reduce_scatter`` (public) replace them; the
    runner's replacements call them after an agreement between ranks: :data:`FSDP_COMMS`.

Also relied on in place, not wrapped (attributes and operators, on hot paths or part of a
class that overrides them): ``Tensor._base``, ``Tensor._is_view()``, ``UntypedStorage._cdata``
(storage identity), ``FakeTensor.fake_device/fake_mode/constant``,
``FakeTensorMode.in_kernel_invocation``, the ``_should_skip_dynamo`` hook of dispatch modes,
``FakeTensorConverter.from_meta_and_device``, and the aten operators ``_unsafe_view`` and
``_scaled_dot_product_{flash,efficient,cudnn}_attention`` (+ ``_flash_attention_for_cpu``).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

__all__ = [
    "DISPATCH_HANDLE_DIRECTLY", "DISPATCH_META_HANDLERS", "FAKE_CACHE_FAST_PATHS", "FAKE_OUTPUT_FAST_PATH",
    "FAKE_TENSOR_PARAM_KWARGS", "set_throw_on_mutable_data_ptr",
    "set_warn_deprecated_on_mutable_data_ptr",
    "FALLBACKS", "TESTED_TORCH", "DisableTorchDispatch", "DisableTorchFunction", "DispatchCacheKey", "FakeTensor",
    "FakeTensorConverter", "FakeTensorMode", "MissingTorchInternal", "TorchDispatchMode", "active_fake_mode",
    "current_graph_task_id", "engine_run_backward", "foreach_lerp_", "foreach_mul_", "foreach_norm",
    "get_default_device", "get_proxy_mode", "has_compatible_shallow_copy_type", "is_fake", "outer_saved_tensors_hooks",
    "queue_engine_callback", "sdp_priority_order", "tree_flatten", "tree_iter", "tree_map", "unset_fake_temporarily",
    "without_dispatch_modes", "TorchFunctionMode", "parse_to", "FAKE_VALUE_ERRORS",
    "FSDP_COMMS", "autograd_node_name", "FSDPDefaultAllGather", "FSDPDefaultReduceScatter", "DTensor", "dtensor_local",
    "adam_init_group", "run_step_post_hooks",
]

TESTED_TORCH = ">=2.11,<2.14"
"""The torch versions the runner is tested with; keep equal to pyproject.toml's requirement."""

FALLBACKS: dict[str, str] = {}
"""Internal missing in this PyTorch -> what is used instead."""


class MissingTorchInternal(ImportError):
    """A PyTorch internal the runner needs is missing from the installed torch."""

    def __init__(self, name: str, use: str, error: BaseException | None = None) -> None:
        why = f" ({type(error).__name__}: {error})" if error is not None else ""
        super().__init__(
            f"this PyTorch ({torch.__version__}) lacks {name}{why}, which the runner uses for {use}. "
            f"The runner is tested with torch{TESTED_TORCH} (runner/compat.py lists the internals it needs); "
            "install a torch in that range."
        )
        self.internal = name


def _missing(name: str, use: str, error: BaseException) -> Callable[..., Any]:
    """A stand-in for an internal without a fallback: raises :class:`MissingTorchInternal` when used."""

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise MissingTorchInternal(name, use, error)

    missing.__name__ = name.rsplit(".", 1)[-1]
    return missing


# ---- fake tensors, dispatch modes, pytrees (required) ----------------------------------------------
try:
    from torch._subclasses.fake_tensor import (
        FakeTensor,
        FakeTensorConverter,
        FakeTensorMode,
        unset_fake_temporarily,
    )
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._python_dispatch import (
        _disable_current_modes as without_dispatch_modes,
    )
    from torch.utils._pytree import tree_flatten, tree_map
except ImportError as e:  # pragma: no cover - outside the tested range
    raise MissingTorchInternal("torch._subclasses.fake_tensor / torch.utils._python_dispatch / torch.utils._pytree",
                               "the planner's fake tensors and the live-bytes tracker", e) from e

from torch.overrides import TorchFunctionMode  # noqa: E402  (public)

try:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    FAKE_VALUE_ERRORS: tuple[type[BaseException], ...] = (
        DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)
    """What a fake tensor raises when code reads a value it does not have (.item(), nonzero)."""
except ImportError:  # pragma: no cover - outside the tested range
    FAKE_VALUE_ERRORS = ()
    FALLBACKS["fake tensor value errors"] = "none caught: such a failure fails the plan"

parse_to: Callable[..., Any] = torch._C._nn._parse_to
"""``Tensor.to``'s argument parser: (device, dtype, non_blocking, memory_format); the simulated
card (runner/memory/cuda_sim.py) reads where a ``.to()`` call moves a tensor."""

try:
    from torch.utils._pytree import tree_iter
except ImportError:  # pragma: no cover - older torch

    def tree_iter(tree: Any, is_leaf: Any = None) -> Any:
        return iter(tree_flatten(tree, is_leaf=is_leaf)[0])

    FALLBACKS["torch.utils._pytree.tree_iter"] = "tree_flatten's leaves"


def is_fake(t: Any) -> bool:
    """True for a fake tensor (the planner's simulated tensors)."""
    return isinstance(t, FakeTensor)


def _accepts_backend_keys() -> bool:
    """Whether ``Tensor._make_subclass`` takes FakeTensor's ``dispatch_device``/``device_for_backend_keys``."""
    try:
        torch.Tensor._make_subclass(torch.Tensor, torch.empty(0, device="meta"), False, dispatch_device=True,
                                    device_for_backend_keys=torch.device("cpu"))
    except TypeError:
        return False
    return True


# ---- the planner's fast path through the fake-tensor cache (fallback: stock FakeTensorMode) --------
DISPATCH_HANDLE_DIRECTLY: Any = frozenset()
DISPATCH_META_HANDLERS: Any = frozenset()
DispatchCacheKey: Any = None
try:
    from torch._subclasses.fake_tensor import (
        _DISPATCH_HANDLE_DIRECTLY as DISPATCH_HANDLE_DIRECTLY,
    )
    from torch._subclasses.fake_tensor import (
        _DISPATCH_META_HANDLERS as DISPATCH_META_HANDLERS,
    )
    from torch._subclasses.fake_tensor import _DispatchCacheKey as DispatchCacheKey
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    FAKE_CACHE_FAST_PATHS = all(hasattr(FakeTensorMode, m) for m in ("_cached_dispatch_impl", "_cache_key"))
except ImportError as e:  # pragma: no cover - another PyTorch: the stock mode (slower, same figures)
    get_proxy_mode = _missing("torch.fx.experimental.proxy_tensor.get_proxy_mode", "the planner's cache key", e)
    FAKE_CACHE_FAST_PATHS = False
if not FAKE_CACHE_FAST_PATHS:  # pragma: no cover
    FALLBACKS["FakeTensorMode cache internals"] = "the stock FakeTensorMode (slower plans, same figures)"

# Cache hits' outputs built without FakeTensor.__new__ (runner/plan/fake.py: SimulationMode._wrap;
# fallback: the stock construction, same tensors, slower).
try:
    from torch._subclasses.fake_tensor import FakeTensorConfig

    # FakeTensorConfig.debug (TORCH_FAKE_TENSOR_DEBUG) makes __new__ record a traceback per tensor:
    # the stock constructor then, so debugging sees what it expects.
    FAKE_OUTPUT_FAST_PATH = FAKE_CACHE_FAST_PATHS and not FakeTensorConfig.debug and all((
        hasattr(FakeTensorMode, "_get_output_tensor_from_cache_entry"),
        _accepts_backend_keys(),
        hasattr(torch._C, "_set_throw_on_mutable_data_ptr"),
        hasattr(torch._C, "_set_warn_deprecated_on_mutable_data_ptr"),
        hasattr(torch._C, "_DisableTorchDispatch"),
    ))
except ImportError:  # pragma: no cover
    FAKE_OUTPUT_FAST_PATH = False
# What FakeTensor.__new__ calls on each tensor it makes (data_ptr() raises, or warns when the mode
# allows unsafe access); None where FAKE_OUTPUT_FAST_PATH is False.
set_throw_on_mutable_data_ptr: Any = getattr(torch._C, "_set_throw_on_mutable_data_ptr", None)
set_warn_deprecated_on_mutable_data_ptr: Any = getattr(torch._C, "_set_warn_deprecated_on_mutable_data_ptr", None)
if not FAKE_OUTPUT_FAST_PATH:  # pragma: no cover
    FALLBACKS["FakeTensor outputs without __new__"] = "FakeTensor.__new__ (slower plans, same figures)"

try:
    get_default_device: Callable[[], Any] = torch._C._get_default_device
except AttributeError:  # pragma: no cover

    def get_default_device() -> Any:
        return str(torch.get_default_device())

    FALLBACKS["torch._C._get_default_device"] = "str(torch.get_default_device())"


# ---- fake parameters without dispatched ops ---------------------------------------------------------
DisableTorchDispatch: Any = getattr(torch._C, "_DisableTorchDispatch", None)
FAKE_TENSOR_PARAM_KWARGS = DisableTorchDispatch is not None and (
    {"requires_grad", "_is_param"} <= set(inspect.signature(FakeTensor.__new__).parameters))
if not FAKE_TENSOR_PARAM_KWARGS:
    FALLBACKS["FakeTensor(requires_grad=, _is_param=)"] = "empty_strided under the fake mode, then nn.Parameter"

try:
    _get_dispatch_mode = torch._C._get_dispatch_mode
    _FAKE_MODE_KEY = torch._C._TorchDispatchModeKey.FAKE

    def active_fake_mode() -> FakeTensorMode | None:
        """The fake-tensor mode on the dispatch mode stack, or None."""
        return _get_dispatch_mode(_FAKE_MODE_KEY)
except AttributeError as e:  # pragma: no cover
    active_fake_mode = _missing("torch._C._get_dispatch_mode", "finding the planner's fake mode", e)


# ---- the target device's semantics in the planner -------------------------------------------------
def sdp_priority_order() -> list[int]:
    """PyTorch's SDPA backend order (flash, efficient, math, cudnn by default)."""
    try:
        return list(torch._C._get_sdp_priority_order())
    except (AttributeError, RuntimeError):  # older torch: the documented default order
        return [1, 2, 0, 3]


def autograd_node_name() -> str | None:
    """The autograd node whose backward runs now (``None`` outside the engine): the planner tells the
    engine's own ops from those of Python hooks (AccumulateGrad's post-accumulate-grad hooks)."""
    getter = getattr(torch._C, "_current_autograd_node", None)
    node = getter() if getter is not None else None
    return None if node is None else type(node).__name__


try:
    from torch.autograd.graph import _engine_run_backward as engine_run_backward
except ImportError:  # pragma: no cover
    try:
        engine_run_backward = torch.autograd.Variable._execution_engine.run_backward
        FALLBACKS["torch.autograd.graph._engine_run_backward"] = "Variable._execution_engine.run_backward"
    except AttributeError as e:
        engine_run_backward = _missing("torch.autograd.graph._engine_run_backward", "the planner's backward", e)

if hasattr(torch, "_foreach_norm") and hasattr(torch, "_foreach_mul_"):
    foreach_norm: Callable[..., Any] = torch._foreach_norm
    foreach_mul_: Callable[..., Any] = torch._foreach_mul_
else:  # pragma: no cover

    def foreach_norm(tensors: list[torch.Tensor], ord: float = 2.0, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]

    def foreach_mul_(tensors: list[torch.Tensor], scalar: Any) -> None:
        for t in tensors:
            t.mul_(scalar)

    FALLBACKS["torch._foreach_norm / torch._foreach_mul_"] = "one op per tensor"

if hasattr(torch, "_foreach_lerp_"):
    foreach_lerp_: Callable[..., Any] = torch._foreach_lerp_
else:  # pragma: no cover

    def foreach_lerp_(tensors: list[torch.Tensor], ends: list[torch.Tensor], weight: float) -> None:
        for t, e in zip(tensors, ends):
            t.lerp_(e, weight)

    FALLBACKS["torch._foreach_lerp_"] = "Tensor.lerp_ per tensor"


# ---- autograd hooks of the offload plugins -----------------------------------------------------------
try:
    current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
except AttributeError as e:  # pragma: no cover
    current_graph_task_id = _missing("torch._C._current_graph_task_id", "telling forward from backward", e)

if hasattr(getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback"):

    def queue_engine_callback(callback: Callable[[], None]) -> None:
        """Run ``callback`` when the backward pass now running ends."""
        torch.autograd.Variable._execution_engine.queue_callback(callback)
else:  # pragma: no cover
    queue_engine_callback = _missing("torch.autograd.Variable._execution_engine.queue_callback",
                                     "running code at the end of backward", AttributeError("queue_callback"))

try:
    _top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks

    def outer_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
        """The (pack, unpack) saved-tensor hooks active now, or None."""
        return _top_saved_tensors_hooks(False)
except AttributeError as e:  # pragma: no cover
    outer_saved_tensors_hooks = _missing("torch._C._autograd._top_saved_tensors_default_hooks",
                                         "composing saved-tensor hooks", e)

try:
    DisableTorchFunction: Any = torch._C.DisableTorchFunction
except AttributeError as e:  # pragma: no cover
    DisableTorchFunction = _missing("torch._C.DisableTorchFunction", "the tracker's bookkeeping", e)

try:
    has_compatible_shallow_copy_type: Callable[[torch.Tensor, torch.Tensor], bool] = (
        torch._has_compatible_shallow_copy_type)
except AttributeError as e:  # pragma: no cover
    has_compatible_shallow_copy_type = _missing("torch._has_compatible_shallow_copy_type",
                                                "moving parameters between devices in place", e)

try:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather as FSDPDefaultAllGather,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultReduceScatter as FSDPDefaultReduceScatter,
    )

    FSDP_COMMS = hasattr(torch.distributed.fsdp.FSDPModule, "set_custom_all_gather")
except (ImportError, AttributeError):  # pragma: no cover
    FSDPDefaultAllGather = FSDPDefaultReduceScatter = None  # type: ignore[assignment,misc]
    FSDP_COMMS = False
if not FSDP_COMMS:  # pragma: no cover
    FALLBACKS["FSDP2 custom collectives"] = "out-of-memory agreement at the end of each attempt only"

# ---- one parameter's AdamW update (fused backward: runner/optim/fused.py) -------------------------------
if callable(getattr(torch.optim.Adam, "_init_group", None)):

    def adam_init_group(optimizer: torch.optim.Optimizer, group: dict[str, Any], *lists: list) -> bool:
        """torch Adam/AdamW's lazy state set-up for ``group``'s parameters that have a gradient, filling
        ``lists`` (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps) as its ``step`` does;
        whether any parameter is complex."""
        return bool(optimizer._init_group(group, *lists))
else:  # pragma: no cover
    adam_init_group = _missing("torch.optim.Adam._init_group", "fused backward's one-parameter AdamW update",
                               AttributeError("_init_group"))



def run_step_post_hooks(optimizer: torch.optim.Optimizer) -> None:
    """The hooks ``optimizer.register_step_post_hook`` registered (and the global ones), as after its ``step()``:
    fused backward updates each parameter without calling ``step()``."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    hooks = [*_global_optimizer_post_hooks.values(), *getattr(optimizer, "_optimizer_step_post_hooks", {}).values()]
    for hook in hooks:
        hook(optimizer, (), {})


try:
    from torch.distributed.tensor import DTensor

    def dtensor_local(t: Any) -> torch.Tensor:
        """The local shard of a DTensor, without dispatching an op (see the module docstring)."""
        return t._local_tensor
except ImportError:  # pragma: no cover - torch built without distributed
    class DTensor:  # type: ignore[no-redef]
        """Stand-in: no tensor is an instance."""

    def dtensor_local(t: Any) -> torch.Tensor:
        return t
