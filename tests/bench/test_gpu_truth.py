"""bench/gpu_truth.py, kept from rotting: its --dry-run (the GPU command's code at model.size=tiny on
the CPU) runs one row of each kind (shipped presets, stream, fused backward with and without clipping,
the OOM row, a compile row, a video preset), every row's command composes and passes the run's checks,
the budget stops it cleanly, and a machine without a GPU gets one line, not a traceback. Every preset's
tiny run itself is trained, as shipped, by tests/runner/memory/test_cuda_sim.py. The GPU figures come
from a lent GPU (issue 33)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SCRIPT = BENCH / "gpu_truth.py"
DOCS = ROOT / "docs" / "benchmarks.md"
sys.path.insert(0, str(BENCH))  # the script's sibling modules, as the script itself finds them

import gpu_truth_proc  # noqa: E402
from gpu_truth_rows import (  # noqa: E402
    all_rows,
    device_key,
    device_table,
    merge_overrides,
    read_row,
    shipped_presets,
)
from gpu_truth_table import BEGIN, END, section  # noqa: E402

GIB = 2**30
# The rows the dry run runs: one of each kind of row, the presets they compare with, and a video preset.
DRY_ROWS = ["sdxl_24gb", "sdxl_24gb__fused_backward", "sdxl_24gb__fused_noclip", "sd35_24gb", "sd35_24gb__stream",
            "sd15_8gb__oom_recovery", "sdxl_24gb__compile", "wan22_5b_16gb"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _rows(out: Path) -> dict[str, dict]:
    path = out / "rows.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {r["row"]: r for r in map(json.loads, filter(None, lines))}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One full dry run, watched while it runs: rows must reach rows.jsonl one by one, not at the end."""
    out = tmp_path_factory.mktemp("gpu_truth")
    docs_before = DOCS.read_bytes()
    started = time.monotonic()
    with open(out / "stdout.txt", "w") as stdout:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--budget-s", "900",
                                 "--only", ",".join(DRY_ROWS)],
                                cwd=ROOT, env=_env(), stdout=stdout, stderr=subprocess.STDOUT)
        ran_while_running = 0
        while proc.poll() is None:
            if time.monotonic() - started > 1200:
                proc.kill()
                pytest.fail("the dry run outlived its budget")
            ran = sum(r["status"] == "ok" for r in _rows(out).values())
            if proc.poll() is None:
                ran_while_running = max(ran_while_running, ran)
            time.sleep(0.5)
    return {"out": out, "rc": proc.returncode, "rows": _rows(out), "stdout": (out / "stdout.txt").read_text(),
            "ran_while_running": ran_while_running, "docs_changed": DOCS.read_bytes() != docs_before,
            "seconds": time.monotonic() - started}


@pytest.mark.slow
def test_dry_run_presets_ok_with_plan_and_measured_figures(dry_run: dict) -> None:
    assert dry_run["rc"] == 0, dry_run["stdout"][-3000:]
    rows = dry_run["rows"]
    assert sorted(rows) == sorted(DRY_ROWS)
    for preset in [name for name in DRY_ROWS if name in shipped_presets()]:
        r = rows[preset]
        assert r["status"] == "ok", r
        assert r["steps_done"] == 3 and len(r["micro_batches"]) == 3, r
        assert 0 < r["plan_peak_gb"] <= r["plan_required_gb"], r
        assert r["predicted_s"] > 0 and r["s_per_step"] > 0, r
        # On a CPU the job's device peak is the preflight plan's figure (runner/output/jobs.py), never the RSS
        assert r["alloc_peak_gb"] is None and r["peak_source"].startswith("planned device peak"), r
        assert r["peak_gb"] == pytest.approx(r["plan_peak_gb"]), r


@pytest.mark.slow
def test_dry_run_extra_rows(dry_run: dict) -> None:
    rows = dry_run["rows"]
    assert rows["sd35_24gb__stream"]["status"] == "ok"
    assert "offload=[park,stream]" in rows["sd35_24gb__stream"]["settings"]
    assert rows["sdxl_24gb__fused_backward"]["status"] == "ok"
    # fused backward frees the gradients as backward goes: its plan must show it even at tiny size
    assert rows["sdxl_24gb__fused_backward"]["plan_peak_gb"] < rows["sdxl_24gb"]["plan_peak_gb"]
    oom = rows["sd15_8gb__oom_recovery"]
    assert oom["status"] == "skipped" and "needs CUDA" in oom["error"]
    table = (dry_run["out"] / "table.md").read_text()
    assert all(f"`{name}`" in table for name in DRY_ROWS) and "Comparisons:" in table and "Missing" not in table


