"""Shared fixtures. GPU tests are marked ``gpu`` and skip cleanly without CUDA."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download, ever
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


TESTS = os.path.dirname(os.path.abspath(__file__))

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # `make test` runs pytest-xdist workers side by side: each takes its share of the cores, for
    # in-process tests and the runs it starts, instead of every worker spinning on all of them.
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    torch.set_num_threads(min(torch.get_num_threads(), _share))


def _slow_list() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """tests/slow_tests.txt: the slow tier by path, a file (every test in it) or ``file::function``
    (every parametrisation), relative to tests/. ``make test`` (``-m "not slow"``) leaves them to
    ``make test-all``; tests/test_tiers.py checks each entry exists and every folder keeps a fast test."""
    with open(os.path.join(TESTS, "slow_tests.txt")) as f:
        entries = [line.split("#")[0].strip() for line in f]
    entries = [e for e in entries if e]
    return tuple(e for e in entries if "::" not in e), tuple(e for e in entries if "::" in e)


SLOW_FILES, SLOW_TESTS = _slow_list()


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
