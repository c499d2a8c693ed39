"""Hosted mode: keep your own training loop; the runner brings everything else.

A plain PyTorch loop, and the same loop hosted (the README shows the diff)::

    @hosted                                              # Hydra overrides and -m sweeps from argv
    def main(run):
        unet, opt, loader = run.prepare(make_unet(), None, loader,
                                        loss_fn=my_loss, example_batch=next(iter(loader)))
        for batch in loader:
            with run.step():                             # plugins' step contexts + autocast
                loss = my_loss(unet, batch)
                run.backward(loss)
            opt.step(); opt.zero_grad()
            run.log(loss)                                # metrics.jsonl, memory columns, profile

What ``prepare`` gives the loop, exactly as managed mode does (the shared code is named):

* the resolved run (runner/resolved.py): device, precision, dtypes, budget;
* ``model.dtype``/``model.train_dtype`` and ``model.train=lora`` on the modules
  (runner/parts.py);
* a preflight plan (runner/plan/) from the prepared modules and one example batch, when
  ``loss_fn`` and ``example_batch`` are given: over ``budget_gb`` the run stops there;
* every configured plugin, through the same phases and the same RunContext;
* the configured optimizer (``optimizer=...``) when the loop passes none, or the loop's own
  factory; an optimizer instance together with an explicitly configured ``optimizer=`` is an
  error, because one of them would be silently ignored;
* the output directory, metrics.jsonl, ``profile.enabled`` and the final summary
  (:meth:`HostedRun.finish`, called by :func:`hosted`);
* ``ema.enabled``: the average of the trained weights (runner/ema/average.py), updated by :meth:`HostedRun.log`
  after each step whose loss is finite, used with ``with run.ema.applied(): ...`` and written to
  ``ema.safetensors`` in the output directory by :meth:`HostedRun.finish`.
"""
from __future__ import annotations

import copy
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch import nn

from runner.output.config import output_dir
from runner.cli import launch
from runner.cli.compose import compose_config
from runner.config import load_all
from runner.checks import validate
from runner.context import RunContext
from runner.errors import UserError
from runner.loop import TrainResult
from runner.memory.cuda_sim import HostCounts
from runner.memory.profile import build_profiler
from runner.memory.stats import MemoryMonitor
from runner.optim.fused import fusion_of
from runner.output.report import MetricsWriter, print_summary, write_run_info
from runner.session import attach_ema, attach_optimizer, open_run, plan_run, take_models
from runner.trainer import ModelSet

log = logging.getLogger("runner")


class HostedLoop:
    """The protocol view of a hosted loop, for the planner: its modules cloned on ``meta``, its
    example batch, its loss. Nothing is copied but shapes."""

    def __init__(self, models: ModelSet, loss_fn: Callable[..., torch.Tensor], example: Any, single: bool):
        self.models, self.loss_fn, self.single = models, loss_fn, single
        # A DataLoader over a TensorDataset yields tuples (or lists): the planner's batch is a dict,
        # so the positions become keys here and the loss gets the loop's own structure back.
        self.sequence: type | None = type(example) if isinstance(example, (tuple, list)) else None
        if self.sequence is not None:
            example = {f"_{i}": v for i, v in enumerate(example)}
        elif not isinstance(example, Mapping):
            raise UserError(
                f"prepare(example_batch=...) got a {type(example).__name__}; give one batch as the loop's data loader "
                "yields it: a dict of tensors, or a tuple or list of tensors (a TensorDataset's batches).")
        self.example: dict[str, Any] = dict(example)

    def build_models(self, device: Any = "meta") -> ModelSet:
        clones = {}
        for name, module in self.models.items():
            memo: dict[int, Any] = {}
            for t in [*module.parameters(), *module.buffers()]:
                empty = torch.empty_like(t, device="meta")
                memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
            clones[name] = copy.deepcopy(module, memo)
        return ModelSet(clones, set(self.models.trained), dtypes_applied=True)

    def dataset(self) -> list[Any]:
        return []

    def example_batch(self, batch_size: int, device: Any = "meta") -> dict[str, Any]:
        out = {k: torch.empty_like(v, device=device) if isinstance(v, torch.Tensor) else v for k, v in self.example.items()}
        n = next((len(v) for v in self.example.values() if isinstance(v, torch.Tensor) and v.dim()), 1)
        out.setdefault("sample_seed", torch.arange(n, dtype=torch.int64))
        return out

    def loss(self, models: ModelSet, batch: dict[str, Any]) -> torch.Tensor:
        batch = {k: v for k, v in batch.items() if k in self.example}  # without the planner's sample_seed
        given: Any = batch
        if self.sequence is not None:
            items = [batch[f"_{i}"] for i in range(len(self.example))]
            given = self.sequence(*items) if hasattr(self.sequence, "_fields") else self.sequence(items)
        return self.loss_fn(models["model"] if self.single else models.modules, given)


