"""The planner: "will this config fit on my card?", answered by simulating one training step.

``python -m runner +preset=sdxl_24gb mode=plan model.size=full`` (1024 px at full size) prints a
table and writes ``plan.json``; the exit status is 0 when the plan fits ``budget_gb`` and 3 when
it does not. ``mode=train`` plans first (``train.preflight``, on by default) and refuses to start
a run that cannot fit. The twin function is :func:`plan_step`.

The package, by responsibility (each module's docstring has the details):

* ``simulate``: :func:`plan_step`, how one step is simulated (build on meta, the plugins'
  phases with ``ctx.simulate``, one optimizer step under fake tensors, steady state).
* ``fake``: the fake-tensor mode (:class:`SimulationMode`, the fast paths that keep a plan
  quick) and fake modules; ``batch``: the example batches and the encode step's cached parts;
  ``beside``: work done in a forked child on the second core while setup runs (encoder shapes).
* ``process``: what planning does to its own process to stay quick (one intra-op thread, the
  garbage collector kept off the objects that existed before the plan).
* ``semantics``: :class:`DeviceSemantics`, which gives ``meta`` the target's autocast and
  attention kernels, and the simulated accelerator.
* ``target``: the simulated device pair, the target and its precision, and what is not counted
  (:data:`CUDA_WORKSPACE_MARGIN_BYTES`).
* ``result``: :class:`Plan` and its table; ``suggest``: what to change when it does not fit.
* here: the command line (``mode=plan``) and the training preflight.

Contract for plugins (what ``ctx.simulate`` means)
--------------------------------------------------
* Tensors are fake: shapes, dtypes, devices and storages are real, values are not. ``.to()``,
  ``Module.to()``, factories, views and every op with a meta kernel work and cost no memory.
  What does not: reading values (``.item()``, ``.tolist()``, ``print``), kernels without a meta
  implementation (bitsandbytes, custom C++/CUDA ops), reading or writing weight files, and
  ``param.data = t`` between host and device (``cpu`` and ``meta`` tensors are not compatible
  for ``set_data``; assign the parameter with ``Module.to``/``setattr`` instead).
* A plugin whose real path cannot run on fake tensors takes a byte-for-byte simulation path
  when ``ctx.simulate`` is set, in its own file beside the real path: it replaces weights by
  fake tensors with the same byte size and dtype layout as the real ones (nf4: packed uint8 plus
  its absmax values), and its forward computes with fake tensors of the shapes and dtypes the
  real kernel produces (including what the real kernel dequantizes transiently).
* Optimizers: the planner calls :func:`runner.optim.build.build_optimizer` with ``simulate=True``,
  which returns an optimizer that allocates exactly the state the real one keeps after its first
  step (checked against the real optimizers byte for byte in tests/runner/optim/test_optimizers.py), then
  runs ``wrap_optimizer``. A plugin wrapping the optimizer must keep ``step()`` runnable on it.
* Encoding: a plugin that makes the encoders unnecessary during training (every latent and
  embedding cached) sets ``ctx.facts.encode_on_device = False`` by the end of
  ``place_models``; the planner then feeds the trainer's *encoded* ``example_batch`` (as read
  from the cache). When only some encode parts are cached (``offload=park
  offload.park.cache_latents=false``), the planner computes the others with ``encode_part`` and
  takes the cached ones as tensors arriving on the device (shapes from a meta run of the
  encoders before the plugins), then calls ``finish_encode``; which parts are cached is
  ``ctx.facts.cached_parts``. Otherwise the planner calls ``trainer.encode`` on
  ``example_raw_batch``.
* Pinned host memory: a plugin that page-locks host memory (or would, on the target GPU) adds
  the bytes with ``ctx.note_pinned_bytes(n)`` (``ctx.facts.pinned_host_bytes``). The plan
  reports them as pinned and the rest of the host bytes as pageable.
* The planner reads only these typed facts and each plugin's public simulation path; it imports
  nothing else from a plugin, and no plugin imports the planner.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runner.errors import UserError
from runner.guards.oom import is_out_of_memory
from runner.plan.failure import OPT_OUT, planner_failure
from runner.plan.picture import draw_plan
from runner.plan.fake import SimulationMode, fake_module, simulation_mode
from runner.plan.result import PhasePeak, Plan, format_plan, format_size
from runner.memory.semantics import DeviceSemantics, SimulatedAccelerator
from runner.plan.simulate import plan_step, simulate_step
from runner.plan.suggest import suggest
from runner.plan.target import CUDA_WORKSPACE_MARGIN_BYTES, DEVICE, HOST, GiB
from runner.plugin import PluginSchedule
from runner.resolved import ResolvedRun

__all__ = [
    "CUDA_WORKSPACE_MARGIN_BYTES", "DEVICE", "HOST", "PLAN_FILE", "GiB", "DeviceSemantics", "PhasePeak", "Plan",
    "PlanDoesNotFit", "SimulatedAccelerator", "SimulationMode",
    "fake_module", "format_plan", "plan_command", "plan_step", "preflight", "simulate_step",
    "simulation_mode", "suggest",
]

log = logging.getLogger("runner")

PLAN_FILE = "plan.json"


class PlanDoesNotFit(UserError):
    """The plan's peak is above ``budget_gb``: exit status 3, the same as an OOM give-up."""

    exit_code = 3


