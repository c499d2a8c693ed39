"""``python -m runner +preset=sdxl_24gb train.steps=200``

One run, top to bottom: compose -> validate (and resolve, once) -> open the run (runner/session.py,
the setup hosted mode shares) -> build trainer -> plan -> models -> apply plugins -> loop -> report.
Each step is a function that tests call on its own; docs/architecture.md maps each one to its file.

Nothing heavy is imported at the top of this module: ``--help``, ``--version``, ``mode=plugins``
and every config error are answered before torch, diffusers or accelerate load (runner/cli/launch.py
:func:`~runner.cli.launch.launch`); :func:`task` imports them once the config is valid.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from runner.cli import launch
from runner.cli.listing import format_plugin_list
from runner.checks import CheckedRun, validate
from runner.hostmem import passive_openmp
from runner.output.once import warn_once
from runner.state.resume import resume_base

log = logging.getLogger("runner")
passive_openmp()  # before torch loads its OpenMP runtime (runner/hostmem.py)


@dataclass
class Job:
    """One job as a mode's task gets it: the validated config, its command line, what the checks built,
    whether this process writes the outputs (rank 0), and the output folder (None for mode=plugins)."""

    cfg: DictConfig
    overrides: list[str]
    checked: CheckedRun | None
    writes: bool
    out: Path | None


def task(cfg: DictConfig) -> float | None:
    """The Hydra task: one job of a run or of a ``-m`` sweep (composed by Hydra), handed to its mode's task."""
    global _QUICK_EXIT
    _QUICK_EXIT = cfg.mode in QUICK_EXIT_MODES                  # nothing but files already written and closed: see main()
    from runner.distributed.launch import join_run
    from runner.hostmem import collector_paused

    with collector_paused():                                    # the libraries load without GC passes (runner/hostmem.py)
        writes = join_run()                                     # several processes: one group, rank 0 writes (runner/distributed/)
        cfg, overrides = resume_base(cfg)                       # resume: on the checkpoint's saved command line
        checked = validate(cfg)                                 # validate: once a job (imports torch to resolve the device)
        run_mode, opens_output = MODE_TASKS[cfg.mode]
        if opens_output:                                        # torch, diffusers, accelerate: only now, once the config is valid
            _load_libraries()
    if not opens_output:
        return run_mode(Job(cfg, overrides, checked, writes, None))
    from runner.output.config import output_dir
    from runner.output.report import write_run_info

    out = output_dir(cfg)
    if writes:
        write_run_info(out, cfg)
    return run_mode(Job(cfg, overrides, checked, writes, out))


def _load_libraries() -> None:
    """Import what the modes' tasks use (torch, diffusers, accelerate and the runner's parts), called
    while the garbage collector is paused; the tasks' own imports then find them loaded."""
    import importlib

    for module in ("accelerate.utils", "runner.parts", "runner.distributed.loading", "runner.export.checkpoint",
                   "runner.fit.command", "runner.loop", "runner.output.report", "runner.plan", "runner.sampling",
                   "runner.session", "runner.val.holdout", "runner.val.scores"):
        importlib.import_module(module)


def _plugins(job: Job) -> None:
    print(format_plugin_list())


def _plan(job: Job) -> None:
    """Only plan: table + plan.json; exit 3 over budget."""
    from runner.plan import plan_command

    plan_command(job.cfg, job.out, job.checked)


def _export(job: Job) -> None:
    """Export a saved checkpoint (train.resume); no training."""
    from runner.export.checkpoint import export_command

    export_command(job.cfg, job.out)


def _fit(job: Job) -> None:
    """The fastest settings that fit: table, fit.yaml (runner/fit/)."""
    from runner.fit.command import command_line, fit_command

    fit_command(job.cfg, command_line(job.overrides), job.out)


