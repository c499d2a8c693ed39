"""peft's LoKr/LoHa layers in the simulated step: their module-dropout draw has no value there.

peft's LyCORIS layers (``model.train=lokr|loha``) decide in every training forward whether the
adapter runs with ``torch.rand(1) > module_dropout``; on fake tensors that comparison has no value,
so the simulation would stop. The runner never sets ``module_dropout`` (0: the draw keeps the
adapter, but for a draw of exactly 0), and with it 0 the eval branch runs the same ops without the
draw (``rank_dropout`` is 0 too). So for the simulated step those layers' ``training`` flag is off;
the only difference from a real step is the draw's 4-byte host tensor, which the plan leaves out.
A layer with a non-zero dropout (a user's own peft config) is left as it is, and fails loudly.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn


def _lycoris_layers(models: Any) -> list[nn.Module]:
    try:
        from peft.tuners.lycoris_utils import LycorisLayer
    except ImportError:  # peft without LyCORIS tuners: no such layer can exist
        return []
    return [m for _, module in models.items() for m in module.modules()
            if isinstance(m, LycorisLayer) and m.training and not any(getattr(m, "module_dropout", {}).values())]


@contextmanager
def lycoris_draws_skipped(models: Any) -> Iterator[None]:
    """The module docstring's switch, undone in a ``finally``."""
    layers = _lycoris_layers(models) if models is not None else []
    for m in layers:
        m.training = False
    try:
        yield
    finally:
        for m in layers:
            m.training = True
