"""Device alignment of a parked module's calls, as accelerate's ``AlignDevicesHook`` does.

Between calls a parked module's weights are on the host, so code that asks the module where it is
(``next(module.parameters()).device``, diffusers' ``_get_qwen3_prompt_embeds``) sends its inputs to
the host. Park therefore moves every tensor input of an outermost call (args and kwargs, nested in
lists, tuples and dicts) to the execution device, and puts the outputs back on the device of the
call's first tensor input when that was not the execution device (accelerate's ``io_same_device``):
a caller that believed the module was on the host gets host tensors back, one that sent device
tensors gets device tensors, as it would without park. ``module.device`` (and ``_execution_device``,
where the module's class has either as a property) reports the execution device for the whole run:
:func:`report_device` gives the module a subclass that says so, as the weights do during a call.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

DEVICE_PROPERTIES = ("device", "_execution_device")
_SUBCLASSES: dict[tuple[type, str], type] = {}  # (class, device) -> its subclass reporting that device


def first_device(obj: Any) -> torch.device | None:
    """The device of the first tensor in ``obj`` (depth first), None when it holds none."""
    if isinstance(obj, torch.Tensor):
        return obj.device
    items = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else ()
    for item in items:
        device = first_device(item)
        if device is not None:
            return device
    return None


def send_to(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it on ``device``; containers are rebuilt, never changed in place."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, Mapping):
        moved = {k: send_to(v, device) for k, v in obj.items()}
        try:
            return type(obj)(**moved) if hasattr(obj, "to_tuple") else type(obj)(moved)  # ModelOutput, BaseOutput
        except TypeError:
            return moved
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(send_to(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(send_to(v, device) for v in obj)
    return obj


def outputs_for(caller: torch.device | None, execution: torch.device, outputs: Any) -> Any:
    """The call's outputs where the caller expects them: on ``caller``'s device when it sent its
    inputs elsewhere than ``execution`` (never off the planner's ``meta``: nothing to copy)."""
    if caller is None or caller == execution or "meta" in (caller.type, execution.type):
        return outputs
    return send_to(outputs, caller)


def report_device(module: nn.Module, device: torch.device) -> type | None:
    """Make ``module.device`` (and ``_execution_device``) read ``device``, if its class defines them
    as properties (transformers' and diffusers' models do): its class becomes a subclass of the same
    name that overrides them. Returns the class to restore, None when nothing was changed."""
    cls = type(module)
    names = [n for n in DEVICE_PROPERTIES if isinstance(getattr(cls, n, None), property)]
    if not names:
        return None
    key = (cls, str(device))
    if key not in _SUBCLASSES:
        fixed = {n: property(lambda self, d=device: d, doc=f"The parked module's execution device ({device}).")
                 for n in names}
        _SUBCLASSES[key] = type(cls.__name__, (cls,), {**fixed, "__module__": cls.__module__,
                                                        "__qualname__": cls.__qualname__, "_parked_base": cls})
    module.__class__ = _SUBCLASSES[key]
    return cls
