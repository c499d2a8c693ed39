"""How each job ended, and a summary of a ``-m`` sweep.

Every job (a single run too) writes ``job_summary.json`` in its directory, atomically and as
strict JSON (a NaN loss is ``null``): its overrides, status (``ok``; ``failed``: bad input, exit 2;
``oom``: exit 3; ``nonfinite``: NaN/inf loss or gradients, exit 4; ``io_error``: a full, read-only
or vanished folder, exit 5; ``interrupted``: 128 + the signal), steps done, final loss, s/step, peak memory and
final micro-batch size, read back from its metrics.jsonl. After a sweep, the
:class:`SweepSummary` Hydra callback (configured under ``hydra.callbacks`` in conf/config.yaml)
collects them into ``sweep_summary.csv`` in the sweep directory and prints a table.

Why jobs return a status instead of raising: Hydra's basic launcher runs the jobs of a sweep in
one process. ``sys.exit`` in a job (how a single run reports a user error) would end the whole
sweep at the first bad job, and any other exception is re-raised by the sweeper after the
batch, which skips ``on_multirun_end`` and so the summary. So in a sweep :func:`run_job` records
the failure, frees what the job held and returns; the sweep goes on, and the process exits
with status 1 at the end if any job did not end ``ok`` (the table says which). A single run
still exits with the error's own status (2 for bad input, 3 for out of memory at micro-batch
1) and keeps the traceback of a bug.

Columns that summarise: ``final_loss`` is the mean loss of the last 10% of the job's steps (at
least one; ``final_loss_steps`` says how many), since a single step's loss is one batch's noise.
``peak_memory_gb`` is device memory: on CUDA the run's peak allocated bytes (``memory_peak_gb``);
on CPU the memory profile's tracked peak when the job was profiled, else the preflight plan's
device peak, never the process RSS (which counts the interpreter and every library, and in a
sweep run in one process what earlier jobs left behind). ``peak_memory_source`` says which figure
it is; ``planned_peak_gb`` (the plan, on any device) and ``host_rss_peak_gb`` sit beside it.
``sweep.png`` plots every job's loss and its planned and measured peak (runner/plots.py).
"""
from __future__ import annotations

import csv
import gc
import json
import logging
import math
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner import registry
from runner.dist.launch import agree_on_start
from runner.errors import Interrupted, UserError, storage_error
from runner.validate import check_run, conf_dir, hydra_args, precheck

log = logging.getLogger("runner")

