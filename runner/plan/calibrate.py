"""This CPU's rates for the step-time model of ``train.device=cpu``: measured once, then cached.

A CPU has no datasheet the model could read, so the planner measures the rates it needs, in
about a second, with the thread count a CPU run trains with:

* matmul FLOP/s (float32, and bfloat16 for ``train.cpu_autocast``), convolution FLOP/s;
* memory bandwidth (an elementwise add over tensors far larger than the caches);
* the host cost of one dispatched op in a training step (a small model's forward and backward:
  Python module calls, the dispatcher, autograd), divided by the ops it dispatches.

Each is the median of several repeats. The result is cached in
``~/.cache/diffusion-memory-runner/cpu_calibration.json`` (``$XDG_CACHE_HOME`` honoured), keyed
by the CPU model, the torch version and the thread count; delete the file to measure again.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runner.compat import TorchDispatchMode
from runner.plan.cost import Roofline
from runner.plan.speed import Target

VERSION = 2
_MEASURED: dict[str, dict[str, Any]] = {}


def cache_file() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "diffusion-memory-runner" / "cpu_calibration.json"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _key(threads: int) -> str:
    return f"v{VERSION}|{_cpu_model()}|torch {torch.__version__}|{threads} threads"


def _median_time(fn: Callable[[], Any], repeats: int, inner: int = 1) -> float:
    fn()  # warm-up (allocations, kernel selection)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def measure(threads: int) -> dict[str, float]:
    """The rates, measured now (about a second)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            n = 384
            a, b = torch.randn(n, n), torch.randn(n, n)
            mm_fp32 = 2 * n**3 / _median_time(lambda: a @ b, 5)
            ab, bb = a.bfloat16(), b.bfloat16()
            mm_bf16 = 2 * n**3 / _median_time(lambda: ab @ bb, 3)
            x, w = torch.randn(2, 32, 32, 32), torch.randn(32, 32, 3, 3)
            conv_flops = 2 * 2 * 32 * 32 * 32 * 32 * 9
            conv = conv_flops / _median_time(lambda: torch.nn.functional.conv2d(x, w, padding=1), 5)
            big = 8 * 2**20  # 32 MiB per tensor: far larger than the caches
            u, v = torch.randn(big), torch.randn(big)
            bandwidth = 3 * 4 * big / _median_time(lambda: u.add_(v), 5)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
        inp = torch.randn(4, 8)

        def step() -> None:
            model(inp).sum().backward()

        with _CountOps() as counted:
            step()
        per_op = _median_time(step, 5, inner=4) / max(counted.n, 1)
        # An optimizer update's ops: plain in-place kernels, no module or autograd around them.
        p, g, m = torch.zeros(64), torch.ones(64), torch.zeros(64)

        def update() -> None:
            with torch.no_grad():
                m.mul_(0.9).add_(g, alpha=0.1)
                p.add_(m, alpha=-1e-3)

        per_update_op = _median_time(update, 5, inner=20) / 3
    finally:
        torch.set_num_threads(before)
    return {"matmul_fp32_flops": mm_fp32, "matmul_bf16_flops": mm_bf16, "conv_fp32_flops": conv,
            "bytes_per_s": bandwidth, "op_s": per_op, "update_op_s": per_update_op}


def calibration(threads: int | None = None) -> dict[str, Any]:
    """The cached rates for this CPU and thread count, measured when missing."""
    threads = threads or torch.get_num_threads()
    path, key = cache_file(), _key(threads)
    if key in _MEASURED:  # once per process, whatever the cache file's fate (tests change XDG_CACHE_HOME)
        return _MEASURED[key]
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached.get(key), dict):
        _MEASURED[key] = {**cached[key], "cached": True}
        return _MEASURED[key]
    rates = measure(threads)
    rates["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    rates["load_average"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cached[key] = rates
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError:  # a read-only home: measure again next time
        pass
    _MEASURED[key] = {**rates, "cached": False}
    return _MEASURED[key]


def cpu_target(threads: int | None = None) -> Target:
    """The step-time target of a ``train.device=cpu`` plan, from this CPU's calibration."""
    c = calibration(threads)
    fp32, bf16, conv = c["matmul_fp32_flops"], c["matmul_bf16_flops"], c["conv_fp32_flops"]
    roofline = Roofline(
        matmul_flops={torch.float32: fp32, torch.bfloat16: bf16, torch.float16: bf16},
        conv_flops={torch.float32: conv, torch.bfloat16: bf16, torch.float16: bf16},
        bytes_per_s=c["bytes_per_s"], kernel_floor_s=0.0, default_flops=fp32)
    return Target(name="cpu", label=f"this CPU ({_cpu_model()}, {threads or torch.get_num_threads()} threads)",
                  device=roofline, host=roofline, h2d_bytes_per_s=c["bytes_per_s"], host_op_s=c["op_s"],
                  update_op_s=c["update_op_s"], serial=True,
                  source=f"measured on this CPU ({cache_file()}{', cached' if c.get('cached') else ''})",
                  peak_flops=fp32)
