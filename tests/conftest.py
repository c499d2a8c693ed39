"""Shared fixtures. GPU tests are marked ``gpu`` and skip cleanly without CUDA."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download, ever
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# The slow tier by path: every test in these files (relative to tests/) is marked ``slow``, so
# ``make test`` (``-m "not slow"``) leaves them to ``make test-all``. They launch processes
# (``python -m runner``, pip) or train every preset; the torchrun files say so in their pytestmark.
# tests/test_tiers.py checks that each path exists and that every tests/ folder keeps a fast test.
SLOW_FILES = (
    "conf/test_any_edit_trainer.py",
    "conf/test_any_trainer.py",
    "plugins/park/test_cache.py",
    "runner/cli/test_adapters_cli.py",
    "runner/cli/test_bad_inputs.py",
    "runner/cli/test_cli.py",
    "runner/cli/test_sweep.py",
    "runner/dist/test_slurm.py",
    "runner/loss/test_masked_loss.py",
    "runner/optim/test_optimizer_runs.py",
    "runner/plan/test_comm_time.py",
    "runner/plan/test_dist_plan.py",
    "runner/test_entry_points.py",
    "runner/test_faults.py",
    "runner/test_hostmem.py",
    "test_packaging.py",
)
# Single slow tests of files that stay in the fast tier, by function (every parametrisation).
SLOW_TESTS = (
    "runner/compile/test_regional.py::test_compiled_blocks_train_like_eager",
    "runner/compile/test_regional.py::test_teardown_restores_each_blocks_forward",
)
TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        rel = os.path.relpath(str(item.path), TESTS).replace(os.sep, "/")
        if rel in SLOW_FILES or f"{rel}::{item.originalname}" in SLOW_TESTS:
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests: tiny ops on 2 shared cores run faster without
    OpenMP wake-up stalls, and CPU kernels become bitwise reproducible (the equality tests need it)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def no_hydra_job_left_over():
    """A test that runs ``hydra.main`` in-process leaves Hydra's job config set (Hydra never clears
    it in a process that then exits). runner/state/resume.py and runner/cli/launch.py read it to learn the
    running job's command line, so a later in-process run would inherit another test's overrides.
    Hydra also configures logging: its handlers write to the stream the test had (pytest's capture,
    closed afterwards), so later tests would log "--- Logging error ---" tracebacks; they go too."""
    import logging

    loggers = [logging.getLogger(), logging.getLogger("hydra"), logging.getLogger("runner")]
    before = {id(lg): list(lg.handlers) for lg in loggers}
    yield
    for lg in loggers:
        for h in lg.handlers[:]:
            if h not in before[id(lg)]:
                lg.removeHandler(h)
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().cfg = None
    GlobalHydra.instance().clear()
