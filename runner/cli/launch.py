"""The runner's Hydra application: one run or a ``-m`` sweep, and how each job ends.

``python -m runner`` and hosted scripts (runner.hosted.hosted) both start in :func:`launch`: a
friendly pre-check of the overrides (runner/cli/compose.py), then ``hydra.main`` runs every job
through :func:`run_job`.

Why jobs return a status instead of raising: Hydra's basic launcher runs the jobs of a sweep in
one process. ``sys.exit`` in a job (how a single run reports a user error) would end the whole
sweep at the first bad job, and any other exception is re-raised by the sweeper after the
batch, which skips ``on_multirun_end`` and so the summary. So in a sweep :func:`run_job` records
the failure (runner/output/jobs.py), frees what the job held and returns; the sweep goes on, and
the process exits with status 1 at the end if any job did not end ``ok`` (the table says which).
A single run still exits with the error's own status (2 for bad input, 3 for out of memory at
micro-batch 1) and keeps the traceback of a bug.
"""
from __future__ import annotations

import gc
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner.cli.compose import hydra_args, precheck
from runner.cli.listing import format_plugin_list
from runner.config import load_all
from runner.checks import check_run, typed_overrides
from runner.distributed.launch import agree_on_start
from runner.errors import Interrupted, UserError, storage_error
from runner.files import conf_dir
from runner.output.jobs import (
    JOB_SUMMARY,
    SWEEP_CSV,
    collect,
    format_table,
    plot_job,
    write_csv,
    write_job_summary,
)
from runner.sweep.config import OK_STATUSES, SweepStop, trial_outcome

log = logging.getLogger("runner")

_last_sweep: list[dict[str, Any]] | None = None


# ---- one job -----------------------------------------------------------------------------------
def _hydra_job() -> tuple[bool, int | None, list[str]]:
    """(in a -m sweep, job number, the job's overrides) from Hydra's state; defaults outside Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return False, None, []
    from omegaconf import OmegaConf

    hc = HydraConfig.get()
    num = OmegaConf.select(hc, "job.num", default=None, throw_on_missing=False)
    return hc.mode == RunMode.MULTIRUN, num, list(hc.overrides.task)


def run_job(task: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
    """Run ``task(cfg)`` (one job), write its job_summary.json, and decide what an error does.

    Single run: a UserError, an OSError (a full, read-only or vanished folder) and Ctrl-C before
    the loop's own handler are printed as one paragraph without traceback and exit with their
    status; so is a rank's failure inside a collective whose partner stopped first (its own error is
    the one to read: runner/distributed/launch.py ``lost_peer``); other errors (bugs) propagate with their
    traceback. In a sweep: every error is
    recorded and logged, and the job returns None, except an interrupt, which ends the sweep.
    """
    multirun, num, overrides = _hydra_job()
    started = time.perf_counter()
    _reset_cuda_peaks()

    def record(status: str, error: str | None, exit_code: int) -> dict[str, Any] | None:
        summary = None
        try:  # the error path must not raise: on a full disk this write fails too
            summary = write_job_summary(cfg, status, error, exit_code, num, overrides, time.perf_counter() - started)
        except Exception as e:
            log.warning("could not write %s: %s", JOB_SUMMARY, f"{type(e).__name__}: {e}".splitlines()[0])
        plot_job(cfg)  # loss.png, however the job ended; a warning at worst
        return summary

    try:
        value = task(cfg)
    except SweepStop as e:  # the sweep's pruner stopped the job: not an error, its checkpoint is kept
        summary = record(SweepStop.status, str(e), SweepStop.exit_code)
        return trial_outcome(cfg, SweepStop.status, summary) if multirun else None
    except SystemExit as e:  # run() exits 128+signal when interrupted; such a signal stops the sweep too
        code = e.code if isinstance(e.code, int) else 1
        if code == 0:
            record("ok", None, 0)
            raise
        record("interrupted" if code >= 128 else "failed", f"exit status {code}", code)
        if not multirun or code >= 128:
            raise
        return None
    except (UserError, OSError, KeyboardInterrupt) as e:
        error = as_user_error(e)
        record(error.status, str(error), error.exit_code)
        print(f"error: {error}", file=sys.stderr)
        if not multirun or isinstance(error, Interrupted):
            sys.exit(error.exit_code)
        _forget(e)
        return None
    except Exception as e:
        from runner.distributed.launch import lost_peer
        from runner.guards.oom import first_line, is_out_of_memory

        record("oom" if is_out_of_memory(e) else "failed", first_line(e), 1)
        if not multirun and lost_peer(e):  # another rank stopped first: its error is the one to read
            print("error: another process of this run stopped first (its error is printed above), "
                  f"so this one stopped too, inside a collective: {first_line(e)}", file=sys.stderr)
            sys.exit(1)
        if not multirun:
            raise
        log.error("job %s failed; the sweep goes on", num, exc_info=e)
        _forget(e)
        return None
    summary = record("ok", None, 0)
    return trial_outcome(cfg, "ok", summary) if multirun else value  # a sweep's job: its objective(s) for the sweeper


def as_user_error(error: BaseException) -> UserError:
    """The one-paragraph form of an expected failure: a UserError as is, an OSError (the runner wraps
    the ones it expects with more context; this is the net under the rest) and a Ctrl-C that came
    before the training loop's own handler."""
    if isinstance(error, UserError):
        return error
    if isinstance(error, OSError):
        return storage_error(error, "Reading or writing a file")
    return Interrupted(signal.SIGINT, "Interrupted (Ctrl-C) before training started; nothing was trained or saved.")


