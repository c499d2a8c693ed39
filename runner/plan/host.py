"""What the host does in a GPU step, and what it costs: ops by kind, optimizer updates, copies, syncs.

One host cost per dispatched op cannot price a module's kernel launch, a view, an op the autograd
engine dispatches, a bitsandbytes per-parameter update with its sync, a pinned copy and a sync
alike (issue 41). Per phase of the step the host time is

    kernels x KERNEL_OP_S (a checkpoint's recompute: RECOMPUTE_OP_S) + views x VIEW_OP_S
    + engine kernels x ENGINE_OP_S + copies x COPY_S
    + the optimizer update's host work (by implementation, below) + syncs x SYNC_S

and the phase takes ``max(host, device)`` (the host runs ahead of the card), except that a phase
with a host sync per parameter runs serially, ``host + device``: each sync waits for the kernel
just queued, so the card idles while the host dispatches and the host while the card runs.
The step adds STEP_S of host work outside the phases (the batch, the loop's bookkeeping).

Constants: fitted by ``bench/step_time_fit.py`` to the H200 rows in
bench/results/gpu_truth_2026-11-27_h200 (a least-squares fit of log(measured / predicted) with a
weak pull toward the stated prior of each; docs/benchmarks.md, "Step-time model", has the
full-fit and leave-one-out tables). COPY_S and the torch update's per-kernel cost are priors only
(no row separates them). What each optimizer's update does on the host (:data:`UPDATES`) is
read from the code it runs; the H200 rows ran before the per-parameter syncs were removed and
the fit describes them as they ran (bench/step_time_fit.py, ``AS_RUN``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class HostCosts:
    """Seconds of host time per unit of host work on a GPU machine, and the card's achieved-rate scale."""

    kernel_op_s: float  # an op dispatched from Python that launches a kernel (forward, a parameter's hook)
    recompute_op_s: float  # a kernel of a checkpoint's recompute in backward (Python, under the checkpoint's hooks)
    view_op_s: float  # an op without a kernel (view, detach, allocation), from Python or the engine
    engine_op_s: float  # a kernel the autograd engine dispatches in backward (no Python around it)
    copy_s: float  # a host<->device copy the host issues
    sync_s: float  # a host sync's round trip, on top of the card work it waits for
    update_kernel_s: float  # one kernel of a torch optimizer's per-parameter update (foreach=False)
    bnb_call_s: float  # bitsandbytes' per-parameter update call (its Python and one fused kernel)
    torchao_call_s: float  # torchao's per-parameter 8-bit update call
    step_s: float  # per step, outside the phases: the batch, the loop's bookkeeping
    device_scale: float  # card time ÷ the datasheet roofline's (achieved efficiency below the assumed)
    # one optimizer ``step()`` call narrowed to one parameter, over the update it makes (the fused hook before issue 41
    # ran one per parameter; today's hook calls the one-parameter update directly: the H200 fused row only)
    step_call_s: float = 52e-6

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


# Fitted by bench/step_time_fit.py (its full fit over the committed H200 rows; a test checks these).
H200_FIT = HostCosts(kernel_op_s=45.70e-6, recompute_op_s=59.89e-6, view_op_s=4.843e-6, engine_op_s=8.632e-6,
                     copy_s=10e-6, sync_s=18.30e-6, update_kernel_s=8e-6, bnb_call_s=202.5e-6, torchao_call_s=40e-6,
                     step_s=0.02541, device_scale=1.3009)
# The prior of each constant (the fit's pull, and the value where no row informs it): eager PyTorch's
# overhead per op with Python module calls (~10-30 us), a view's dispatch without allocation or launch,
# the C++ engine's dispatch, cudaMemcpyAsync plus torch's copy_, a cudaStreamSynchronize round trip,
# a plain in-place kernel without autograd, bitsandbytes' and torchao's Python per call, a loop's
# bookkeeping, and the datasheet efficiencies of runner/plan/speed.py as they are. step_call_s: measured, not fitted
# (a narrowed bitsandbytes step() against update_one on this project's 2-core CPU, best of 15; docs/benchmarks.md).
PRIOR = HostCosts(kernel_op_s=20e-6, recompute_op_s=20e-6, view_op_s=4e-6, engine_op_s=8e-6, copy_s=10e-6, sync_s=15e-6,
                  update_kernel_s=8e-6, bnb_call_s=40e-6, torchao_call_s=40e-6, step_s=0.02, device_scale=1.0)
