"""Work beside the plan's main line (runner/plan/beside.py): the encoders' shapes on a second core.

A forked child computes them while setup runs. These tests check the child's result is what the
in-place call gives, that a failing child leaves the parent to redo the work (and to raise what
the trainer raises), and that no child is left behind.
"""
from __future__ import annotations

import os
from typing import Any

import pytest

import runner.plan.batch as batch
from runner.plan import plan_step
from runner.plan.beside import Beside, can_fork
from runner.validate import compose_config, validate

needs_fork = pytest.mark.skipif(not can_fork(), reason="no fork here (one core, no os.fork, or other threads alive)")


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


@needs_fork
def test_the_work_runs_in_a_child_and_its_json_result_comes_back():
    job = Beside(lambda: {"pid": os.getpid(), "shape": [2, 77, 768]}, lambda r: r, lambda d: d)
    assert job.forked
    pid = job._pid
    result = job.result()
    assert result["pid"] == pid != os.getpid() and result["shape"] == [2, 77, 768]
    assert _reaped(pid)


@needs_fork
def test_a_failing_child_leaves_the_parent_to_redo_the_work():
    parent = os.getpid()

    def work() -> int:
        if os.getpid() != parent:
            raise RuntimeError("only in the child")
        return 7

    job = Beside(work, lambda r: r, lambda d: d)
    assert job.forked and job.result() == 7  # redo defaults to work, which succeeds here


def test_without_a_fork_the_work_is_done_at_once_in_place():
    calls = []
    job = Beside(lambda: calls.append(os.getpid()) or len(calls), lambda r: r, lambda d: d, fork=False)
    assert calls == [os.getpid()] and not job.forked
    assert job.result() == 1 and calls == [os.getpid()]


@needs_fork
def test_close_stops_and_reaps_a_child_whose_result_is_not_wanted():
    import time

    job = Beside(lambda: time.sleep(60), lambda r: r, lambda d: d)
    pid, t0 = job._pid, time.monotonic()
    job.close()
    assert _reaped(pid) and time.monotonic() - t0 < 30  # stopped, not waited for
    job.close()  # twice is harmless


# ---- in the planner ---------------------------------------------------------------------------------
# constrained parks every module: the step reads latents and embeddings from the cache and needs no
# encoder shapes; with cache_text=false the text is encoded on the device and the cached latents
# arrive with the shapes the child computed.
PARTLY_CACHED = ["offload.park.cache_text=false"]


def _plan(*overrides: str) -> dict[str, Any]:
    cfg = compose_config(["+preset=constrained", *overrides])
    validate(cfg)
    d = plan_step(cfg).to_dict()
    d.pop("seconds")
    d["notes"].pop("timings_s")
    return d


@pytest.fixture(scope="module", autouse=True)
def _warm() -> None:
    # The first plan in a process imports bitsandbytes, whose log record (kept by pytest's log
    # capture, with its traceback) holds a few host tensors of that plan alive: compare later ones.
    _plan()


@needs_fork
@pytest.mark.parametrize("overrides", [[], PARTLY_CACHED], ids=["all cached", "latents cached"])
def test_a_plan_with_the_shapes_from_a_child_equals_the_in_place_plan(monkeypatch, overrides):
    in_place = _plan(*overrides)  # tiny models: below the threshold, computed in place
    forks: list[bool] = []
    start = batch.start_encode_part_shapes

    def recording(*args: Any, **kwargs: Any) -> Beside:
        job = start(*args, **kwargs)
        forks.append(job.forked)
        return job

    monkeypatch.setattr(batch, "FORK_ABOVE_ELEMENTS", 0)
    monkeypatch.setattr("runner.plan.simulate.start_encode_part_shapes", recording)
    assert _plan(*overrides) == in_place and forks == [True]


@needs_fork
def test_a_plan_whose_child_fails_redoes_the_shapes_and_still_equals_the_in_place_plan(monkeypatch):
    in_place = _plan(*PARTLY_CACHED)
    parent, real = os.getpid(), batch.encode_part_shapes
    calls: list[int] = []

    def fails_in_the_child(*args: Any) -> Any:
        if os.getpid() != parent:
            os._exit(3)  # e.g. killed: no result on the pipe
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(batch, "FORK_ABOVE_ELEMENTS", 0)
    monkeypatch.setattr(batch, "encode_part_shapes", fails_in_the_child)
    monkeypatch.setattr("runner.plan.simulate.encode_part_shapes", fails_in_the_child)
    assert _plan(*PARTLY_CACHED) == in_place and calls == [1]  # redone once, in the parent


@needs_fork
def test_an_error_in_the_encoders_is_raised_by_the_plan_as_in_place(monkeypatch):
    def broken(*args: Any) -> Any:
        raise ValueError("encoder exploded")

    monkeypatch.setattr(batch, "encode_part_shapes", broken)
    monkeypatch.setattr("runner.plan.simulate.encode_part_shapes", broken)
    with pytest.raises(ValueError, match="encoder exploded"):  # in place (tiny models)
        _plan(*PARTLY_CACHED)
    monkeypatch.setattr(batch, "FORK_ABOVE_ELEMENTS", 0)
    with pytest.raises(ValueError, match="encoder exploded"):  # in the child, then redone in the parent
        _plan(*PARTLY_CACHED)
