"""The command line as a user meets it: help, --cfg, mode=plugins, errors without tracebacks, -m."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_help_lists_the_groups():
    r = cli("--help")
    assert r.returncode == 0, r.stderr
    for group in ("allocator", "checkpoint", "offload", "quantization", "tiling", "trainer", "preset"):
        assert group in r.stdout, group
    # Issue 29: how to start N machines, by hand and on SLURM (the launcher's keys exist: conf/hydra/launcher/slurm.yaml)
    assert "torchrun --nnodes=N --nproc_per_node=8 --rdzv_backend=c10d" in r.stdout
    assert "hydra/launcher=slurm hydra.launcher.nodes=N hydra.launcher.gpus_per_node=8" in r.stdout


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
    assert [j.name for j in jobs] == ["0_preset=sdxl_24gb", "1_preset=constrained"]  # the swept key only
    assert all(len((j / "metrics.jsonl").read_text().splitlines()) == 2 for j in jobs)
    # Without a terminal: plain progress lines, no tqdm redraws; each job's __main__.log (Hydra's job
    # log) has them and the final summary; loss.png per job, sweep.png for the sweep.
    assert "\r" not in r.stdout + r.stderr
    assert r.stdout.count("step 1/2  loss ") == 2 and r.stdout.count("step 2/2  loss ") == 2
    for j in jobs:
        log = (j / "__main__.log").read_text()
        assert "step 1/2  loss " in log and "step 2/2  loss " in log and "summary:\nsteps: 2" in log
        assert (j / "loss.png").is_file()
    assert (tmp_path / "sweep.png").is_file() and (tmp_path / "sweep_summary.csv").is_file()


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


# ---- the fast path: no heavy import, no output directory before validation passes ---------------------
HEAVY = ("torch", "diffusers", "transformers", "accelerate", "bitsandbytes")
PROBE = ("import atexit, sys\n"
         "atexit.register(lambda: print('HEAVY:' + ','.join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr))\n"
         "sys.argv = ['runner', *{args!r}]\n"
         "from runner.__main__ import main\n"
         "main()\n")


def probe(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``python -m runner *args`` in ``tmp_path``, and which heavy modules were loaded when it exited."""
    code = PROBE.format(heavy=HEAVY, args=list(args))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("HEAVY:")][-1]
    return r, [m for m in line[len("HEAVY:"):].split(",") if m]


@pytest.mark.parametrize("args, code, needle", [
    (["--help"], 0, "offload"),
    (["--version"], 0, "diffusion-memory-runner"),
    (["mode=plugins"], 0, "offload.park.cache_latents"),
    (["+preset=constrained", "--cfg", "job"], 0, "budget_gb: 12"),
    (["train.stepz=3"], 2, "Did you mean 'steps'"),
    (["train.steps=0"], 2, "train.steps=0"),
    (["offload=park", "offload.park.encode_batch_size=0"], 2, "offload.park.encode_batch_size=0"),
    (["checkpoint=blocks", "checkpoint.blocks.mode=every_n", "checkpoint.blocks.every_n=0"], 2, "every_n=0"),
    (["quantization=nf4", "quantization.nf4.compute_dtype=float64"], 2, "quantization.nf4.compute_dtype"),
    (["optimizer=adamw", "optimizer.betas=[0.9]"], 2, "optimizer.betas"),
    (["data.path=/no/such/folder"], 2, "/no/such/folder"),
    (["-m", "train.steps=1,0"], 2, "train.steps=0"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_help_version_listing_and_config_errors_import_nothing_heavy_and_create_no_folder(tmp_path, args, code, needle):
    r, heavy = probe(tmp_path, *args)
    assert r.returncode == code, r.stderr[-2000:]
    assert needle in (r.stdout if code == 0 else r.stderr)
    assert "Traceback" not in r.stderr
    assert heavy == [], f"{' '.join(args)} imported {heavy} before answering"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "no output (or Hydra) directory may be created"


def test_a_device_dependent_error_still_comes_before_any_folder(tmp_path):
    """optimizer=paged_adamw8bit needs CUDA: knowing that needs torch, but nothing is created."""
    r, heavy = probe(tmp_path, "optimizer=paged_adamw8bit", "train.device=cpu")
    assert r.returncode == 2 and "needs CUDA" in r.stderr, r.stderr[-2000:]
    assert "torch" in heavy  # the second stage of validation asked torch
    assert list(tmp_path.iterdir()) == []


def test_version_is_the_package_metadata_version():
    from importlib.metadata import version

    expected = f"runner (diffusion-memory-runner) {version('diffusion-memory-runner')}"
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == expected
    script = Path(sys.executable).parent / "runner"  # the console script pip installs
    if script.exists():
        r = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == expected


@pytest.mark.parametrize("overrides", [[], ["+preset=constrained", "offload.park.cache_text=false"]], ids=["defaults", "preset"])
def test_fast_help_prints_exactly_what_hydras_help_prints(overrides, capsys, monkeypatch):
    """runner/cli/help.py lists the groups itself (Hydra's own listing is most of --help's time)."""
    import hydra

    from runner.cli.help import format_help
    from runner.config import load_all
    from runner.files import conf_dir
    load_all()
    monkeypatch.setattr(sys, "argv", ["runner", "--help", *overrides])
    with pytest.raises(SystemExit):
        hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(lambda cfg: None)()
    assert format_help(overrides) + "\n" == capsys.readouterr().out


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
    assert lines[-3].startswith("simulated in")  # the table's last line, then the log's last lines:
    assert "plan written to" in lines[-2] and "plan.png" in lines[-1]  # the log handler was flushed before the exit
    over = cli("+preset=constrained", "mode=plan", "budget_gb=0.001", f"output_dir={tmp_path / 'over'}")
    assert over.returncode == 3 and "more than budget_gb=0.001" in over.stderr, over.stderr[-2000:]
    assert json.loads((tmp_path / "over" / "plan.json").read_text())["fits"] is False
    summary = json.loads((tmp_path / "over" / "job_summary.json").read_text())
    assert summary["exit_code"] == 3
    listed = cli("mode=plugins")
    assert listed.returncode == 0 and listed.stdout.rstrip().endswith("by its own norm")


def test_a_run_says_each_plugin_line_once(tmp_path):
    """The preflight applies the run's plugins to its simulated step, and the run applies them again:
    the plugins' INFO lines ("park: ...", "stream: ...", "checkpoint: ...") come once, from the run."""
    import collections

    r = cli("+preset=sdxl_24gb", "model.size=tiny", "train.steps=1", "offload=[park,stream]",
            f"output_dir={tmp_path}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line.split("] - ", 1)[1] for line in (r.stdout + r.stderr).splitlines() if "[runner][INFO] - " in line]
    plugin_lines = [line for line in lines if line.startswith(("park:", "stream:", "checkpoint:"))]
    assert {line.split(":")[0] for line in plugin_lines} == {"park", "stream", "checkpoint"}, lines
    twice = [line for line, n in collections.Counter(lines).items() if n > 1]
    assert not twice, twice
