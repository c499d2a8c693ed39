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

from omegaconf import DictConfig

from runner.cli import launch
from runner.cli.listing import format_plugin_list
from runner.config.checks import validate
from runner.hostmem import passive_openmp
from runner.output.once import warn_once
from runner.state.resume import resume_base

log = logging.getLogger("runner")
passive_openmp()  # before torch loads its OpenMP runtime (runner/hostmem.py)


def task(cfg: DictConfig) -> float | None:
    """The Hydra task: one job of a run or of a ``-m`` sweep (composed by Hydra)."""
    global _QUICK_EXIT
    _QUICK_EXIT = cfg.mode in QUICK_EXIT_MODES                  # nothing but files already written and closed: see main()
    from runner.dist.launch import join_run
    from runner.hostmem import collector_paused

    with collector_paused():                                    # the libraries load without GC passes (runner/hostmem.py)
        writes = join_run()                                     # several processes: one group, rank 0 writes (runner/dist/)
        cfg, overrides = resume_base(cfg)                       # resume: on the checkpoint's saved command line
        checked = validate(cfg)                                 # validate: once a job (imports torch to resolve the device)
        if cfg.mode == "plugins":
            print(format_plugin_list())
            return None
        # The steps below import torch, diffusers and accelerate: only now, once the config is valid.
        from accelerate.utils import set_seed

        from runner.build import build_trainer, output_dir
        from runner.dist.loading import build_models_for_rank
        from runner.export.checkpoint import export_after_training, export_command
        from runner.fit.output import auto_fit, command_line, fit_command
        from runner.loop import train
        from runner.output.report import print_summary, write_run_info
        from runner.plan import plan_command
        from runner.sampling import build_sampler
        from runner.session import open_run, plan_run, take_models
        from runner.val.holdout import build_validation

    out = output_dir(cfg)
    if writes:
        write_run_info(out, cfg)
    if cfg.mode == "plan":                                      # only plan: table + plan.json; exit 3 over budget
        plan_command(cfg, out)
        return None
    if cfg.mode == "export":                                    # export a saved checkpoint (train.resume); no training
        export_command(cfg, out)
        return None
    if cfg.mode == "fit":                                       # the fastest settings that fit: table, fit.yaml (runner/fit/)
        fit_command(cfg, command_line(overrides), out)
        return None
    if cfg.train.auto_fit:                                      # train.auto_fit: the same search, then train with the winner
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
    if result.interrupted_by is not None:
        sys.exit(128 + result.interrupted_by)
    return result.losses[-1] if result.losses else None


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
