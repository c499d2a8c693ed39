"""Host memory helpers (runner/hostmem.py): glibc's thresholds for CPU runs, the paused collector."""
from __future__ import annotations

import ctypes.util
import gc
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
