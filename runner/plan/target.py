"""What a plan simulates: the device pair, the target device and its precision.

The simulated accelerator is ``meta`` (:data:`DEVICE`) and the simulated host is fake ``cpu``
(:data:`HOST`). The *target* is the real device whose autocast and kernels the simulation
copies (runner/memory/semantics.py): CUDA unless ``train.device=cpu`` (or the preflight of a run
that resolved to the CPU).

What is not counted (so ``budget_gb`` should keep some room): the CUDA context and library
handles outside PyTorch's allocator; kernel workspaces with no Python-visible
tensor, for which :data:`CUDA_WORKSPACE_MARGIN_BYTES` is added to the peak before comparing with
the budget; host memory that is not tensors (Python, libraries, the data loader); the
per-parameter temporaries of an optimizer update (the planner steps the optimizer's
simulation: see the contract for plugins in runner/plan/__init__.py). Host RAM is the peak of
fake host tensors, which includes the whole model at build time (the runner builds on the
host, then places). The caching allocator's rounding and cached blocks are not in the peak
either: a CUDA plan replays the step's allocations through a model of the allocator and reports
its reserved bytes beside the peak (runner/plan/allocator.py), and "fits" needs both.
"""
from __future__ import annotations

import torch

GiB = 2**30
DEVICE = torch.device("meta")  # the simulated accelerator
HOST = torch.device("cpu")  # the simulated host (fake cpu tensors)
# cuBLAS/cuDNN workspaces and allocator rounding have no Python-visible tensor. On an H100 the
# CUDA allocator read ~35 MB above the live-bytes tracker after a forward and ~68 MB after a
# backward (runner/memory/live_bytes.py); 128 MiB covers that with room for a second stream.
CUDA_WORKSPACE_MARGIN_BYTES = 128 * 2**20
