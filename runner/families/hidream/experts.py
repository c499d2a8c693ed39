"""HiDream's mixture of experts on the planner's tensors: the same step with a known token split.

diffusers' ``MOEFeedForwardSwiGLU`` in train mode sends each token to its top-2 of 4 experts by boolean
masks (``x[idx == i]``), whose sizes depend on the gate's values: the planner's shape-only tensors cannot
run that. On those tensors alone (:func:`runner.compat.is_fake`, and ``meta``) the experts get the balanced split of
the same ``2 N`` routed tokens (gathered and scattered back as the masks do), so the plan sees the same
operations and total bytes; real tensors run diffusers' own forward unchanged. Trade-off: a step whose
routing is unbalanced holds the same total but differently sized per-expert buffers.
"""
from __future__ import annotations

import types

import torch
from torch import nn

from runner.compat import is_fake


def _planned_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not (self.training and not self._force_inference_output and (is_fake(x) or x.is_meta)):
        return type(self).forward(self, x)
    wtype, identity, shape = x.dtype, x, x.shape
    _, topk_weight, _ = self.gate(x)
    x = x.view(-1, x.shape[-1]).repeat_interleave(self.num_activated_experts, dim=0)
    y = torch.empty_like(x, dtype=wtype)
    n, e = x.shape[0], len(self.experts)
    bounds = [i * n // e for i in range(e + 1)]  # plain ints from the shape, no tensor values
    for i, expert in enumerate(self.experts):
        idx = torch.arange(bounds[i], bounds[i + 1], device=x.device)
        y.index_copy_(0, idx, expert(x.index_select(0, idx)).to(dtype=wtype))
    y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
    return y.view(*shape).to(dtype=wtype) + self.shared_experts(identity)


def plan_experts(transformer: nn.Module) -> int:
    """Give every MoE feed-forward of ``transformer`` the planner-safe forward; the count of them."""
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    moes = [m for m in transformer.modules() if isinstance(m, MOEFeedForwardSwiGLU)]
    for m in moes:
        m.forward = types.MethodType(_planned_forward, m)
    return len(moes)
