"""Predicted seconds per optimizer step: a roofline over the simulated step's ops, with its copies.

Inputs: the per-phase counts of runner/plan/cost.py (FLOPs, bytes, ops, host<->device copies,
measured on the simulated step, checkpoint recompute included), the copies the plugins recorded
in ``ctx.facts.transfers`` (which of them run on a side stream, and optimizer steps moved to the
host), and the target's rates: a GPU's published peaks (runner/devices.py, conf/devices.yaml)
or, for ``train.device=cpu``, this CPU's measured ones (runner/plan/calibrate.py).

The model, per phase (encode, forward, backward, optimizer; times the micro-batches):

* device work is the sum over ops of ``max(FLOPs / achieved peak, bytes / achieved bandwidth,
  kernel floor)``, with the peak of the op's dtype (bf16/fp16 tensor cores; float32
  convolutions on TF32, float32 matmuls on FP32 cores, PyTorch's defaults);
* on a GPU the host dispatches ops while the GPU runs earlier ones, so compute is the larger of
  the device work and ``ops x host cost per op`` (eager PyTorch: small models are host-bound);
  on a CPU they run one after the other, so it is their sum;
* copies the plugins make on a side stream ahead of use (``offload=stream`` with its prefetch,
  ``offload=activations``) overlap the phase's compute: the phase takes the larger of the two,
  plus one window of blocks that cannot be hidden (the first load before compute starts).
  Copies on the compute stream (park moving a module in, the batch, ``offload=optimizer``'s
  weights after the host step) add their full time;
* the optimizer update is not executed by the planner's optimizer simulation, so its traffic is
  estimated from the kernels the real update runs (bytes per element per optimizer, below), on
  the device, or on the host for parameters whose step runs there (``offload=optimizer``,
  streamed full fine-tune). With fused backward the same update runs inside backward.

What the GPU figures assume: the efficiencies below, scaled by a card-time factor, and the host
costs of runner/plan/host.py (by kind of op, update, copy and sync), all fitted to an H200 machine's
measured steps by bench/step_time_fit.py (docs/benchmarks.md, "Step-time model", has the rows, the
full fit and the leave-one-out ratios). A phase with a host sync per parameter runs serially. The
CPU figures are measured on the machine that plans.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from runner.plan.comm import CommTime, phase_with_comm
from runner.plan.cost import CostCounter, PhaseCost, Roofline
from runner.plan.host import H200_FIT, HostCosts, StepShape, phase_host_s

# Achieved fractions of a GPU's published peaks (assumptions; see the module docstring).
MATMUL_EFFICIENCY = 0.60  # bf16 GEMMs of a diffusion model's shapes in cuBLAS: ~50-75 % of the dense tensor peak
CONV_EFFICIENCY = 0.45  # cuDNN convolutions of a U-Net's shapes (NCHW, with norms between): less
MEMORY_EFFICIENCY = 0.80  # elementwise and normalisation kernels reach ~80 % of DRAM bandwidth
PCIE_EFFICIENCY = 0.80  # pinned copies reach ~80 % of the link (25 of 31.5 GB/s on PCIe Gen4 x16)
KERNEL_FLOOR_S = 3e-6  # launch and ramp of the smallest kernel
# A GPU target's host time per dispatched op where one figure is asked for (the CPU model's shape; the GPU
# model prices ops by kind: runner/plan/host.py).
HOST_OP_S = H200_FIT.kernel_op_s
HOST_GBPS = 20.0  # host memory bandwidth for host-side work on a GPU machine (optimizer steps on the CPU)
HOST_GFLOPS = 200.0

# Bytes the optimizer update reads and writes per trained element, by optimizer, as multiples of
# (parameter bytes, constant): torch AdamW with foreach=False runs ~10 elementwise kernels over
# the parameter, its gradient and two moments in the parameter's dtype (~24 parameter-sized
# passes); bitsandbytes' 8-bit AdamW one fused kernel (parameter and gradient in and out, two
# uint8 moments); Adafactor ~12 float32 passes (it upcasts, squares, factors and rescales). Counted
# the same way from each library's step: Prodigy ~14 kernels over the parameter, its gradient, two
# moments, s and p0 (~30 passes; plus two host syncs per parameter for its sums); schedule-free
# AdamW (foreach=False) ~10 over the parameter, gradient, z and the second moment (as AdamW);
# bitsandbytes' Lion one fused kernel with one float32 (lion) or uint8 (lion8bit) moment; CAME
# Adafactor's passes and as many again for its instability term (~18 float32 passes, 20 kernels).
UPDATE_TRAFFIC = {"adamw": (24.0, 0.0), "adamw8bit": (3.0, 4.0), "paged_adamw8bit": (3.0, 4.0),
                  "adafactor": (0.0, 48.0), "prodigy": (30.0, 0.0), "adamw_schedulefree": (24.0, 0.0),
                  "lion": (3.0, 8.0), "lion8bit": (3.0, 2.0), "came": (0.0, 72.0)}
UPDATE_KERNELS = {"adamw": 10, "adamw8bit": 1, "paged_adamw8bit": 1, "adafactor": 14, "prodigy": 14,
                  "adamw_schedulefree": 10, "lion": 1, "lion8bit": 1, "came": 20}
STEP_PHASES = ("encode", "forward", "backward", "optimizer")


def gpu_roofline(spec: Any) -> Roofline:
    """The achieved rates of a GPU (a :class:`runner.devices.DeviceSpec`)."""
    bf16, tf32, fp32 = spec.bf16_tflops * 1e12, spec.tf32_tflops * 1e12, spec.fp32_tflops * 1e12
    return Roofline(
        matmul_flops={torch.bfloat16: bf16 * MATMUL_EFFICIENCY, torch.float16: bf16 * MATMUL_EFFICIENCY,
                      torch.float32: fp32 * MATMUL_EFFICIENCY},
        conv_flops={torch.bfloat16: bf16 * CONV_EFFICIENCY, torch.float16: bf16 * CONV_EFFICIENCY,
                    torch.float32: tf32 * CONV_EFFICIENCY},
        bytes_per_s=spec.hbm_gbps * 1e9 * MEMORY_EFFICIENCY,
        kernel_floor_s=KERNEL_FLOOR_S,
        default_flops=fp32 * MATMUL_EFFICIENCY,
    )


def gpu_host_roofline() -> Roofline:
    rate = HOST_GFLOPS * 1e9
    return Roofline({torch.float32: rate}, {torch.float32: rate}, HOST_GBPS * 1e9, 1e-6, rate)


@dataclass
class Target:
    """What one plan's time is predicted for: rooflines of its device and host, and host costs."""

    name: str  # device key, or "cpu"
    label: str
    device: Roofline
    host: Roofline
    h2d_bytes_per_s: float
    host_op_s: float  # host time per dispatched op
    serial: bool  # CPU: dispatch and compute add up; GPU: they overlap
    source: str  # "datasheet (conf/devices.yaml)" | "measured on this CPU ..."
    peak_flops: float  # the headline peak (bf16 on a GPU, fp32 on a CPU), for the utilisation shown
    update_op_s: float = HOST_OP_S  # host time per op of the optimizer update (plain kernels: no module, no autograd)
    host_costs: HostCosts | None = None  # a GPU's host model by kind of work (runner/plan/host.py); None on a CPU

    def counter(self) -> CostCounter:
        return CostCounter(self.device, self.host)


