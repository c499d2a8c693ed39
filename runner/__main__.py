"""``python -m runner +preset=sdxl_24gb train.steps=200``

One run, top to bottom: compose -> validate -> resolve -> build trainer -> plan -> apply plugins
-> loop -> report. Each step is a function in runner/ that tests call on its own;
docs/architecture.md maps each one to its file.
"""
from __future__ import annotations

import logging
import os
import sys

from accelerate.utils import set_seed
from omegaconf import DictConfig

from runner import registry, sweep
from runner.dist.launch import join_run
from runner.export.checkpoint import export_after_training, export_command
from runner.hostmem import keep_freed_host_memory
from runner.loop import make_accelerator, train
from runner.plan import plan_command, preflight
from runner.report import summary, write_run_info
from runner.resolved import resolve
from runner.resume import resume_base
from runner.run import build_plugins, build_trainer, make_context, output_dir
from runner.sampling import build_sampler
from runner.tracking import accelerator_kwargs
from runner.trainer_setup import prepare_models
from runner.validate import validate

log = logging.getLogger("runner")


def run(cfg: DictConfig) -> float | None:
    """The Hydra task: one job of a run or of a ``-m`` sweep (composed by Hydra)."""
    writes = join_run()                                         # several processes: one group, rank 0 writes (runner/dist/)
    cfg, overrides = resume_base(cfg)                           # resume: on the checkpoint's saved command line
    validate(cfg)                                               # validate
    if cfg.mode == "plugins":
        print(registry.format_plugin_list())
        return None
    out = output_dir(cfg)
    if writes:
        write_run_info(out, cfg)
    if cfg.mode == "plan":                                      # only plan: table + plan.json; exit 3 over budget
        plan_command(cfg, out)
        return None
    if cfg.mode == "export":                                    # export a saved checkpoint (train.resume); no training
        export_command(cfg, out)
        return None
    run = resolve(cfg)                                          # resolve: device, precision, dtypes, budget, once
    log.info("%s", run.describe())
    keep_freed_host_memory(run)                                 # CPU runs: no page-fault churn between steps
    schedule = build_plugins(cfg, run)
    log.info("plugin order:\n%s", schedule.describe())
    ctx = make_context(cfg, run, schedule, out, overrides)
    ctx.run_phase("configure_process")                          # before anything touches CUDA
    ctx.trainer = build_trainer(cfg, run)                       # build trainer
    preflight(cfg, run, ctx.trainer, out)                       # plan: refuse to start (exit 3) over budget_gb
    set_seed(run.seed)                                          # random init is reproducible, so resume is exact
    ctx.models = prepare_models(ctx.trainer.build_models("cpu"), cfg.model, run)  # dtypes, LoRA
    ctx.accelerator = make_accelerator(run, **accelerator_kwargs(cfg.log, out))  # log.tracker: runner/tracking.py
    try:
        ctx.sampler = build_sampler(ctx)                        # sample prompts encoded before park can drop encoders
        ctx.apply_setup_phases()                                # apply plugins
        result = train(ctx)                                     # loop
    finally:
        ctx.teardown()                                          # every plugin change undone, even on error
    if writes:
        export_after_training(ctx, result)                      # LoRA / diffusers files beside the final checkpoint
        print(summary(result, out))                             # report
    if result.interrupted_by is not None:
        sys.exit(128 + result.interrupted_by)
    return result.losses[-1] if result.losses else None


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")                # weights are local or built from config
    # bitsandbytes warns at import that an optional CPU kernel package is missing; it falls back
    # to its own CPU kernels, so the line is noise for every run.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    sweep.launch(run)                                           # compose (friendly errors), run or sweep


if __name__ == "__main__":
    main()