def _reset_cuda_peaks() -> None:
    """A job's peak memory must be its own, not an earlier job's of the same sweep process.

    Only when CUDA is already initialised: touching it earlier would initialise it before the
    allocator plugin's settings (which must come first).
    """
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def _forget(error: BaseException) -> None:
    """Let the next job of the sweep start clean: the traceback holds the failed job's models."""
    error.__traceback__ = None
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:  # cleanup is best effort; the next job reports its own memory
        pass


def _make_dir_or_exit(path: str, key: str) -> None:
    """Create Hydra's run or sweep directory before Hydra does, so that a read-only or full disk is
    one message (exit 5) instead of the traceback Hydra prints when its own ``mkdir`` fails."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        error = storage_error(e, f"Creating the output folder ({key})", path,
                              advice=f"Hydra keeps its logs there: run from a folder you can write to, or set "
                              f"{key}=<folder> (output_dir=<folder> moves the run's own outputs).")
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)


class SweepSummary(Callback):
    """Hydra callback: creates the run or sweep directory with a clear error, and at the end of a
    ``-m`` sweep prints the table and writes sweep_summary.csv."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra resolves ${now:...} once (a cached resolver), so this is the folder it will use.
        _make_dir_or_exit(str(config.hydra.run.dir), "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _make_dir_or_exit(str(config.hydra.sweep.dir), "hydra.sweep.dir")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _last_sweep
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        rows = collect(sweep_dir)
        write_csv(rows, sweep_dir / SWEEP_CSV)
        from runner.output.plots import SWEEP_PNG, safely, write_sweep_plot

        safely(SWEEP_PNG, lambda: write_sweep_plot(rows, sweep_dir / SWEEP_PNG))  # a warning at worst
        from runner.sweep.picture import SWEEP_OBJECTIVE_PNG, write_objective_plot
        from runner.sweep.samples import SWEEP_SAMPLES_PNG, write_sweep_samples

        safely(SWEEP_OBJECTIVE_PNG, lambda: write_objective_plot(rows, config, sweep_dir / SWEEP_OBJECTIVE_PNG))
        safely(SWEEP_SAMPLES_PNG, lambda: write_sweep_samples(rows, sweep_dir / SWEEP_SAMPLES_PNG))  # when jobs sampled
        bad = [r for r in rows if r.get("status") not in OK_STATUSES]
        from runner.sweep.report import best_lines

        pruned = sum(r.get("status") == "pruned" for r in rows)
        unfit = sum(r.get("status") == "does_not_fit" for r in rows)
        killed = sum(r.get("status") == "killed" for r in rows)  # by an earlier run of a resumed Optuna study
        print(f"\nsweep: {len(rows)} jobs, {len(rows) - len(bad) - pruned - unfit - killed} ok, {pruned} pruned, "
              + (f"{unfit} do not fit, " if unfit else "") + (f"{killed} killed and replaced, " if killed else "")
              + f"{len(bad)} not ok  "
              f"({sweep_dir / SWEEP_CSV})\n{format_table(rows)}\n" + "\n".join(best_lines(rows, config)))
        _last_sweep = rows


def exit_status() -> int:
    """1 when the last sweep of this process had a job that did not end ``ok`` (or ``pruned``, ``does_not_fit``:
    runner/sweep/config.py OK_STATUSES), else 0."""
    return int(bool(_last_sweep) and any(r.get("status") not in OK_STATUSES for r in _last_sweep))


def _fast_help(args: Any) -> None:
    """``--help``: Hydra's text from runner/cli/help.py (a second instead of Hydra's several); returns when
    the help template needs Hydra itself."""
    from runner.cli.help import format_help

    try:
        text = format_help(args.overrides, resolve=bool(args.resolve))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    if text is not None:
        print(text)
        sys.exit(0)


def launch(task: Callable[[DictConfig], Any]) -> None:
    """Run ``task`` as the runner's Hydra application: one run or a ``-m`` sweep over the same
    config tree, after a friendly pre-check of the overrides; exits with the sweep's status.
    ``python -m runner`` and hosted scripts (runner.hosted.hosted) both start here."""
    if "--version" in sys.argv[1:]:  # before Hydra's parser, whose --version prints Hydra's own
        from runner.cli.version import version_line

        print(version_line())
        sys.exit(0)
    load_all()
    args, _ = hydra_args()
    if args.help and not (args.hydra_help or args.info or args.cfg):
        _fast_help(args)
    if not (args.help or args.hydra_help or args.info or args.shell_completion):
        try:  # every job's config checked first (no torch), then against this machine (torch)
            # --config-dir (a user's presets, e.g. mode=fit's conf/) joins the search path for the pre-check too
            extra = [f"hydra.searchpath=[file://{Path(args.config_dir).resolve()}]"] if args.config_dir else []
            configs = precheck([*args.overrides, *extra], multirun=args.multirun, run_checks=False)
            if args.cfg:  # --cfg job prints the composed config; nothing runs
                configs = []
            elif configs and all(str(c.mode) == "plugins" for c in configs):
                print(format_plugin_list())  # a listing: no run, so no output directory
                sys.exit(0)
            with typed_overrides(args.overrides):  # what the user typed, before Hydra records it
                for cfg in configs:
                    check_run(cfg)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(e.exit_code)
        agree_on_start()  # torchrun / accelerate launch: one process group, one run directory (runner/distributed/launch.py)
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(lambda cfg: run_job(task, cfg))()
    sys.exit(exit_status())  # non-zero when a sweep job failed
