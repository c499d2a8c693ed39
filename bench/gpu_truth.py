"""GPU truth (issue 33): every shipped preset measured on a GPU against its plan, in one command.

On the lent GPU machine (torch with CUDA, no diffusers/hydra/omegaconf/bitsandbytes), after
``bash bench/gpu_wheels.sh`` here, with the device tool carrying ``.whl``::

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \\
      && ln -sfn ../plugins runner/plugins \\
      && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 bench/gpu_truth.py --out $OUT --work /tmp/gpu_truth

(the link: plugins/ is installed as runner.plugins, and nothing is installed there; ``--out $OUT``
gets only rows.jsonl, meta.json, table.md and failures.log, within the device tool's 8 files)

and then here, from the files that came back (rows.jsonl, meta.json): ``python bench/gpu_truth.py
--render <that folder> --write`` replaces this script's section of docs/benchmarks.md (``--write`` on
the GPU machine writes that machine's copy, which does not come back). CI runs ``--dry-run``
(tests/bench/test_gpu_truth.py): the same code, at model.size=tiny on the CPU, so this script cannot rot.

What it runs, each row in its own process (``python -m runner +preset=<p> model.size=full
train.device=cuda train.steps=11 allocator.default.cap_to_budget=true ...``; random-init weights,
nothing downloads): every preset in conf/preset/ capped at its own budget_gb (24 GiB for the
*_24gb presets), plus offload=stream on vs off (sd35_24gb), fused backward on vs off (sdxl_24gb)
and an injected OOM that the runner must recover from (sd15_8gb). Each row's plan is ``mode=plan``
with the row's exact overrides, made for all rows first and in parallel on the CPU cores; so the
rows run longest predicted step first (``--order shortest`` reverses it), skip their identical
preflight (``train.preflight=false``), a row whose predicted steps alone exceed what is left is
not started (a shorter one after it may be), and a row the budget cuts still has its plan. The
runner's final checkpoint (up to 48 GB at full size) is not written: a file named ``checkpoints``
in the run's folder makes that save fail at once, after the measured steps (``--save-checkpoints``
lets it write). Per row: CUDA max allocated and max reserved against the plan's peak and required
bytes, measured s/step (mean of steps 2-11, with their spread, and MFU) against the plan's for this card (conf/devices.yaml key
from torch.cuda.get_device_name, passed as ``device.name``), and the status.

``--budget-s`` (default 480) bounds the wall time: each process gets what is left as its timeout;
when it is spent the script stops, writes the partial table and names the missing rows. Every row
is appended to ``rows.jsonl`` and ``table.md`` is rewritten as soon as it completes. Exit status: 0
when every row that ran is ok, 1 when one is not, 2 for no CUDA device (one line) or bad arguments.
Needs only the standard library here; torch and the runner run in the child processes.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from docs_section import DOC, replace_section  # bench/ is on sys.path as the script's folder
from gpu_truth_proc import cpu_model, kill_all, probe, run_command
from gpu_truth_rows import (
    GIB,
    RESULTS,
    ROOT,
    Row,
    all_rows,
    device_key,
    device_table,
    first_line,
    merge_overrides,
    plan_figures,
    read_json,
    read_jsonl,
    read_row,
)
from gpu_truth_table import BEGIN, END, section

STEPS = 11  # on the GPU: steps 2-11 are timed (step 1 warms up), their spread is shown
DRY_STEPS = 3  # the CPU dry run: the same code, fewer steps
MIN_ROW_S = 10.0  # default --min-row-s: a row is not started with less left (no run gets through 3 steps that fast)
RESERVE_S = 2.0  # kept back from each timeout for writing the table
class Stopped(Exception):
    """SIGTERM: stop like Ctrl-C (children killed, the table as far as it got)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring for the "
                                 "one-command GPU usage.", formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="model.size=tiny on the CPU: what CI runs")
    ap.add_argument("--plan-only", action="store_true", help="only the GPU rows' plans and their order (no runs, "
                                                             "no GPU needed; --device-name picks the card)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget in seconds (default 480)")
    ap.add_argument("--out", type=Path, help="rows.jsonl, meta.json, table.md, failures.log "
                                             "(default outputs/gpu_truth/<time>)")
    ap.add_argument("--work", type=Path, help="the runs' folders (default <out>/runs); keep it out of $OUT")
    ap.add_argument("--only", help="comma-separated row names (default: every row)")
    ap.add_argument("--order", choices=("longest", "shortest"), default="longest",
                    help="run the rows by predicted s/step, longest first (default) or shortest first")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="rows with an ok measurement in any rows.jsonl under this folder run after the others "
                         f"(default {RESULTS.relative_to(ROOT)})")
    ap.add_argument("--cap-gb", type=float, help="cap every preset at this budget_gb instead of its own")
    ap.add_argument("--device-name", help="conf/devices.yaml key of this card, when it is not recognised")
    ap.add_argument("--min-row-s", type=float, default=MIN_ROW_S,
                    help=f"do not start a row with less of the budget left (default {MIN_ROW_S:g} s)")
    ap.add_argument("--demo-size", type=int, default=4, help="data.demo_size (default 4)")
    ap.add_argument("--jobs", type=int, help="plans made at once (default: one per CPU core)")
    ap.add_argument("--save-checkpoints", action="store_true",
                    help="let each run write its final checkpoint (by default a file named checkpoints in its folder "
                         "stops that save at once: a full-size one is up to 48 GB)")
    ap.add_argument("--write", action="store_true", help="replace this script's section of docs/benchmarks.md")
    ap.add_argument("--docs", type=Path, default=DOC, help="the file --write updates (default docs/benchmarks.md)")
    ap.add_argument("--render", type=Path, nargs="+",
                    help="no runs: the section from <folder>'s rows.jsonl and meta.json; with several folders (a "
                         "first run, then --only runs of the rows its budget missed), a later folder's finished row "
                         "replaces an earlier one's")
    return ap.parse_args(argv)