def test_every_rows_dry_run_command_composes_and_passes_the_checks() -> None:
    """The rows the dry run above leaves out: each one's command (preset, row settings, dry-run overrides) is a run
    the runner accepts."""
    import gpu_truth  # the script's module
    from runner.checks import check_run
    from runner.cli.compose import compose_config

    truth = gpu_truth.Truth.__new__(gpu_truth.Truth)
    truth.dry, truth.args, truth.steps = True, argparse.Namespace(demo_size=4), gpu_truth.DRY_STEPS
    truth.common, truth.run_only = truth.overrides()
    for row in all_rows():
        check_run(compose_config(truth.row_overrides(row)), keep=False)


@pytest.mark.slow
def test_dry_run_writes_each_row_when_it_finishes_and_leaves_the_docs_alone(dry_run: dict) -> None:
    assert 1 <= dry_run["ran_while_running"] < len(dry_run["rows"])
    assert not dry_run["docs_changed"]
    meta = json.loads((dry_run["out"] / "meta.json").read_text())
    assert meta["mode"] == "dry-run" and meta["complete"] and meta["used_s"] < meta["budget_s"]
    # rows never measured on a GPU (bench/results/) first, then the measured ones; longest predicted step first in each
    import gpu_truth  # the script's module

    measured = gpu_truth.measured_rows(ROOT / "bench" / "results")
    ran = [n for n in meta["order"] if dry_run["rows"][n]["status"] == "ok"]
    assert [n in measured for n in ran] == sorted(n in measured for n in ran)
    for group in (False, True):
        predicted = [dry_run["rows"][n]["predicted_s"] for n in ran if (n in measured) == group]
        assert predicted == sorted(predicted, reverse=True)