def gpu_target(spec: Any, reference: bool = False) -> Target:
    return Target(name=spec.name, label=spec.label + (" (reference card: device.name unset)" if reference else ""),
                  device=gpu_roofline(spec), host=gpu_host_roofline(), h2d_bytes_per_s=spec.h2d_gbps * 1e9 * PCIE_EFFICIENCY,
                  host_op_s=HOST_OP_S, serial=False, host_costs=H200_FIT,
                  source="datasheet peaks (conf/devices.yaml) x efficiencies and host costs fitted on an H200 "
                         "(bench/step_time_fit.py)", peak_flops=spec.bf16_tflops * 1e12)


@dataclass
class StepTime:
    """The predicted seconds of one optimizer step, per phase, with what bounds it."""

    seconds: float
    phases: dict[str, float]
    device: str
    source: str
    bound: str  # what the largest phase spends its time on
    flops: float  # per optimizer step, recompute included
    bytes: float
    h2d_bytes: int
    d2h_bytes: int
    ops: int
    utilisation: float  # FLOPs / (seconds x peak)
    mfu: float = 0.0  # model FLOPs (a checkpoint's recompute excluded) / (seconds x peak)
    host_syncs_per_step: int | None = None  # a GPU target's host reads of card values per step (None on a CPU)
    card_ops_per_step: int | None = None  # the card's kernels and copies per step (None on a CPU)
    detail: dict[str, Any] = field(default_factory=dict)
    # dist=ddp|fsdp: one rank's collectives (runner/plan/comm.py: seconds by phase, exposed, links) and the
    # step's seconds without them ("compute_seconds"); None for one process
    comm: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        per = ", ".join(f"{k} {v:.3g}" for k, v in self.phases.items() if v)
        host = ("" if self.host_syncs_per_step is None else
                f"; {self.card_ops_per_step:,} card ops, {self.host_syncs_per_step:,} host syncs per step")
        return (f"predicted step time: {self.seconds:.3g} s/step on {self.device} ({per}; {self.bound}; "
                f"{self.flops / 1e12:.3g} TFLOP, {self.utilisation:.0%} of peak, MFU {self.mfu:.1%}{host})"
                f"{comm_text(self.comm)}")


