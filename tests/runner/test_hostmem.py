"""Host memory helpers (runner/hostmem.py): glibc's thresholds for CPU runs, the paused collector."""
from __future__ import annotations

import ctypes.util
import gc
import os
import subprocess
import sys

import pytest
import torch

from runner.cli.compose import compose_config
from runner.checks import validate
from runner.hostmem import collector_paused, keep_freed_host_memory
from runner.resolved import resolve


def test_the_collector_is_paused_inside_and_restored_after():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        gc.collect()  # an explicit collection still runs
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError
    assert gc.isenabled()


def test_importing_hostmem_loads_no_torch():
    """The command line pauses the collector before torch loads: the module must not import it."""
    code = "import sys, runner.hostmem; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _has_mallopt() -> bool:
    try:
        return hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallopt")
    except (OSError, TypeError):
        return False


@pytest.mark.skipif(not _has_mallopt(), reason="not glibc: nothing to configure")
def test_cpu_runs_keep_freed_host_memory_and_simulated_ones_do_not():
    cfg = compose_config(["train.device=cpu"])
    validate(cfg)
    assert keep_freed_host_memory(resolve(cfg)) is True
    assert keep_freed_host_memory(resolve(cfg, device=torch.device("meta"))) is False


def test_a_cpu_run_takes_the_cores_other_processes_leave(monkeypatch):
    """train.cpu_threads=None: the free cores (load average), at least one, never more than the process
    had; a set value is taken as it is; a run whose device is not the CPU changes nothing."""
    import os

    import torch

    from runner import hostmem

    before = torch.get_num_threads()
    cpu = type("Run", (), {"device": torch.device("cpu"), "simulate": False})()
    meta = type("Run", (), {"device": torch.device("meta"), "simulate": True})()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    try:
        torch.set_num_threads(4)
        monkeypatch.setattr(os, "getloadavg", lambda: (4.6, 0.0, 0.0))  # a busy machine
        assert hostmem.cpu_threads(cpu, None) == 1 == torch.get_num_threads()
        torch.set_num_threads(4)
        monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 0.0, 0.0))
        assert hostmem.cpu_threads(cpu, None) == 3 == torch.get_num_threads()
        torch.set_num_threads(2)  # OMP_NUM_THREADS=2, or a caller's own: auto never raises it
        monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        assert hostmem.cpu_threads(cpu, None) == 2
        assert hostmem.cpu_threads(cpu, 3) == 3 == torch.get_num_threads()  # train.cpu_threads=3
        assert hostmem.cpu_threads(meta, None) is None and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_cpu_threads_must_be_positive():
    import pytest

    from runner.cli.compose import compose_config
    from runner.checks import check_config
    from runner.errors import UserError

    with pytest.raises(UserError, match=r"train.cpu_threads=0 is not valid: it must be a number > 0"):
        check_config(compose_config(["train.cpu_threads=0"]))


@pytest.mark.parametrize("load, given, expected", [(1.6, None, "PASSIVE"), (0.2, None, None),
                                                    (1.6, "ACTIVE", "ACTIVE"), (0.2, "PASSIVE", "PASSIVE")])
def test_openmp_threads_sleep_when_the_cores_are_busy_at_the_start(monkeypatch, load, given, expected):
    """On 2 cores at load 1.6 (one core busy) waiting threads sleep; at load 0.2 libgomp's default
    stays (spinning is faster on an idle machine); a policy the user set is never changed."""
    from runner import hostmem

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    if given:
        monkeypatch.setenv("OMP_WAIT_POLICY", given)
    assert hostmem.passive_openmp() == expected == os.environ.get("OMP_WAIT_POLICY")


def test_the_command_decides_the_wait_policy_before_torch_loads_and_says_it(tmp_path):
    """`python -m runner` decides before torch loads OpenMP (a user's value stays), and the run's CPU
    line says the policy its threads use."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"}
    r = subprocess.run([sys.executable, "-m", "runner", "train.steps=1", "train.preflight=false",
                        "export.enabled=false", f"output_dir={tmp_path}"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(x for x in (r.stdout + r.stderr).splitlines() if "CPU run: 1 torch thread" in x)
    assert line.endswith("OpenMP wait policy ACTIVE"), line
    code = "import sys, runner.__main__; print('torch' in sys.modules)"
    probe = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert probe.stdout.strip() == "False", probe.stderr[-2000:]  # the policy is set before torch is imported