@pytest.mark.slow
def test_render_writes_the_docs_section(dry_run: dict, tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nhand-written\n")
    for _ in range(2):  # the second time replaces the section, it does not add one
        proc = subprocess.run([sys.executable, str(SCRIPT), "--render", str(dry_run["out"]), "--write", "--docs",
                               str(doc)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nhand-written\n") and text.count(BEGIN) == 1 and text.count(END) == 1
    assert "`sdxl_24gb`" in text


def test_budget_spent_stops_cleanly_and_names_the_missing_rows(tmp_path: Path) -> None:
    """A budget too small for any run (the plans, or the first run, are killed at its end; no row is
    refused for too little time left, --min-row-s 1): the rows already decided (the CUDA-only row,
    skipped) are written, every other row is named as missing, and the script ends within its budget
    with status 0."""
    budget = 15
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--budget-s", str(budget),
                           "--min-row-s", "1", "--only", "sd15_8gb,constrained,sd15_8gb__oom_recovery"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert wall < budget + 25  # the budget, plus the interpreter and torch's import in the probe
    rows = _rows(tmp_path)
    assert rows["sd15_8gb__oom_recovery"]["status"] == "skipped"
    assert {rows[n]["status"] for n in ("sd15_8gb", "constrained")} == {"missing"}
    assert "missing rows: " in proc.stdout and "sd15_8gb" in proc.stdout.split("missing rows: ")[1]
    table = (tmp_path / "table.md").read_text()
    assert "Missing (the budget was spent before they finished): " in table
    assert all(n in table.split("Missing")[1] for n in ("sd15_8gb", "constrained"))


def test_no_gpu_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "no CUDA device" in proc.stderr and "--dry-run" in proc.stderr


def test_a_timed_out_row_is_killed_with_its_children(tmp_path: Path) -> None:
    """The runner may start processes of its own: the whole group goes, none is left on the card."""
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    started = time.monotonic()
    rc = gpu_truth_proc.run_command([sys.executable, "-c", code], tmp_path / "log", 3.0, _env())
    assert rc is None and time.monotonic() - started < 30
    pid = int(pid_file.read_text())
    for _ in range(50):  # reparented to init, which reaps it; a zombie counts as gone
        status = Path(f"/proc/{pid}/status")
        if not status.exists() or "\nState:\tZ" in status.read_text():
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {pid} outlived the timeout")


@pytest.mark.parametrize("name, gib, key", [
    ("NVIDIA H100 80GB HBM3", 79.1, "h100_sxm"),
    ("NVIDIA H100 PCIe", 79.2, "h100_pcie"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "a100_40gb"),
    ("NVIDIA A100 80GB PCIe", 79.1, "a100_80gb"),
    ("NVIDIA GeForce RTX 4090", 23.6, "rtx4090"),
    ("NVIDIA H100 NVL", 93.1, None),  # an H100, but not the 80 GB card the table describes
    ("NVIDIA H200", 139.8, "h200"),
    ("NVIDIA GeForce RTX 4080 SUPER", 15.6, None),
])
def test_card_to_devices_yaml_key(name: str, gib: float, key: str | None) -> None:
    got, why = device_key(name, int(gib * GIB), device_table())
    assert got == key, why
    assert name in why


def test_later_overrides_replace_earlier_ones() -> None:
    assert merge_overrides(["+preset=a", "data.demo_size=4"], ["data.demo_size=8", "x=[1,2]"]) == [
        "+preset=a", "data.demo_size=8", "x=[1,2]"]


def _cuda_run(folder: Path, micro: list[int], retries: list[int]) -> None:
    """The files a CUDA run of the OOM row leaves (metrics as runner/memory/stats.py writes them on CUDA)."""
    folder.mkdir()
    (folder / "plan.json").write_text(json.dumps({"peak_bytes": 12 * GIB, "required_bytes": 12 * GIB + 2**27,
                                                  "budget_bytes": 8 * GIB, "fits": False, "peak_phase": "forward",
                                                  "step_time": {"seconds": 0.08, "device": "NVIDIA H100 SXM5 80GB"}}))
    steps = [{"step": i + 1, "s_per_step": 0.2 if i else 1.0, "micro_batch_size": m, "oom_retries": r,
              "memory_peak_gb": 10.5, "mem_peak_reserved_gb": 11.0} for i, (m, r) in enumerate(zip(micro, retries))]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (folder / "job_summary.json").write_text(json.dumps({"status": "io_error", "peak_memory_gb": 10.5,
                                                         "peak_memory_source": "cuda max allocated",
                                                         "error": "Saving the checkpoint of step 3 into x failed"}))


def test_the_oom_row_is_ok_only_when_the_cap_bit_and_gpu_figures_reach_the_table(tmp_path: Path) -> None:
    row = next(r for r in all_rows() if r.kind == "oom")
    _cuda_run(tmp_path / "recovered", [4, 4, 4], [1, 0, 0])
    rec = read_row(row, tmp_path / "recovered", tmp_path / "log", 5, 3, 8, save_blocked=True)
    assert rec["status"] == "ok" and rec["runner_status"].startswith("io_error")
    assert rec["alloc_peak_gb"] == 10.5 and rec["reserved_peak_gb"] == 11.0 and rec["s_per_step"] == 0.2
    _cuda_run(tmp_path / "never_ran_out", [8, 8, 8], [0, 0, 0])
    bad = read_row(row, tmp_path / "never_ran_out", tmp_path / "log", 5, 3, 8, save_blocked=True)
    assert bad["status"] == "failed" and "did not bite" in bad["error"]
    unblocked = read_row(row, tmp_path / "recovered", tmp_path / "log", 5, 3, 8, save_blocked=False)
    assert unblocked["status"] == "io_error"  # a save that failed by itself is not hidden
    meta = {"mode": "gpu", "device": "NVIDIA H100 80GB HBM3", "device_line": "x", "command": "c", "date": "d",
            "common": [], "run_only": [], "budget_s": 480, "order": [row.name], "complete": True}
    text = section(meta, [{**rec, "wall_s": 30.0, "cap_gb": 11.2, "batch": 8, "half_batch": 4}], all_rows())
    line = next(t for t in text.splitlines() if t.startswith(f"| `{row.name}`"))
    assert "| 10.500 | 11.000 | 12.000 / 12.125 | 0.88 | 0.91 | 0.2 (2 steps, spread 0%) | 0.08 | 2.50 | - | [4, 4, 4] | 30 |" in line
    assert "cap 11.200 GiB" in text and "OOM retries per step [1, 0, 0]" in text


H200 = BENCH / "results" / "gpu_truth_2026-11-27_h200"


def test_committed_gpu_table_is_what_its_files_render() -> None:
    """docs/benchmarks.md's GPU table is the render of the files the H200 run sent back (kept in
    bench/results/): a hand edit of a figure, or a table from other files, fails here."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--render", str(H200 / "run1"), str(H200 / "run2")],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = DOCS.read_text()
    committed = text[text.index(BEGIN):text.index(END) + len(END)]
    assert proc.stdout.strip() == committed


def test_render_merges_a_later_run_into_the_rows_the_first_missed(tmp_path: Path) -> None:
    """The second command's finished row replaces the first's missing one; a later missing row
    never replaces a finished one; runs from another card are refused (one table is one card's)."""
    import gpu_truth  # the script's module, for merge_runs

    first = [json.loads(line) for line in (H200 / "run1" / "rows.jsonl").read_text().splitlines()]
    second = [json.loads(line) for line in (H200 / "run2" / "rows.jsonl").read_text().splitlines()]
    meta, recs = gpu_truth.merge_runs([H200 / "run1", H200 / "run2"])
    by = {r["row"]: r for r in recs}
    assert {r["row"]: r["status"] for r in first}["sd35_24gb__stream"] == "missing"
    assert by["sd35_24gb__stream"] == second[0]
    assert by["sdxl_24gb"] == next(r for r in first if r["row"] == "sdxl_24gb")
    assert [m["command"] for m in meta["more"]] == [json.loads((H200 / "run2" / "meta.json").read_text())["command"]]
    late = tmp_path / "late"
    late.mkdir()
    (late / "meta.json").write_text((H200 / "run2" / "meta.json").read_text())
    (late / "rows.jsonl").write_text(json.dumps({**by["sdxl_24gb"], "status": "missing"}) + "\n")
    _, recs = gpu_truth.merge_runs([H200 / "run1", late])
    assert next(r for r in recs if r["row"] == "sdxl_24gb")["status"] == "ok"
    other = tmp_path / "other"
    other.mkdir()
    meta2 = json.loads((H200 / "run2" / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta2, "device_line": "NVIDIA H100 80GB HBM3"}))
    (other / "rows.jsonl").write_text("")
    with pytest.raises(SystemExit, match="one table is one card's"):
        gpu_truth.merge_runs([H200 / "run1", other])


def test_rows_never_measured_run_first(tmp_path: Path) -> None:
    """A lent GPU's time goes to the rows bench/results/ has no measurement of; then the --order rule."""
    import gpu_truth

    (tmp_path / "h200" / "run1").mkdir(parents=True)
    (tmp_path / "h200" / "run1" / "rows.jsonl").write_text(
        json.dumps({"row": "sdxl_24gb", "status": "ok", "s_per_step": 0.9}) + "\n"
        + json.dumps({"row": "flux_24gb", "status": "missing"}) + "\n")
    measured = gpu_truth.measured_rows(tmp_path)
    assert measured == {"sdxl_24gb"}
    rows = [r for r in all_rows() if r.name in ("sdxl_24gb", "flux_24gb", "sd15_8gb")]
    predicted = {"sdxl_24gb": 5.0, "flux_24gb": 1.0, "sd15_8gb": 2.0}
    assert [r.name for r in gpu_truth.order_rows(rows, predicted, "longest", measured)] == [
        "sd15_8gb", "flux_24gb", "sdxl_24gb"]
    assert [r.name for r in gpu_truth.order_rows(rows, predicted, "shortest", measured)] == [
        "flux_24gb", "sd15_8gb", "sdxl_24gb"]
    committed = gpu_truth.measured_rows(ROOT / "bench" / "results")
    assert {"sd15_8gb", "sdxl_24gb", "sd35_24gb"} <= committed and "flux_24gb" not in committed


def test_compile_rows_and_the_spread_and_mfu_of_a_row() -> None:
    from gpu_truth_rows import measured
    from gpu_truth_table import mfu_cell, step_cell

    rows = {r.name: r for r in all_rows()}
    for preset in ("sdxl_24gb", "flux_24gb"):
        row = rows[f"{preset}__compile"]
        assert row.preset == preset and "train.compile=true" in row.settings and row.baseline == preset
    steps = [{"s_per_step": s} for s in (9.0, 1.0, 1.2, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)]
    got = measured(steps)
    assert got["timed_steps"] == 10 and got["s_per_step"] == pytest.approx(1.0)
    assert got["spread"] == pytest.approx(0.4)  # (1.2 - 0.8) / median 1.0; step 1 (9 s) not timed
    assert "10 steps, spread 40%" in step_cell({**got})
    assert mfu_cell({"plan_mfu": 0.2, "predicted_s": 0.5, "s_per_step": 1.0}) == "10.0%"
    assert mfu_cell({"plan_mfu": None, "predicted_s": 0.5, "s_per_step": 1.0}) == "-"