class DeviceLoader:
    """The loop's data loader, with every batch's tensors moved to the run's device (as
    accelerate's prepared loader does): a CPU run and a GPU run need the same loop."""

    def __init__(self, loader: Any, device: torch.device, steps_left: Callable[[], int | None] = lambda: None) -> None:
        self.loader, self.device, self.steps_left = loader, device, steps_left

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            left = self.steps_left()
            if left is not None and left <= 0:  # train.steps given: the loop ends there, as the runner's does
                return
            yield _to_device(batch, self.device)

    def __len__(self) -> int:
        left = self.steps_left()
        return len(self.loader) if left is None else min(len(self.loader), max(0, left))


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    return x


class HostedRun:
    """One hosted run: the resolved run, its plugins and its outputs around a loop that stays yours."""

    def __init__(self, cfg: DictConfig, output_dir: Path | None = None, overrides: Sequence[str] = ()) -> None:
        checked = validate(cfg)  # once a job: @hosted's command line checked it already (runner/checks.py)
        self.cfg = cfg
        self.overrides = list(overrides)
        self.run = checked.run
        if self.run.dist.active:  # the loop is the user's: its batches, its backward; nothing to shard them with
            raise UserError(
                f"dist={self.run.dist.name} with {self.run.dist.world_size} processes is for the runner's own loop "
                "(python -m runner). A hosted loop runs one process; distribute it with accelerate in the loop itself.")
        self._steps = _typed_steps(cfg, self.overrides)
        self.output_dir = Path(output_dir) if output_dir else _default_output_dir(cfg)
        write_run_info(self.output_dir, cfg)
        # resolve, plugins, context, configure_process, accelerator: the same setup as managed mode
        self.ctx: RunContext = open_run(cfg, self.output_dir, None, checked, hosted=True)
        self.result = TrainResult(steps_done=0)
        self._metrics = MetricsWriter(self.output_dir / "metrics.jsonl")
        self._memory = MemoryMonitor(self.run.device, self.run.budget_gb, self.ctx.card)
        self._counts = HostCounts(self.ctx.card)  # train.device=cuda_sim: the step's host syncs and card ops
        self._profiler = build_profiler(cfg, self.ctx)
        self._t0 = time.perf_counter()
        self._times: list[float] = []
        self._finished = False

    # the services a loop uses
    @property
    def accelerator(self) -> Any:
        return self.ctx.accelerator

    @property
    def device(self) -> torch.device:
        return self.run.device

    @property
    def ema(self) -> Any:
        """The EMA of the trained weights (``ema.enabled``; a no-op object otherwise), after :meth:`prepare`."""
        return self.ctx.ema

    def prepare(self, models: dict[str, nn.Module] | nn.Module, optimizer: Any = None, dataloader: Any = None, *,
                trained: set[str] | None = None, loss_fn: Callable[..., torch.Tensor] | None = None,
                example_batch: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
        """Apply the run to the loop's ``models`` (one module or a dict), ``optimizer`` (None: the
        configured one; a factory ``lambda params: ...``; or an instance) and ``dataloader``
        (returned wrapped so that batches arrive on the run's device). ``loss_fn(models, batch)`` with ``example_batch`` enables the
        preflight plan. Returns ``(models, optimizer, dataloader)`` in the form given."""
        single = isinstance(models, nn.Module)
        named = {"model": models} if single else dict(models)
        if trained is None:
            trained = {n for n, m in named.items() if any(p.requires_grad for p in m.parameters())}
        ctx = self.ctx
        take_models(ctx, ModelSet(named, set(trained)))  # dtypes, LoRA: as managed mode (runner/session.py)
        if loss_fn is not None and example_batch is not None:
            plan_run(ctx, HostedLoop(ctx.models, loss_fn, example_batch, single))
        elif self.cfg.train.preflight:
            log.info("hosted: no preflight plan (pass loss_fn= and example_batch= to prepare() for one)")
        ctx.apply_setup_phases()
        refused = (f"optimizer={self.cfg.optimizer.name} is configured, but the loop passed its own "
                   f"{type(optimizer).__name__} to prepare(); one of them would be ignored. Pass None to use "
                   "the configured optimizer, or drop optimizer= from the overrides (and the preset)."
                   ) if _optimizer_configured(self.cfg, self.overrides) else None
        attach_optimizer(ctx, optimizer, own_optimizer_refused=refused)
        attach_ema(ctx)  # ema.enabled: averaged by log() after each step
        out_models = ctx.models["model"] if single else ctx.models.modules
        loader = DeviceLoader(dataloader, self.run.device, self._steps_left) if dataloader is not None else None
        return out_models, ctx.optimizer, loader

    def _steps_left(self) -> int | None:
        """``train.steps`` typed for this run, less the steps logged: the prepared loader stops there.
        None when not typed (the loop runs as many steps as its loader yields)."""
        if self._steps is None:
            return None
        return self._steps - self.result.steps_done

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one forward and backward: the plugins' step contexts and the run's autocast."""
        step = self.result.steps_done + 1
        if not self._times and not self.result.losses:
            self._t0 = time.perf_counter()
        self._profiler.begin_step(step)
        self._counts.begin()
        self.ctx.run_phase("on_step_start", step - 1)
        with ExitStack() as stack:
            stack.enter_context(self.ctx.step_context())
            stack.enter_context(self.accelerator.autocast())
            yield

    def step_context(self) -> ExitStack:
        """The plugins' step contexts alone (for loops that handle autocast themselves)."""
        return self.ctx.step_context()

    def backward(self, loss: torch.Tensor) -> None:
        if fusion_of(self.ctx.optimizer).admits(loss):  # fused backward: a non-finite loss must not reach the weights
            self.accelerator.backward(loss)

    def log(self, loss: torch.Tensor | float, **extra: Any) -> dict[str, Any]:
        """After the optimizer step: one metrics.jsonl row (loss, s/step, memory columns)."""
        self.result.steps_done += 1
        step = self.result.steps_done
        self.ctx.run_phase("on_step_end", step)
        now = time.perf_counter()
        dt, self._t0 = now - self._t0, now
        self._profiler.end_step()
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self.ctx.ema.update(step, applied=math.isfinite(value))  # a non-finite step is not averaged in
        row = {"step": step, "loss": value, "s_per_step": dt, **self._counts.end(), **self._memory.sample(step), **extra}
        self._metrics.write(row)
        self.result.losses.append(value)
        self._times.append(dt)
        return row

    def finish(self) -> str:
        """Teardown (every plugin change undone) and the summary; idempotent."""
        if self._finished:
            return ""
        self._finished = True
        try:
            if self.ctx.ema.enabled and self.result.steps_done:
                self.ctx.ema.write_checkpoint(self.output_dir)  # ema.safetensors: the average, by parameter name
            self.ctx.teardown()
        finally:
            self._metrics.close()
            self._profiler.close()
        tail = self._times[1:] or self._times
        self.result.seconds_per_step = sum(tail) / len(tail) if tail else float("nan")
        self.result.notes = dict(self.ctx.notes)
        text = print_summary(self.result, self.output_dir)  # stdout and the job's log file
        from runner.output.plots import LOSS_PNG, safely, write_loss_plot

        safely(LOSS_PNG, lambda: write_loss_plot(self.output_dir, self.cfg))
        return text


LOOP_BATCH_KEYS = ("train.batch_size", "train.grad_accum")


def _typed_steps(cfg: DictConfig, overrides: Sequence[str]) -> int | None:
    """``train.steps`` when the command line (or the session's overrides) sets it, else None; a
    typed batch size is refused: a hosted loop's batches are its loader's, and the setting would be
    accepted and then do nothing."""
    typed = {str(o).lstrip("+~").split("=", 1)[0] for o in overrides}
    batch = [k for k in LOOP_BATCH_KEYS if k in typed]
    if batch:
        raise UserError(
            f"{', '.join(batch)} set for a hosted loop: its batches are the ones its data loader yields, so the "
            "setting would do nothing. Set the batch size in the loop's DataLoader; train.batch_size and "
            "train.grad_accum are for the runner's own loop (python -m runner).")
    return int(cfg.train.steps) if "train.steps" in typed else None


def _optimizer_configured(cfg: DictConfig, overrides: Sequence[str]) -> bool:
    """Whether ``optimizer`` was chosen explicitly: on the command line, or by a preset (which
    then picks another than the default adamw)."""
    return str(cfg.optimizer.get("name", "adamw")) != "adamw" or any(
        str(o).lstrip("+~").startswith("optimizer") for o in overrides)


def _default_output_dir(cfg: DictConfig) -> Path:
    try:
        return output_dir(cfg)
    except UserError:
        return Path("outputs") / "hosted" / time.strftime("%Y-%m-%d/%H-%M-%S")


def session(overrides: Sequence[str] = (), output_dir: str | Path | None = None) -> HostedRun:
    """A hosted run from command-line style overrides (``["+preset=sdxl_24gb", "train.device=cpu"]``)."""
    load_all()
    cfg = compose_config(overrides)
    return HostedRun(cfg, Path(output_dir) if output_dir else None, overrides)


def hosted(fn: Callable[[HostedRun], Any]) -> Callable[[], Any]:
    """Decorator: ``fn(run)`` becomes a script that takes Hydra overrides and ``-m`` sweeps like
    ``python -m runner`` (same config tree, same friendly errors, a sweep summary at the end).

    ``main()`` returns what ``fn`` returned (a ``-m`` sweep: the list of every job's, in order); a
    job that failed exits with its status, as the command line does."""
    returned: list[Any] = []

    def task(cfg: DictConfig) -> Any:
        run = HostedRun(cfg, overrides=list(HydraConfig.get().overrides.task))
        try:
            value = fn(run)
        finally:
            run.finish()
        returned.append(value)
        return value if value is not None else (run.result.losses[-1] if run.result.losses else None)

    @functools.wraps(fn)
    def main() -> Any:
        returned.clear()
        try:
            launch.launch(task)
        except SystemExit as e:
            if e.code not in (0, None):
                raise
        return returned[0] if len(returned) == 1 else list(returned)

    return main
