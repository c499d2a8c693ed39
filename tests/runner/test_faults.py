"""Faults a run must survive without a traceback and without losing what it trained.

NaN/inf losses (skip or stop, never a NaN checkpoint, strict JSON summaries), a full or read-only
disk (real ENOSPC/EROFS in a private mount namespace, tests/faults.py), repeated Ctrl-C during a
save, leftovers of killed saves, and SIGKILL during checkpoint writes and pruning.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from faults import faults_supported, with_faults
from safetensors.torch import load_file

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.cli.launch import run_job
from runner.errors import Interrupted
from runner.guards.nonfinite import NonFiniteStop
from runner.loop import StopRequest
from runner.state.checkpoint import TrainState, remove_leftovers, save_checkpoint
from runner.trainer import ModelSet

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets"
COMMON = ["train.device=cpu", "train.progress=false", "train.preflight=false", "data.demo_size=4"]
FLAKY = ["trainer=custom", "trainer._target_=flaky_trainer.FlakyTrainer", "data.resolution=16"]


def strict_json(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def job(out: Path, *overrides: str) -> int:
    """One job as `python -m runner` runs it (run_job: summary, status, exit code); its exit code."""
    sys.path.insert(0, str(ASSETS))
    try:
        run_job(task, compose_config([f"output_dir={out}", *COMMON, *overrides]))
        return 0
    except SystemExit as e:
        return int(e.code)
    finally:
        sys.path.remove(str(ASSETS))


def summary(out: Path) -> dict:
    return strict_json((out / "job_summary.json").read_text())


def metrics(out: Path) -> list[dict]:
    return [strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / f"step-{step:08d}" / "trainable.safetensors")


# ---- non-finite ------------------------------------------------------------------------------------
def test_a_diverging_run_stops_with_its_own_status_and_saves_only_finite_weights(tmp_path, capsys):
    # The weight check off: the losses turn NaN (the blow-up itself stops step 1: tests/runner/guards/test_weights.py)
    code = job(tmp_path, "train.steps=8", "optimizer.lr=1e20", "train.max_weight_growth=0")
    err = capsys.readouterr().err
    assert code == 4, err
    s = summary(tmp_path)  # strict JSON: a NaN loss is null, not a bare NaN
    assert s["status"] == "nonfinite" and s["exit_code"] == 4
    assert "optimizer.lr=1e+20" in err and "stopped at step" in err and "Traceback" not in err
    rows = metrics(tmp_path)
    assert any(r["loss"] is None for r in rows) and rows[-1]["nonfinite_skips"] == 2
    saved = weights(tmp_path, s["steps_done"])
    assert all(bool(torch.isfinite(t).all()) for t in saved.values())


def test_a_transient_nan_skips_one_update_and_training_goes_on(tmp_path):
    code = job(tmp_path, *FLAKY, "+trainer.options.nan_positions=[4]", "train.steps=4", "train.batch_size=2",
               "train.save_every=1", "train.keep_saved=4")
    assert code == 0
    rows = metrics(tmp_path)
    assert [r["loss"] is None for r in rows] == [False, False, True, False]
    assert [r["nonfinite_skips"] for r in rows] == [0, 0, 1, 1]
    assert summary(tmp_path)["status"] == "ok" and summary(tmp_path)["nonfinite_skips"] == 1  # not silent: counted
    before, skipped, after = weights(tmp_path, 2), weights(tmp_path, 3), weights(tmp_path, 4)
    assert all(torch.equal(before[k], skipped[k]) for k in before)  # step 3's update was not applied
    assert not all(torch.equal(skipped[k], after[k]) for k in before)  # step 4's was


def test_on_nonfinite_stop_ends_at_the_first_bad_step_with_the_last_good_weights(tmp_path, capsys):
    clean, flaky = tmp_path / "clean", tmp_path / "flaky"
    assert job(clean, *FLAKY, "train.steps=2") == 0
    code = job(flaky, *FLAKY, "+trainer.options.nan_positions=[4]", "train.steps=4", "train.on_nonfinite=stop")
    err = capsys.readouterr().err
    assert code == 4 and "step 3" in err and "train.on_nonfinite=stop" in err
    good, kept = weights(clean, 2), weights(flaky, 2)
    assert all(torch.equal(good[k], kept[k]) for k in good)
    assert not (flaky / "checkpoints" / "step-00000003").exists()


def test_weights_holding_nan_are_never_saved(tmp_path):
    layer = torch.nn.Linear(2, 2)
    models = ModelSet({"net": layer}, trained={"net"})
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with torch.no_grad():
        layer.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteStop, match="net.weight"):
        save_checkpoint(tmp_path, TrainState(step=7), models, opt, None)
    assert not list(tmp_path.iterdir())  # no step dir, no temporary folder


# ---- signals and leftovers -------------------------------------------------------------------------
def test_a_second_signal_waits_for_the_save_and_a_third_forces_the_exit():
    with StopRequest() as stop:
        with stop.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # signal handlers run between bytecodes of the main thread
            assert stop.count == 2 and stop.signum == signal.SIGINT
            with pytest.raises(Interrupted) as e:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)
        assert e.value.exit_code == 130
    with StopRequest() as stop:  # outside a save the second signal stops at once
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        with pytest.raises(Interrupted, match="No checkpoint was saved"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)


def test_leftovers_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, live_pid = int(dead.stdout), os.getppid()
    for name in (f".tmp-step-00000004-{dead_pid}", f".prune-step-00000001-{dead_pid}", f".old-step-00000002-{dead_pid}",
                 f".tmp-step-00000005-{live_pid}", "step-00000003"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainable.safetensors").write_bytes(b"x" * 100)
    (tmp_path / f".latest-{dead_pid}").write_text("step-00000003\n")
    removed = remove_leftovers(tmp_path)
    assert len(removed) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".tmp-step-00000005-{live_pid}", "step-00000003"]


# ---- the disk: full, read-only (real kernel errors in a private mount namespace) ---------------------
needs_faults = pytest.mark.skipif(not faults_supported(), reason="user namespaces (unshare -Urm) not available")


def cli_with_faults(out: Path, *overrides: str, after: str = "", **faults) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "runner", f"output_dir={out}", *COMMON, *overrides]
    script = ["sh", "-c", f'"$@"; rc=$?; {after or "true"}; exit $rc', "sh", *cmd]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(with_faults(script, **faults), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@needs_faults
def test_a_full_disk_while_saving_is_one_message_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    r = cli_with_faults(out, "train.steps=2", small={ckpts: 2 * 2**20}, after=f"echo LEFT:; ls -A {ckpts}")
    assert r.returncode == 5, r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
    assert "the disk is full" in r.stderr and "It needs about" in r.stderr and str(ckpts) in r.stderr
    assert r.stdout.split("LEFT:")[-1].strip() == ""  # inside the namespace: no temporary folder keeps the disk full
    s = summary(out)
    assert s["status"] == "io_error" and s["exit_code"] == 5 and s["steps_done"] == 2


def test_a_file_size_limit_is_named_as_the_limit_not_a_full_disk(tmp_path):
    """`ulimit -f` (a real RLIMIT_FSIZE on the child; Python ignores SIGXFSZ, so the write gets EFBIG):
    the checkpoint save fails with one message that names the limit and how to raise it, not "free
    some space", and the run's summary is still written (it is smaller than the limit)."""
    import resource

    out = tmp_path / "run"
    limit = 2 * 2**20  # the tiny default's checkpoint is larger; its logs and summary are not

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, "-m", "runner", f"output_dir={out}", *COMMON, "train.steps=1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    assert r.returncode == 5, r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
    assert "the file grew past the size limit (ulimit -f)" in r.stderr and "at most 2.0 MiB" in r.stderr
    assert "Raise the limit" in r.stderr and "Free some space" not in r.stderr
    assert summary(out)["status"] == "io_error"