# ---- entry points for the CLI ------------------------------------------------------------------
def plan_command(cfg: Any, out: Path, checked: Any = None) -> Plan:
    """``mode=plan``: simulate, print the table, write plan.json; PlanDoesNotFit when over budget.
    ``checked``: the job's checked run (runner/checks.py ``CheckedRun``), whose resolved run and plugins
    the plan simulates, so the job resolves once and builds each plugin once; None: resolved here."""
    try:
        plan = (plan_step(cfg) if checked is None
                else plan_step(cfg, schedule=PluginSchedule.build(checked.plugins), run=checked.run))
    except (UserError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - a trainer's step the planner cannot run: one paragraph
        if os.environ.get("RUNNER_DEBUG"):
            raise
        raise planner_failure(e, _trainer_of(cfg), "mode=plan") from None
    print(plan.format_table())
    path = plan.write_json(out / PLAN_FILE)
    log.info("plan written to %s", path)
    picture = draw_plan(plan.to_dict(), out)
    if picture is not None:
        log.info("plan picture (memory over the step, by category; host RAM beside it) written to %s", picture)
    if not plan.fits:
        raise PlanDoesNotFit(_over_budget(plan, path))
    return plan


def _trainer_of(cfg: Any) -> Any:
    """The run's trainer class (not built), for naming its line in a planner failure."""
    from runner.data.video import trainer_class

    return trainer_class(cfg)


class _DropInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


@contextlib.contextmanager
def _said_by_the_run() -> Iterator[None]:
    """The plugins' INFO lines while the preflight applies them to the simulated step ("stream: ...",
    "park: ...", "checkpoint: ..."): the run applies the same plugins right after and says the same
    lines, so a log showed each twice. Warnings still pass (a refusal or a problem the plan found)."""
    quiet = _DropInfo()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def preflight(cfg: Any, run: ResolvedRun, trainer: Any, schedule: Any, out: Path) -> Plan | None:
    """Plan the run about to start (``run``, as resolved, with ``trainer`` and its plugins built for the simulated
    run in ``schedule``: runner/session.py builds them), at its configured size.

    Refuses (PlanDoesNotFit, exit 3) when the plan is over ``budget_gb``; without a budget it
    only logs the predicted peak. ``train.preflight=false`` skips it. A step the planner cannot
    simulate stops the run with the failing call and the trainer's line (runner/plan/failure.py):
    a run that started without its plan would train with no budget check. The one exception is a
    step that runs out of memory in the simulation (a trainer that raises it itself): the loop's
    OOM recovery is what answers that, so the run starts, and says it has no plan.
    """
    if not bool(cfg.train.get("preflight", True)):
        return None
    try:
        with _said_by_the_run():
            plan = simulate_step(cfg, run, trainer, schedule, reads_cache=True)
    except (UserError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - see the docstring
        if is_out_of_memory(e):
            log.warning("preflight: the simulated step ran out of memory (%s: %s); starting without a plan, the "
                        "loop's OOM recovery takes smaller micro-batches (%s)", type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "", OPT_OUT)
            return None
        if os.environ.get("RUNNER_DEBUG"):
            raise
        raise planner_failure(e, trainer, "the preflight") from None
    path = plan.write_json(out / PLAN_FILE) if run.dist.is_main else out / PLAN_FILE  # rank 0 writes it
    imported = plan.notes.get("timings_s", {}).get("model classes import")
    log.info("preflight: predicted peak %s on %s in %s (%.1f s to plan%s)%s; %s", format_size(plan.required_bytes),
             plan.target, plan.peak_phase, plan.seconds,
             "" if imported is None else f", after {imported:.1f} s importing the model classes the run builds",
             "" if plan.budget_bytes is None else f", budget_gb {plan.budget_bytes / GiB:g}", path)
    if not plan.fits:
        print(plan.format_table())
        raise PlanDoesNotFit(_over_budget(plan, path) + " The run was not started (train.preflight=false starts it anyway).")
    return plan


def _over_budget(plan: Plan, path: Path) -> str:
    best = plan.suggestions[0]["override"] if plan.suggestions else None
    return (f"The plan needs {format_size(plan.required_bytes)} of device memory at its peak ({plan.peak_phase}), "
            f"more than budget_gb={plan.budget_bytes / GiB:.4g}. "
            + (f"The largest estimated saving is {best}; " if best else "")
            + f"see the table above and {path}.")
