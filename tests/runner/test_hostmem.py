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
from runner.config.checks import validate
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
    from runner.config.checks import check_config
    from runner.errors import UserError

    with pytest.raises(UserError, match=r"train.cpu_threads=0 is not valid: it must be a number > 0"):
        check_config(compose_config(["train.cpu_threads=0"]))


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_command_sets_a_passive_openmp_wait_before_torch_loads_unless_the_user_chose(given, expected, tmp_path):
    """`python -m runner` sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP (a user's own value
    stays): the run's CPU line says which policy its threads use."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update({"OMP_NUM_THREADS": "1", **({"OMP_WAIT_POLICY": given} if given else {})})
    r = subprocess.run([sys.executable, "-m", "runner", "train.steps=1", "train.preflight=false",
                        "export.enabled=false", f"output_dir={tmp_path}"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(x for x in (r.stdout + r.stderr).splitlines() if "CPU run: 1 torch thread" in x)
    assert line.endswith(f"OpenMP wait policy {expected}"), line