JOB_SUMMARY = "job_summary.json"
SWEEP_CSV = "sweep_summary.csv"
STATUSES = ("ok", "oom", "failed", "interrupted", "nonfinite", "io_error")
COLUMNS = ("job", "status", "overrides", "steps_done", "final_loss", "final_loss_steps", "s_per_step", "peak_memory_gb",
           "peak_memory_source", "planned_peak_gb", "host_rss_peak_gb", "micro_batch_size", "exit_code", "error", "dir")

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
    status; other errors (bugs) propagate with their traceback. In a sweep: every error is
    recorded and logged, and the job returns None, except an interrupt, which ends the sweep.
    """
    multirun, num, overrides = _hydra_job()
    started = time.perf_counter()
    _reset_cuda_peaks()

    def record(status: str, error: str | None, exit_code: int) -> None:
        try:  # the error path must not raise: on a full disk this write fails too
            write_job_summary(cfg, status, error, exit_code, num, overrides, time.perf_counter() - started)
        except Exception as e:
            log.warning("could not write %s: %s", JOB_SUMMARY, f"{type(e).__name__}: {e}".splitlines()[0])
        plot_job(cfg)  # loss.png, however the job ended; a warning at worst

    try:
        value = task(cfg)
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
        from runner.oom import first_line, is_out_of_memory

        record("oom" if is_out_of_memory(e) else "failed", first_line(e), 1)
        if not multirun:
            raise
        log.error("job %s failed; the sweep goes on", num, exc_info=e)
        _forget(e)
        return None
    record("ok", None, 0)
    return value


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


FINAL_LOSS_SHARE = 0.1  # final_loss: the mean loss of the last 10% of steps


def final_loss(losses: list[Any]) -> tuple[float | None, int]:
    """The mean of the finite losses among the last 10% of steps (at least one step), and how many
    steps that is. One step's loss is one batch's: noise, not where the run ended."""
    k = max(1, int(len(losses) * FINAL_LOSS_SHARE))
    tail = [v for v in losses[-k:] if isinstance(v, (int, float)) and math.isfinite(v)]
    return (sum(tail) / len(tail) if tail else None), k


def peak_memory(out: Path, rows: list[dict[str, Any]]) -> tuple[float | None, str | None]:
    """The job's peak device memory in GiB and where it comes from.

    CUDA: the allocator's peak allocated bytes (``memory_peak_gb``). A CPU run has no device
    allocator, and its process RSS counts the interpreter and every library, so it is not the
    figure to compare with a GPU job or a plan: the tracked peak of the memory profile when the run
    was profiled, else the preflight plan's device peak, else nothing (``host_rss_peak_gb`` keeps
    the RSS in its own column)."""
    from runner.plots import GIB, planned_peak_bytes, tracked_peaks

    cuda_peaks = [r["memory_peak_gb"] for r in rows if r.get("memory_peak_gb") is not None]
    if cuda_peaks:
        return max(cuda_peaks), "cuda max allocated"
    tracked = tracked_peaks(out)
    if tracked:
        return max(tracked.values()) / GIB, f"tracked live tensors (memory profile, steps {min(tracked)}-{max(tracked)})"
    planned = planned_peak_bytes(out)
    if planned is not None:
        return planned / GIB, "planned device peak (preflight plan; CPU run, not measured)"
    return None, None


def summarize_metrics(out: Path) -> dict[str, Any]:
    """Steps done, final loss (mean of the last 10% of steps), s/step (first step excluded: warm-up),
    peak memory (see :func:`peak_memory`), planned peak, host RSS peak, last micro-batch."""
    from runner.plots import GIB, planned_peak_bytes
    from runner.report import read_metrics

    path = out / "metrics.jsonl"
    rows = read_metrics(path) if path.is_file() else []
    planned = planned_peak_bytes(out)
    planned_gb = None if planned is None else planned / GIB
    if not rows:
        return {"steps_done": 0, "final_loss": None, "final_loss_steps": 0, "s_per_step": None, "peak_memory_gb": None,
                "peak_memory_source": None, "planned_peak_gb": planned_gb, "host_rss_peak_gb": None,
                "micro_batch_size": None}
    times = [r["s_per_step"] for r in rows]
    tail = times[1:] or times
    loss, k = final_loss([r.get("loss") for r in rows])
    peak, source = peak_memory(out, rows)
    rss = [r["host_rss_gb"] for r in rows if r.get("host_rss_gb") is not None]
    return {"steps_done": rows[-1]["step"], "final_loss": loss, "final_loss_steps": k, "s_per_step": sum(tail) / len(tail),
            "peak_memory_gb": peak, "peak_memory_source": source, "planned_peak_gb": planned_gb,
            "host_rss_peak_gb": max(rss) if rss else None, "micro_batch_size": rows[-1].get("micro_batch_size")}


def plot_job(cfg: DictConfig) -> None:
    """``loss.png`` in the job's directory when it trained (runner/plots.py); never raises."""
    from runner.plots import LOSS_PNG, safely, write_loss_plot
    from runner.run import output_dir

    if str(cfg.get("mode", "train")) != "train":
        return
    try:
        out = output_dir(cfg)
    except UserError:
        return
    safely(LOSS_PNG, lambda: write_loss_plot(out, cfg))


def write_job_summary(cfg: DictConfig, status: str, error: str | None, exit_code: int, num: int | None,
                      overrides: list[str], wall_s: float) -> Path | None:
    from runner.dist.launch import process_world
    from runner.run import output_dir

    if process_world().rank != 0:  # several processes: rank 0 writes the run's files (runner/dist/launch.py)
        return None
    try:
        out = output_dir(cfg)
    except UserError:  # no output directory (not under Hydra, none configured): nothing to write into
        return None
    from runner.report import json_text, write_text_atomic

    out.mkdir(parents=True, exist_ok=True)
    summary = {"job": num, "status": status, "overrides": overrides, **summarize_metrics(out),
               "exit_code": exit_code, "error": error, "dir": str(out), "wall_s": round(wall_s, 3)}
    path = out / JOB_SUMMARY
    write_text_atomic(path, json_text(summary, indent=2) + "\n")  # valid JSON even for a NaN loss, never torn
    return path