# ---- the run -------------------------------------------------------------------------------------
class Truth:
    """One invocation: its rows, folders, budget and the records written so far."""

    def __init__(self, args: argparse.Namespace, rows: list[Row], info: dict[str, Any], t0: float) -> None:
        self.args, self.rows, self.info, self.t0 = args, rows, info, t0  # t0: the script's start (probe included)
        self.dry, self.plan_only = bool(args.dry_run), bool(args.plan_only) and not args.dry_run
        self.steps = DRY_STEPS if self.dry else STEPS
        self.out = args.out or ROOT / "outputs" / "gpu_truth" / time.strftime("%Y-%m-%d_%H-%M-%S")
        self.work = args.work or self.out / "runs"
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "rows.jsonl").write_text("")
        self.recs: list[dict[str, Any]] = []
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.key, self.device_line = self.card()
        self.common, self.run_only = self.overrides()
        self.meta = self.make_meta()

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def card(self) -> tuple[str | None, str]:
        info = self.info
        if self.dry:
            return None, (f"CPU dry run on {cpu_model()} ({os.cpu_count()} cores), torch {info['torch']}; "
                          "predicted s/step: the plan's, measured on this CPU")
        table, key = device_table(), self.args.device_name
        if key is not None and key not in table:
            raise SystemExit(f"bench/gpu_truth.py: --device-name {key} is not in conf/devices.yaml "
                             f"({', '.join(table)})")
        if self.plan_only:
            return key, (f"plans only (no run), for {table[key]['label'] if key else 'the reference card'}, "
                         f"torch {info['torch']}")
        if key is not None:
            how = f"{info['name']} taken as conf/devices.yaml's {key}"
        else:
            key, how = device_key(info["name"], info["total_bytes"], table)
        return key, (f"{info['name']} ({info['total_bytes'] / GIB:.1f} GiB), torch {info['torch']}, CUDA "
                     f"{info['cuda_version']}, driver {info['driver']}; {how}")

    def overrides(self) -> tuple[list[str], list[str]]:
        """The overrides every row shares (plan and run), and those only the run needs."""
        demo = f"data.demo_size={self.args.demo_size}"
        if self.dry:  # the tiny model's own data sizes: a preset's video frames and sizes are for full size
            common = ["model.size=tiny", "train.device=cpu", demo, "data.frames=null", "data.width=null",
                      "data.height=null"]
        else:
            common = ["model.size=full", "train.device=cuda", demo, "allocator.default.cap_to_budget=true"]
            common += [f"budget_gb={self.args.cap_gb:g}"] if self.args.cap_gb else []
            common += [f"device.name={self.key}"] if self.key else []
        return common, [f"train.steps={self.steps}", "train.progress=false", "export.enabled=false", "train.preflight=false"]

    def make_meta(self) -> dict[str, Any]:
        command = " ".join([Path(sys.executable).name, "bench/gpu_truth.py", *map(shlex.quote, sys.argv[1:])])
        mode = "dry-run" if self.dry else "plan-only" if self.plan_only else "gpu"
        return {"mode": mode, "device": self.info.get("name") or "CPU",
                "device_key": self.key, "device_line": self.device_line, "command": command,
                "date": time.strftime("%Y-%m-%d %H:%M %Z"), "budget_s": self.args.budget_s, "common": self.common,
                "run_only": self.run_only, "torch": self.info["torch"], "cuda_version": self.info.get("cuda_version"),
                "driver": self.info.get("driver"), "order": [r.name for r in self.rows], "complete": False,
                "save_blocked": not self.args.save_checkpoints, "order_rule": self.args.order}

    def row_overrides(self, row: Row, *more: str) -> list[str]:
        return merge_overrides([f"+preset={row.preset}"], self.common, row.settings,
                               row.dry_settings if self.dry else [], self.run_only, list(more))

    def add(self, rec: dict[str, Any], log: Path | None = None) -> None:
        """Record a finished row at once: rows.jsonl, table.md, and (--write) the docs section."""
        self.recs.append(rec)
        with open(self.out / "rows.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        if log is not None and log.is_file() and rec["status"] not in ("ok", "skipped", "missing"):
            tail = log.read_text(errors="replace").splitlines()[-40:]
            with open(self.out / "failures.log", "a") as f:
                f.write(f"==== {rec['row']}: {rec['status']} ({log})\n" + "\n".join(tail) + "\n")
        self.publish()
        print(f"[{time.monotonic() - self.t0:5.0f} s] {rec['row']}: {rec['status']}"
              + (f" ({rec['error']})" if rec.get("error") else ""), flush=True)

    def publish(self) -> None:
        self.meta["used_s"] = time.monotonic() - self.t0
        (self.out / "meta.json").write_text(json.dumps(self.meta, indent=2) + "\n")
        text = section(self.meta, self.recs, self.rows)
        (self.out / "table.md").write_text(text + "\n")
        if self.args.write:
            replace_section(text, BEGIN, END, self.args.docs)

    def not_run(self, row: Row, status: str, why: str) -> dict[str, Any]:
        return {"row": row.name, "kind": row.kind, "preset": row.preset, "settings": row.settings,
                "status": status, "error": why}

    # ---- plans, all first --------------------------------------------------------------------
    def plan_jobs(self, rows: list[Row]) -> list[tuple[str, list[str]]]:
        jobs = [(r.name, self.row_overrides(r)) for r in rows]
        for r in rows:
            if r.kind == "oom":  # the same at half the micro-batch: the cap goes between the two
                jobs.append((r.name + "__half", self.row_overrides(r, f"train.grad_accum={self.half_accum(r)}")))
        return jobs

    @staticmethod
    def batch_of(row: Row) -> int:
        got = [s.split("=", 1)[1] for s in row.settings if s.startswith("train.batch_size=")]
        return int(got[-1]) if got else 2

    def half_accum(self, row: Row) -> int:
        return 2 if self.batch_of(row) >= 2 else 1

    def plan_all(self, rows: list[Row]) -> dict[str, tuple[int | None, dict[str, Any] | None]]:
        """``mode=plan`` of every row (and the OOM row's half-micro-batch twin): one worker process per
        CPU core (bench/gpu_truth_plan.py), the jobs dealt out in turn. (exit status, plan) by job;
        the status is None for a job the budget cut."""
        jobs = self.plan_jobs(rows)
        folders = {name: self.work / "plans" / name for name, _ in jobs}
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
        workers = max(1, min(len(jobs), self.args.jobs or os.cpu_count() or 1))
        deadline = time.monotonic() + self.left() - RESERVE_S

        def worker(i: int) -> None:
            spec = self.work / "plans" / f"worker{i}.json"
            spec.write_text(json.dumps([[n, ov, str(folders[n])] for n, ov in jobs[i::workers]]))
            cmd = [sys.executable, str(Path(__file__).with_name("gpu_truth_plan.py")), str(spec)]
            run_command(cmd, spec.with_suffix(".log"), deadline - time.monotonic(), self.env)

        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            try:
                list(pool.map(worker, range(workers)))
            except BaseException:  # Ctrl-C or SIGTERM: end the workers now, or the pool waits for the deadline
                kill_all()
                raise
        self.meta["prepass_s"] = time.monotonic() - started
        plans, self.meta["plan_s"] = {}, {}
        for name, folder in folders.items():
            result = read_json(folder / "plan_result.json") or {}
            self.meta["plan_s"][name] = result.get("seconds")
            plans[name] = (result.get("rc"), read_json(folder / "plan.json"))
            if result.get("error"):
                (folder / "plan.log").write_text(result["error"] + "\n")
        return plans

    def order(self, rows: list[Row], plans: dict[str, tuple[int | None, dict[str, Any] | None]]) -> list[Row]:
        """The rows to run, by predicted step (``--order``). A row without a usable plan is recorded now:
        missing when the budget ran out while planning, failed when the planner failed or the plan is
        over budget (the runner's preflight would refuse it; the OOM row is over its cap on purpose)."""
        runnable = []
        for r in rows:
            rc, plan = plans.get(r.name, (None, None))
            half = plans.get(r.name + "__half", (0, {}))[1] if r.kind == "oom" else {}
            log = self.work / "plans" / r.name / "plan.log"
            if r.name not in plans:
                self.add(self.not_run(r, "missing", f"not planned: under {self.args.min_row_s:g} s of the budget left"))
            elif plan is None or half is None:
                if rc is None:
                    self.add(self.not_run(r, "missing", "the budget ran out while planning"))
                else:
                    why = first_line(log.read_text()) if log.is_file() else "no plan.json"
                    self.add(self.not_run(r, "failed", f"mode=plan failed (exit {rc}): {why}"), log)
            elif plan.get("fits") is False and r.kind != "oom":
                fig = plan_figures(plan)
                self.add(self.not_run(r, "failed", f"planned {fig['plan_required_gb']:.2f} GiB is over budget_gb="
                                                   f"{fig['plan_budget_gb']:g}: the runner's preflight refuses it"))
            else:
                runnable.append(r)
        runnable = order_rows(runnable, {r.name: plan_figures(plans[r.name][1])["predicted_s"] for r in runnable},
                              self.args.order, measured_rows(self.args.results))
        self.meta["order"] = [rec["row"] for rec in self.recs] + [r.name for r in runnable]
        return runnable

    def oom_cap(self, row: Row, plans: dict[str, tuple[int | None, dict[str, Any] | None]]) -> dict[str, Any]:
        """Halfway between the planned needs of the batch and of half of it: the first step runs out
        of memory and the runner's recovery halves the micro-batch once."""
        full, half = (plan_figures(plans[n][1])["plan_required_gb"] for n in (row.name, row.name + "__half"))
        batch = self.batch_of(row)
        return {"cap_gb": (full + half) / 2, "half_required_gb": half, "batch": batch,
                "half_batch": batch // self.half_accum(row)}

    def run_row(self, row: Row, plans: dict[str, tuple[int | None, dict[str, Any] | None]]) -> tuple[Any, Path]:
        """Run one row; its record, or None when the budget ran out before it finished."""
        folder = self.work / row.name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        shutil.copy(self.work / "plans" / row.name / "plan.json", folder / "plan.json")  # job_summary reads it
        extra: dict[str, Any] = self.oom_cap(row, plans) if row.kind == "oom" else {}
        more = ["allocator.default.cap_to_budget=true", f"budget_gb={extra['cap_gb']:.4f}"] if extra else []
        overrides = self.row_overrides(row, *more)
        cmd = [sys.executable, "-m", "runner", *overrides, f"output_dir={folder}", f"hydra.run.dir={folder}/hydra"]
        log = folder / "run.log"
        started = time.monotonic()
        blocked = not self.args.save_checkpoints
        if blocked:  # the runner always saves at the end; this makes that save fail at once, writing nothing
            (folder / "checkpoints").write_text("bench/gpu_truth.py: blocks the final checkpoint save\n")
        rc = run_command(cmd, log, self.left() - RESERVE_S, self.env)
        if rc is None:
            return None, log
        rec = read_row(row, folder, log, rc, self.steps, extra.get("batch"), save_blocked=blocked)
        rec.update(extra, settings=[*row.settings, *(row.dry_settings if self.dry else []), *more],
                   wall_s=time.monotonic() - started, predicted_ok=self.dry or self.key is not None,
                   overrides=overrides)
        return rec, log

    def time_needed(self, row: Row, plans: dict[str, tuple[int | None, dict[str, Any] | None]]) -> float:
        """A lower bound of a row's time: its predicted steps (when predicted for this card), at least --min-row-s."""
        predicted = plan_figures(plans[row.name][1])["predicted_s"] if (self.dry or self.key) else None
        return max(self.args.min_row_s, self.steps * (predicted or 0.0))

    def run_rows(self, order: list[Row], plans: dict[str, tuple[int | None, dict[str, Any] | None]]) -> None:
        """Each row in turn. One that cannot finish in what is left (by its predicted steps alone) is not
        started, and a shorter one after it may still be; one killed by the budget ends the runs."""
        for i, row in enumerate(order):
            if self.plan_only:
                self.add({**self.not_run(row, "planned", None), **plan_figures(plans[row.name][1]),
                          **(self.oom_cap(row, plans) if row.kind == "oom" else {}), "predicted_ok": True})
                continue
            need = self.time_needed(row, plans)
            if self.left() < need:
                self.add(self.not_run(row, "missing", f"not started: {max(self.left(), 0):.0f} s of the budget "
                                                      f"left, it needs at least {need:.0f} s"))
                continue
            rec, log = self.run_row(row, plans)
            if rec is None:
                self.stop(order[i:], f"killed when the {self.args.budget_s:g} s budget ran out, while it ran")
                return
            self.add(rec, log)

    def stop(self, rows: list[Row], why: str) -> None:
        for i, r in enumerate(rows):
            self.add(self.not_run(r, "missing", why if i == 0 else "not started: the budget was spent"))

    def run(self) -> int:
        print(f"gpu_truth: {self.device_line}; budget {self.args.budget_s:g} s; output {self.out}", flush=True)
        runnable = []
        for r in self.rows:
            if self.dry and r.needs_cuda:
                self.add(self.not_run(r, "skipped", f"needs CUDA ({r.needs_cuda})"))
            else:
                runnable.append(r)
        plans = self.plan_all(runnable) if runnable and self.left() > self.args.min_row_s else {}
        if runnable:
            print(f"[{time.monotonic() - self.t0:5.0f} s] planned {len(plans)} runs", flush=True)
        self.run_rows(self.order(runnable, plans), plans)
        self.meta["complete"] = True
        self.publish()
        print("\n" + (self.out / "table.md").read_text(), flush=True)
        missing = [r["row"] for r in self.recs if r["status"] == "missing"]
        if missing:
            print(f"gpu_truth: budget spent; missing rows: {', '.join(missing)}", flush=True)
        bad = [r["row"] for r in self.recs if r["status"] not in ("ok", "skipped", "missing", "planned")]
        if bad:
            print(f"gpu_truth: rows not ok: {', '.join(bad)} (see {self.out / 'failures.log'})", flush=True)
        return 1 if bad else 0


def measured_rows(results: Path) -> set[str]:
    """Rows that have a measured s/step (status ok) in some rows.jsonl under ``results``."""
    done: set[str] = set()
    for path in sorted(results.rglob("rows.jsonl")) if results.is_dir() else []:
        done |= {r["row"] for r in read_jsonl(path) if r.get("status") == "ok" and r.get("s_per_step")}
    return done


def order_rows(rows: list[Row], predicted: dict[str, float | None], rule: str, measured: set[str]) -> list[Row]:
    """Rows never measured first (they are what a lent GPU is for), then by predicted s/step: longest first,
    or shortest first with ``rule="shortest"``."""
    sign = 1.0 if rule == "shortest" else -1.0
    return sorted(rows, key=lambda r: (r.name in measured, sign * (predicted.get(r.name) or 0.0)))


def select(rows: list[Row], only: str | None) -> list[Row]:
    if not only:
        return rows
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in {r.name for r in rows}]
    if unknown:
        raise SystemExit(f"bench/gpu_truth.py: no row {', '.join(unknown)}; rows: {', '.join(r.name for r in rows)}")
    return [r for r in rows if r.name in names]


def merge_runs(folders: list[Path]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One table from several runs on the same card: the first run's meta, each later command named in
    ``meta["more"]``, and a row a later run finished replacing the first's missing one. Why: one command
    rarely fits every full-size row in a lease's 10-minute call, and ``--only`` runs the rest."""
    metas, rows = [], {}
    for folder in folders:
        meta = read_json(folder / "meta.json")
        if meta is None:
            raise SystemExit(f"bench/gpu_truth.py: no readable meta.json in {folder}")
        if metas and meta.get("device_line") != metas[0].get("device_line"):
            raise SystemExit(f"bench/gpu_truth.py: {folder} ran on {meta.get('device_line')}, not on "
                             f"{metas[0].get('device_line')}: one table is one card's")
        metas.append(meta)
        for rec in read_jsonl(folder / "rows.jsonl"):
            if rec["row"] not in rows or rec["status"] != "missing":
                rows[rec["row"]] = rec
    meta = dict(metas[0])
    meta["more"] = [{k: m.get(k) for k in ("command", "date", "used_s", "budget_s")} for m in metas[1:]]
    meta["complete"] = all(m.get("complete", False) for m in metas)
    return meta, list(rows.values())


def render(args: argparse.Namespace) -> int:
    """The section from finished (or cut) runs' files, e.g. those a GPU machine sent back."""
    meta, recs = merge_runs(args.render)
    text = section(meta, recs, all_rows())
    print(text)
    if args.write:
        replace_section(text, BEGIN, END, args.docs)
    return 0


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        return render(args)
    t0 = time.monotonic()
    rows = select(all_rows(), args.only)
    signal.signal(signal.SIGTERM, _stop)
    truth = Truth(args, rows, probe(args.dry_run or args.plan_only), t0)
    try:
        return truth.run()
    except (KeyboardInterrupt, Stopped):
        kill_all()
        truth.publish()
        print(f"gpu_truth: stopped; rows so far in {truth.out}", file=sys.stderr)
        return 1
    finally:
        kill_all()


if __name__ == "__main__":
    sys.exit(main())