FITTED = ("kernel_op_s", "recompute_op_s", "view_op_s", "engine_op_s", "sync_s", "bnb_call_s", "step_s", "device_scale")


@dataclass(frozen=True)
class Update:
    """What one optimizer's update does on the host, per trained parameter, in this code."""

    impl: str  # "torch" (per-parameter kernels), "bnb" (bitsandbytes' step), "torchao"
    kernels: int  # kernels per parameter (the card's ops)
    syncs: int  # host syncs per parameter


# bitsandbytes 0.50's Optimizer8bit/Optimizer2State.step calls sync_gpu(p) after each parameter.
UPDATES: dict[str, Update] = {
    "adamw": Update("torch", 10, 0), "adamw_schedulefree": Update("torch", 10, 0), "adafactor": Update("torch", 14, 0),
    "prodigy": Update("torch", 14, 2), "came": Update("torch", 20, 0),
    # bitsandbytes' kernels through runner/optim/eight_bit.py: no sync per parameter; paged keeps bitsandbytes' step
    "adamw8bit": Update("bnb", 1, 0), "paged_adamw8bit": Update("bnb", 1, 1), "lion": Update("bnb", 1, 0),
    "lion8bit": Update("bnb", 1, 0),
}
# Fused backward's hook per parameter (runner/optim/fused.py): decides on the card; its flags are read once, at
# the end of backward (the "2 if fused" of StepShape.syncs: the loss read and that one)
FUSED_HOOK_SYNCS = 0


@dataclass
class StepShape:
    """What a step does on the host beyond the simulated ops: its optimizer update and its syncs."""

    optimizer: str
    params: int  # trained parameters whose update runs on the card
    micro_batches: int
    fused: bool
    update_syncs_per_param: int | None = None  # None: the code's (UPDATES); the H200 rows say what they ran
    hook_syncs_per_param: int | None = None  # None: the code's (FUSED_HOOK_SYNCS)
    hook_step_calls_per_param: int = 0  # fused hook's narrowed step() calls (0 in this code; the H200 fused row: 1)
    weight_reads: int = 0  # the weight check's one read after the update (train.max_weight_growth; none in the H200 rows)

    @property
    def update(self) -> Update:
        return UPDATES.get(self.optimizer, UPDATES["adamw"])

    def per_param_syncs(self) -> int:
        upd = self.update.syncs if self.update_syncs_per_param is None else self.update_syncs_per_param
        hook = (FUSED_HOOK_SYNCS if self.hook_syncs_per_param is None else self.hook_syncs_per_param) if self.fused else 0
        return (upd + hook) * self.params

    def syncs(self) -> dict[str, int]:
        """Host syncs per step by phase: the loss read per micro-batch (runner/loop.py; fused backward reads
        it before backward too), the gradient norm read by clipping or the non-finite guard (not under
        fused backward: no gradient is left), the per-parameter ones of the update, and the weight check's read."""
        out = {"backward": self.micro_batches * (2 if self.fused else 1), "optimizer": 0 if self.fused else 1}
        out["backward" if self.fused else "optimizer"] += self.per_param_syncs()
        out["optimizer"] += self.weight_reads
        return out

    def update_host_s(self, costs: HostCosts) -> float:
        u = self.update
        per = {"torch": u.kernels * costs.update_kernel_s, "bnb": costs.bnb_call_s, "torchao": costs.torchao_call_s}
        calls = self.hook_step_calls_per_param * costs.step_call_s if self.fused else 0.0
        return self.params * (per[u.impl] + calls)


def phase_host_s(name: str, c: dict[str, Any], costs: HostCosts) -> float:
    """Host seconds of phase ``name``'s simulated ops (a PhaseCost as a dict: plan.json keeps them)."""
    engine, hook, copies = c.get("engine_kernels", 0), c.get("hook_kernels", 0), c.get("copies", 0)
    python = c["kernels"] - engine - hook  # in backward: a checkpoint's recompute
    views = c["ops"] - copies - c["kernels"]
    per_python = costs.recompute_op_s if name == "backward" else costs.kernel_op_s
    return (python * per_python + hook * costs.kernel_op_s + views * costs.view_op_s + engine * costs.engine_op_s
            + copies * costs.copy_s)