# ---- the sweep ---------------------------------------------------------------------------------
def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory of the sweep (a directory with Hydra's ``.hydra/``), by job number.

    A job that wrote no job_summary.json (killed from outside, e.g. by the kernel's OOM killer)
    is listed with status ``unknown``.
    """
    rows = []
    for d in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        summary = d / JOB_SUMMARY
        if summary.is_file():
            rows.append(json.loads(summary.read_text()))
        elif (d / ".hydra" / "overrides.yaml").is_file():
            from omegaconf import OmegaConf

            overrides = list(OmegaConf.load(d / ".hydra" / "overrides.yaml"))
            prefix = d.name.split("_", 1)[0]
            rows.append({"job": int(prefix) if prefix.isdigit() else None, "status": "unknown", "overrides": overrides,
                         "error": "no job_summary.json: the job was killed or crashed hard", "dir": str(d)})
    rows.sort(key=lambda r: (r.get("job") is None, r.get("job") or 0, r.get("dir", "")))
    return rows


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, "overrides": " ".join(r.get("overrides") or [])})


def _fmt(value: Any, spec: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec) if spec else str(value)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The sweep as a text table; overrides shared by every job are listed once above it."""
    lists = [r.get("overrides") or [] for r in rows]
    common = [o for o in lists[0] if all(o in other for other in lists[1:])] if len(lists) > 1 else []
    header = ("job", "status", "overrides", "steps", "loss (last 10%)", "s/step", "peak GiB", "planned GiB", "micro",
              "error")
    body = []
    for r, overrides in zip(rows, lists):
        error = (r.get("error") or "").replace("\n", " ")
        own = " ".join(o for o in overrides if o not in common) or "-"
        body.append((_fmt(r.get("job")), r.get("status", "?"), own,
                     _fmt(r.get("steps_done")), _fmt(r.get("final_loss"), ".4f"), _fmt(r.get("s_per_step"), ".3f"),
                     _fmt(r.get("peak_memory_gb"), ".2f"), _fmt(r.get("planned_peak_gb"), ".2f"),
                     _fmt(r.get("micro_batch_size")),
                     error[:70] + ("..." if len(error) > 70 else "")))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = [f"common overrides: {' '.join(common)}"] if common else []
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(line.rstrip() for line in lines)


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
        from runner.plots import SWEEP_PNG, safely, write_sweep_plot

        safely(SWEEP_PNG, lambda: write_sweep_plot(rows, sweep_dir / SWEEP_PNG))  # a warning at worst
        bad = [r for r in rows if r.get("status") != "ok"]
        print(f"\nsweep: {len(rows)} jobs, {len(rows) - len(bad)} ok, {len(bad)} not ok  "
              f"({sweep_dir / SWEEP_CSV})\n{format_table(rows)}")
        _last_sweep = rows


def exit_status() -> int:
    """1 when the last sweep of this process had a job that did not end ``ok``, else 0."""
    return int(bool(_last_sweep) and any(r.get("status") != "ok" for r in _last_sweep))


def _fast_help(args: Any) -> None:
    """``--help``: Hydra's text from runner/help.py (a second instead of Hydra's several); returns when
    the help template needs Hydra itself."""
    from runner.help import format_help

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
        from runner.version import version_line

        print(version_line())
        sys.exit(0)
    registry.load_all()
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
                print(registry.format_plugin_list())  # a listing: no run, so no output directory
                sys.exit(0)
            for cfg in configs:
                check_run(cfg)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(e.exit_code)
        agree_on_start()  # torchrun / accelerate launch: one process group, one run directory (runner/dist/launch.py)
    hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(lambda cfg: run_job(task, cfg))()
    sys.exit(exit_status())  # non-zero when a sweep job failed