def comm_text(comm: dict[str, Any] | None) -> str:
    """``; communication 0.41 s over nvlink4, 0.02 s of it not hidden by compute (compute alone 1.9 s)``
    (empty for one process)."""
    if not comm:
        return ""
    return (f"; communication {comm['seconds']:.3g} s over {comm['links']}, {comm['added_seconds']:.3g} s of it not "
            f"hidden by compute (compute alone {comm['compute_seconds']:.3g} s)")


@dataclass
class Trained:
    """The trained parameters, by where their optimizer step runs (the update's traffic depends on it)."""

    device_elements: int = 0
    device_bytes: int = 0  # parameter bytes
    device_params: int = 0
    host_elements: int = 0
    host_bytes: int = 0
    host_params: int = 0

    def move_to_host(self, elements: int) -> None:
        """``elements`` of the device's parameters step on the host (``offload=optimizer``)."""
        elements = min(elements, self.device_elements)
        if not elements:
            return
        share = elements / self.device_elements
        moved_bytes, moved_params = int(self.device_bytes * share), int(round(self.device_params * share))
        self.device_elements -= elements
        self.device_bytes -= moved_bytes
        self.device_params -= moved_params
        self.host_elements += elements
        self.host_bytes += moved_bytes
        self.host_params += moved_params


def _optimizer_work(optimizer: str, trained: Trained) -> tuple[float, float, int, int]:
    """(device bytes, host bytes, device kernels, host kernels) of one optimizer update."""
    per_byte, const = UPDATE_TRAFFIC.get(optimizer, UPDATE_TRAFFIC["adamw"])
    kernels = UPDATE_KERNELS.get(optimizer, 10)
    dev = per_byte * trained.device_bytes + const * trained.device_elements
    host = per_byte * trained.host_bytes + const * trained.host_elements
    return dev, host, kernels * trained.device_params, kernels * trained.host_params