@needs_faults
def test_a_full_output_folder_still_ends_in_one_message(tmp_path):
    out = tmp_path / "tiny"  # too small for the checkpoint, and then for job_summary.json too
    r = cli_with_faults(out, "train.steps=2", small={out: 256 * 1024})
    assert r.returncode == 5, r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr and "the disk is full" in r.stderr


@needs_faults
def test_a_read_only_output_folder_is_one_message(tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    r = cli_with_faults(media / "run", "train.steps=1", read_only=[media])
    assert r.returncode == 5, r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
    assert "read-only" in r.stderr and str(media / "run") in r.stderr


@needs_faults
@pytest.mark.parametrize("sweep", [False, True])
def test_a_read_only_working_folder_is_one_message_before_hydra_writes(tmp_path, sweep):
    cmd = [sys.executable, "-m", "runner", *(["-m", "train.steps=1,2"] if sweep else ["train.steps=1"]), *COMMON]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    in_folder = ["sh", "-c", 'cd "$0" && exec "$@"', str(tmp_path), *cmd]  # cd after the mount: through it
    r = subprocess.run(with_faults(in_folder, read_only=[tmp_path]), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 5, r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
    assert "read-only" in r.stderr and ("hydra.sweep.dir" if sweep else "hydra.run.dir") in r.stderr


# ---- SIGKILL during checkpoint writes and pruning ----------------------------------------------------
def _run_until_killed_in(out: Path, prefix: str, overrides: list[str]) -> bool:
    """Start a (resuming) run and SIGKILL it the moment a ``prefix`` folder appears in its checkpoints;
    True when it was killed with that folder still on disk (a kill mid-write or mid-delete)."""
    ckpts = out / "checkpoints"
    resume = [f"train.resume={out}"] if (ckpts / "latest").is_file() else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "runner", f"output_dir={out}", *COMMON, *overrides, *resume],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while p.poll() is None:
            try:
                names = os.listdir(ckpts)
            except FileNotFoundError:
                continue
            if any(n.startswith(prefix) for n in names):
                p.kill()
                p.wait()
                return any(n.startswith(prefix) for n in os.listdir(ckpts))
        return False
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_sigkill_during_saves_and_pruning_then_resume_gives_the_same_loss_curve(tmp_path):
    steps = ["train.steps=10", "train.save_every=1", "train.keep_saved=2"]
    assert job(tmp_path / "clean", *steps) == 0
    clean = [r["loss"] for r in metrics(tmp_path / "clean")]
    out = tmp_path / "killed"
    caught = {".tmp-step-": 0, ".prune-step-": 0}
    for _ in range(12):
        prefix = min(caught, key=caught.get)
        caught[prefix] += _run_until_killed_in(out, prefix, steps)
        if min(caught.values()) >= 2:
            break
    assert min(caught.values()) >= 2, caught  # killed twice mid-write and twice mid-prune, leftovers on disk
    assert job(out, *steps, f"train.resume={out}") == 0
    by_step: dict[int, float] = {}
    for r in metrics(out):
        by_step[r["step"]] = r["loss"]  # a step re-run after a kill replaces the row written before the kill
    assert [by_step[s] for s in range(1, 11)] == clean
    left = sorted(os.listdir(out / "checkpoints"))
    assert left == ["latest", "step-00000009", "step-00000010"], left


@needs_faults
def test_a_full_cache_disk_is_one_message(tmp_path):
    cache = tmp_path / "cache"
    r = cli_with_faults(tmp_path / "run", "train.steps=1", "offload=park", f"offload.park.cache_dir={cache}",
                        small={cache: 48 * 1024})
    assert r.returncode == 5, r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
    assert "Writing an encoder cache entry failed: the disk is full" in r.stderr and str(cache) in r.stderr


def test_a_skipped_step_names_its_samples_and_the_summary_warns(tmp_path, caplog, capsys):
    """Training goes on past a non-finite step, and says so: the log names the step's image files,
    job_summary.json counts the skipped steps, the final summary warns."""
    from PIL import Image

    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        Image.new("RGB", (16, 16), (60 * i, 0, 0)).save(data / f"img{i}.png")
        (data / f"img{i}.txt").write_text(f"image {i}")
    out = tmp_path / "run"
    code = job(out, *FLAKY, "+trainer.options.nan_positions=[4]", "train.steps=4", "train.batch_size=2",
               f"data.path={data}")
    assert code == 0
    assert summary(out)["nonfinite_skips"] == 1
    warned = [r.getMessage() for r in caplog.records if "was skipped; its samples" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("step 3 was skipped")
    named = warned[0].split("its samples: ")[1].split(", ")
    assert len(named) == 2 and all(Path(n).parent == data and Path(n).suffix == ".png" for n in named)
    assert "warning: 1 step(s) skipped on a non-finite loss or gradient" in capsys.readouterr().out