def _train(job: Job) -> float | None:
    """Open the run, build, plan, apply the plugins, train, export and report."""
    from accelerate.utils import set_seed

    from runner.parts import build_trainer
    from runner.distributed.loading import build_models_for_rank
    from runner.export.checkpoint import export_after_training
    from runner.fit.command import auto_fit, command_line
    from runner.loop import train
    from runner.output.report import print_summary, write_run_info
    from runner.sampling import build_sampler
    from runner.session import open_run, plan_run, take_models
    from runner.val.holdout import build_validation
    from runner.val.scores import score_run

    cfg, overrides, checked, writes, out = job.cfg, job.overrides, job.checked, job.writes, job.out
    if cfg.train.auto_fit:                                      # train.auto_fit: the fit search, then train with the winner
        cfg, overrides = auto_fit(cfg, command_line(overrides), out)
        checked = None                                          # another config: resolved and built anew
        if writes:
            write_run_info(out, cfg)                            # resolved_config.yaml: the winner's, which trains
    ctx = open_run(cfg, out, overrides, checked)                # resolve, plugins, context, process, accelerator (session.py)
    ctx.trainer = build_trainer(cfg, ctx.run)                   # build trainer
    plan_run(ctx, ctx.trainer)                                  # plan: refuse to start (exit 3) over budget_gb
    set_seed(ctx.run.seed)                                      # random init is reproducible, so resume is exact
    take_models(ctx, build_models_for_rank(ctx))                # dtypes, LoRA; dist=fsdp: trained module on meta
    try:
        ctx.sampler = build_sampler(ctx)                        # sample prompts encoded before park can drop encoders
        ctx.validation = build_validation(ctx)                  # held-out split (data.val_*), before park caches
        ctx.apply_setup_phases()                                # apply plugins
        result = train(ctx)                                     # loop (optimizer, EMA: session.py)
    finally:
        ctx.teardown()                                          # every plugin change undone, even on error
    if writes:
        export_after_training(ctx, result)                      # LoRA / diffusers files beside the final checkpoint
        print_summary(result, out)                              # report: stdout and __main__.log (loss.png: launch.run_job)
        score_run(ctx)                                          # val.scores: CLIP / DINO of the samples, scores.json
    if result.interrupted_by is not None:
        sys.exit(128 + result.interrupted_by)
    if result.stopped_early:                                    # pruned by the sweep: status pruned (runner/cli/launch.py)
        from runner.sweep.config import SweepStop

        raise SweepStop(result.stopped_early)
    return result.losses[-1] if result.losses else None


def _cache(job: Job) -> None:
    """Fill the encoder cache (offload=park) as its own step and exit: no plan, no training. The next
    run with the same settings reads it and plans no pre-pass."""
    from accelerate.utils import set_seed

    from runner.parts import build_trainer
    from runner.distributed.loading import build_models_for_rank
    from runner.session import cache_fillers, fill_caches, open_run, take_models

    ctx = open_run(job.cfg, job.out, job.overrides, job.checked)
    fillers = cache_fillers(ctx)                                # refused before anything is built without one
    ctx.trainer = build_trainer(job.cfg, ctx.run)
    set_seed(ctx.run.seed)                                      # the weights a training run starts from
    take_models(ctx, build_models_for_rank(ctx))
    try:
        filled = fill_caches(ctx, fillers)
    finally:
        ctx.teardown()
    log.info("mode=cache: %s", ", ".join(f"{k}: {n} entries encoded" for k, n in filled.items()) or "nothing to cache")


# mode -> (its task, whether it opens the output folder and loads the training libraries first)
MODE_TASKS: dict[str, tuple[Callable[[Job], float | None], bool]] = {
    "plugins": (_plugins, False),
    "plan": (_plan, True),
    "export": (_export, True),
    "fit": (_fit, True),
    "train": (_train, True),
    "cache": (_cache, True),
}


QUICK_EXIT_MODES = ("plan", "fit", "plugins")
_QUICK_EXIT = False


def main(quick: bool = False) -> None:
    """The program. ``quick``: end planning commands without the interpreter's teardown
    (:func:`quick_exit`); the command line sets it, callers in the same process (tests) do not."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")                # weights are local or built from config
    if not sys.stderr.isatty():  # no \r-redrawn bars in a log file (transformers' save_pretrained has one)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # our own progress: runner/output/progress.py
    # bitsandbytes warns at import that an optional CPU kernel package is missing; it falls back
    # to its own CPU kernels, so the line is noise for every run.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    warn_once()  # a check that runs again (fit's candidates, the preflight) does not repeat its warning
    try:
        launch.launch(task)                                       # compose (friendly errors), run or sweep
    except SystemExit as e:
        if quick and _QUICK_EXIT:
            quick_exit(e.code)
        raise


def command() -> None:
    """``python -m runner`` and the ``runner`` script."""
    main(quick=True)


def quick_exit(code: object) -> None:
    """End a planning command without the interpreter's teardown.

    Tearing down an interpreter that imported torch, diffusers and transformers (finalizers and
    module clean-up of millions of objects) took ~1.5 s of a ~14 s ``mode=plan``. A plan, a fit
    or the plugin list has written and closed every file by now (plan.json, fit.json, the preset,
    job_summary.json, all written atomically), so nothing is lost: the streams and the log
    handlers are flushed and closed, then the process ends with its status
    (tests/runner/cli/test_cli.py checks the outputs and statuses of such exits).
    """
    status = code if isinstance(code, int) else (0 if code is None else 1)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing left to flush
            pass
    logging.shutdown()
    os._exit(status)


if __name__ == "__main__":
    command()