def predict(counter: CostCounter, target: Target, *, micro_batches: int, simulated_micro: int,
            transfers: dict[str, Any], optimizer: str, trained: Trained, fused: bool,
            comm: CommTime | None = None, shape: StepShape | None = None, weight_reads: int = 0) -> StepTime:
    """The step time of the simulated step whose ops ``counter`` counted (see the module docstring);
    ``comm``: a rank's collectives under dist=ddp|fsdp, added per phase as runner/plan/comm.py says;
    ``shape``: what the step does on the host beyond its ops (default: this code's, for ``micro_batches``, with
    ``weight_reads`` reads of the weight check after the update)."""
    phases = _scaled_phases(counter, micro_batches / max(simulated_micro, 1))
    overlapped = {"h2d": 0, "d2h": 0}
    for t in transfers.values():
        if getattr(t, "overlapped", False):
            overlapped["h2d"] += int(t.h2d_bytes)
            overlapped["d2h"] += int(t.d2h_bytes)
    measured = {"h2d": sum(c.h2d_bytes for c in phases.values()), "d2h": sum(c.d2h_bytes for c in phases.values())}
    share = {d: (min(overlapped[d] / measured[d], 1.0) if measured[d] else 0.0) for d in measured}
    window = max((int(getattr(t, "window_bytes", 0)) for t in transfers.values()), default=0)
    for t in transfers.values():
        trained.move_to_host(int(getattr(t, "host_step_elements", 0)))
    dev_b, host_b, dev_k, host_k = _optimizer_work(optimizer, trained)
    upd_phase = "backward" if fused else "optimizer"
    upd_device_s = dev_b / target.device.bytes_per_s + dev_k * target.device.kernel_floor_s
    upd_host_s = host_b / target.host.bytes_per_s + host_k * target.update_op_s
    costs = target.host_costs
    if shape is None:
        shape = StepShape(optimizer, trained.device_params, max(int(micro_batches), 1), fused, weight_reads=weight_reads)
    host = _GpuHost(costs, shape, upd_phase) if costs is not None else None
    seconds: dict[str, float] = {}
    compute_only: dict[str, float] = {}
    bound: dict[str, str] = {}
    for name, c in phases.items():
        device_s = c.device_s + (upd_device_s if name == upd_phase else 0.0)
        if host is not None:
            compute, why = host.phase(name, c, device_s)
        else:
            compute, why = _phase_compute(target, c, device_s, dev_k if name == upd_phase else 0)
        ovl = (share["h2d"] * c.h2d_bytes + share["d2h"] * c.d2h_bytes) / target.h2d_bytes_per_s
        blocking = ((1 - share["h2d"]) * c.h2d_bytes + (1 - share["d2h"]) * c.d2h_bytes) / target.h2d_bytes_per_s
        t = max(compute, ovl) + blocking + c.host_s
        if ovl > compute:
            why = "PCIe copies (not hidden by compute)"
        if name == "forward" and ovl and window:
            t += window / target.h2d_bytes_per_s  # the first window is loaded before compute starts
        if name == "optimizer":
            t += upd_host_s
            if upd_host_s > compute:
                why = "the optimizer step on the host CPU"
        compute_only[name] = t
        if comm is not None and comm.phases.get(name):
            hidden = comm.phases[name] - comm.exposed.get(name, 0.0)
            if hidden > t or comm.exposed.get(name, 0.0) > t:
                why = f"communication over {comm.links}"
            t = phase_with_comm(t, comm.phases[name], comm.exposed.get(name, 0.0))
        seconds[name] = t
        bound[name] = why
    if host is not None:
        seconds["loop"] = compute_only["loop"] = host.costs.step_s
        bound["loop"] = "the loop's host work outside the phases"
    total = sum(seconds.values())
    flops = sum(c.flops for c in phases.values())
    model_flops = flops - sum(c.recompute_flops for c in phases.values())
    worst = max(seconds, key=lambda k: seconds[k]) if total else "forward"
    return StepTime(
        seconds=total,
        phases={k: round(v, 6) for k, v in seconds.items()},
        device=target.label,
        source=target.source,
        bound=f"{worst} bound by {bound[worst]}",
        flops=flops,
        bytes=sum(c.bytes for c in phases.values()) + dev_b,
        h2d_bytes=int(measured["h2d"]),
        d2h_bytes=int(measured["d2h"]),
        ops=int(sum(c.ops for c in phases.values())),
        utilisation=flops / (total * target.peak_flops) if total else 0.0,
        mfu=model_flops / (total * target.peak_flops) if total else 0.0,
        host_syncs_per_step=None if host is None else sum(shape.syncs().values()),
        card_ops_per_step=None if host is None else int(sum(c.kernels + c.copies for c in phases.values()) + dev_k),
        detail=_detail(phases, target, trained, transfers, share, window, host,
                       {"device_bytes": dev_b, "host_bytes": host_b, "in": upd_phase, "device_kernels": dev_k,
                        "host_kernels": host_k, "device_s": upd_device_s,
                        "host_s": upd_host_s - host_k * target.update_op_s}),
        comm=None if comm is None else {**comm.to_dict(), "compute_seconds": sum(compute_only.values()),
                                        "compute_phases": dict(compute_only),
                                        "added_seconds": total - sum(compute_only.values())},
    )


