"""The command line as a user meets it: help, --cfg, mode=plugins, errors without tracebacks, -m."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_help_lists_the_groups():
    r = cli("--help")
    assert r.returncode == 0, r.stderr
    for group in ("allocator", "checkpoint", "offload", "quantization", "tiling", "trainer", "preset"):
        assert group in r.stdout, group


def test_cfg_job_prints_the_composed_config():
    r = cli("+preset=constrained", "--cfg", "job")
    assert r.returncode == 0, r.stderr
    assert "budget_gb: 12" in r.stdout and "name: blocks" in r.stdout


def test_mode_plugins_lists_every_plugin_with_parameters():
    r = cli("mode=plugins")
    assert r.returncode == 0, r.stderr
    assert "checkpoint:" in r.stdout and "checkpoint.blocks.every_n" in r.stdout
    assert "allocator.default.expandable_segments" in r.stdout


@pytest.mark.parametrize(
    "args, needle",
    [(["train.stepz=3"], "Did you mean 'steps'"),
     (["train.steps=abc"], "train.steps"),
     (["offload=strem"], "Valid names"),
     (["data.path=/no/such/folder", "train.steps=1"], "/no/such/folder")],
)
def test_user_errors_exit_nonzero_without_traceback(args, needle, tmp_path):
    r = cli(*args, f"output_dir={tmp_path}")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_multirun_gives_each_job_its_own_directory(tmp_path):
    r = cli("-m", "+preset=sdxl_24gb,constrained", "train.steps=2", "train.progress=false",
            f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists())
    assert len(jobs) == 2, list(tmp_path.iterdir())
    assert all(len((j / "metrics.jsonl").read_text().splitlines()) == 2 for j in jobs)


def test_unreadable_image_and_corrupt_checkpoint_exit_nonzero_without_traceback(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    (data / "broken.txt").write_text("a caption")
    r = cli(f"data.path={data}", "train.steps=1", f"output_dir={tmp_path / 'out1'}")
    assert r.returncode == 2 and "broken.png" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "state.json").write_text("{ truncated")
    r = cli(f"train.resume={ckpt}", "train.steps=1", f"output_dir={tmp_path / 'out2'}")
    assert r.returncode == 2 and "state.json" in r.stderr and "corrupt" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_sigint_saves_a_checkpoint_and_exits_130(tmp_path):
    import signal
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "runner", "train.steps=500", "train.progress=false", f"output_dir={out}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert (out / "checkpoints" / "latest").is_file()


def test_a_plugins_folder_in_the_working_directory_changes_nothing(tmp_path):
    """The memory plugins ship inside the package (runner.plugins): a user's own plugins/ folder,
    even one whose modules raise on import, is never imported."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "__init__.py").write_text("")
    (tmp_path / "plugins" / "park.py").write_text("raise RuntimeError('the wrong plugins package was imported')\n")
    (tmp_path / "conf").mkdir()
    r = cli("mode=plugins", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "offload.park.cache_latents" in r.stdout
    r = cli("train.steps=1", "train.progress=false", "train.preflight=false", "offload=park",
            f"offload.park.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "wrong plugins package" not in r.stdout + r.stderr


def test_planning_commands_end_without_teardown_with_every_output_complete(tmp_path):
    """mode=plan/fit/plugins end with os._exit after flushing (runner/__main__.py:quick_exit): every file
    and line is there, and the status is the command's."""
    import json

    ok = cli("+preset=constrained", "mode=plan", f"output_dir={tmp_path / 'ok'}")
    assert ok.returncode == 0, ok.stderr[-3000:]
    plan = json.loads((tmp_path / "ok" / "plan.json").read_text())
    assert plan["fits"] and plan["step_time"]["seconds"] > 0
    assert json.loads((tmp_path / "ok" / "job_summary.json").read_text())["status"] == "ok"
    lines = ok.stdout.rstrip().splitlines()
    assert lines[-2].startswith("simulated in")  # the table's last line, then the log's last line:
    assert "plan written to" in lines[-1]  # the log handler was flushed before the exit
    over = cli("+preset=constrained", "mode=plan", "budget_gb=0.001", f"output_dir={tmp_path / 'over'}")
    assert over.returncode == 3 and "more than budget_gb=0.001" in over.stderr, over.stderr[-2000:]
    assert json.loads((tmp_path / "over" / "plan.json").read_text())["fits"] is False
    summary = json.loads((tmp_path / "over" / "job_summary.json").read_text())
    assert summary["exit_code"] == 3
    listed = cli("mode=plugins")
    assert listed.returncode == 0 and listed.stdout.rstrip().endswith("by its own norm")