def _detail(phases: dict[str, PhaseCost], target: Target, trained: Trained, transfers: dict[str, Any],
            share: dict[str, float], window: int, host: _GpuHost | None, update: dict[str, Any]) -> dict[str, Any]:
    """Everything the prediction used (plan.json's ``step_time.detail``): bench/step_time_fit.py and
    bench/gpu_calibrate.py recompute the prediction from it alone."""
    return {"phases": {k: c.to_dict() for k, c in phases.items()},
            "optimizer_update": {**update, "host_elements": trained.host_elements,
                                 "device_elements": trained.device_elements, "device_params": trained.device_params,
                                 "host_params": trained.host_params},
            "rates": {"h2d_bytes_per_s": target.h2d_bytes_per_s, "host_op_s": target.host_op_s,
                      "update_op_s": target.update_op_s, "serial": target.serial},
            "host": None if host is None else host.detail(),
            "copies_overlapped_share": share, "first_window_bytes": window,
            "transfers": {k: asdict(t) if dataclasses.is_dataclass(t) else dict(t) for k, t in transfers.items()}}


def _scaled_phases(counter: CostCounter, scale: float) -> dict[str, PhaseCost]:
    """The step's phases with the simulated micro-batches' counts scaled to the run's (not the optimizer's)."""
    phases: dict[str, PhaseCost] = {}
    for name in STEP_PHASES:
        c = counter.phases.get(name, PhaseCost())
        if name != "optimizer" and scale != 1:
            c = PhaseCost(**{k: v * scale for k, v in asdict(c).items()})
        phases[name] = c
    return phases


def _phase_compute(target: Target, c: PhaseCost, device_s: float, update_kernels: int) -> tuple[float, str]:
    """A CPU target's compute of one phase: dispatch and compute add up (one host cost per op)."""
    dispatch = c.ops * target.host_op_s + update_kernels * target.update_op_s
    if target.serial:
        return device_s + dispatch, ("compute" if device_s >= dispatch else "per-op overhead")
    return max(device_s, dispatch), ("GPU work" if device_s >= dispatch else "host dispatch (small kernels)")


@dataclass
class _GpuHost:
    """A GPU target's host time per phase (runner/plan/host.py): ops by kind, the update, syncs."""

    costs: HostCosts
    shape: StepShape
    upd_phase: str

    def phase(self, name: str, c: PhaseCost, device_s: float) -> tuple[float, str]:
        syncs = self.shape.syncs().get(name, 0)
        host = phase_host_s(name, c.to_dict(), self.costs) + syncs * self.costs.sync_s
        serial = False
        if name == self.upd_phase:
            host += self.shape.update_host_s(self.costs)
            serial = self.shape.per_param_syncs() > 0
        device_s *= self.costs.device_scale
        if serial:  # a sync per parameter: the card waits for the host and the host for the card
            return host + device_s, "host syncs per parameter (no CPU/GPU overlap)"
        return max(host, device_s), ("GPU work" if device_s >= host else "host dispatch (small kernels)")

    def detail(self) -> dict[str, Any]:
        return {"costs": self.costs.to_dict(), "syncs": self.shape.syncs(), "per_param_syncs": self.shape.per_param_syncs(),
                "update_host_s": self.shape.update_host_s(self.costs), "update_impl": self.shape.update.impl,
                "shape": asdict(self.shape)}
