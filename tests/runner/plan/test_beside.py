"""Work beside the plan's main line (runner/plan/second_core.py): the encoders' shapes on a second core.

A forked child computes them while setup runs. These tests check the child's result is what the
in-place call gives, that a failing child leaves the parent to redo the work (and to raise what
the trainer raises), and that no child is left behind.

The runner forks only in a process without other threads, and a pytest process has leftover
threads from earlier tests. So the planner cases run in a fresh interpreter (one subprocess for
all of them, ``_SCENARIOS``), and the small ``Beside`` cases allow the fork here: their children
only compute, write a pipe and exit, and take no lock another thread could hold.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

import runner.plan.second_core as beside
from runner.plan.second_core import Beside, usable_cores

needs_fork = pytest.mark.skipif(not hasattr(os, "fork") or usable_cores() < 2, reason="no os.fork or one core")


@pytest.fixture
def fork_allowed(monkeypatch):
    monkeypatch.setattr(beside, "can_fork", lambda: True)


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


@needs_fork
def test_the_work_runs_in_a_child_and_its_json_result_comes_back(fork_allowed):
    job = Beside(lambda: {"pid": os.getpid(), "shape": [2, 77, 768]}, lambda r: r, lambda d: d)
    assert job.forked
    pid = job._pid
    result = job.result()
    assert result["pid"] == pid != os.getpid() and result["shape"] == [2, 77, 768]
    assert _reaped(pid)


@needs_fork
def test_a_failing_child_leaves_the_parent_to_redo_the_work(fork_allowed):
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
def test_close_stops_and_reaps_a_child_whose_result_is_not_wanted(fork_allowed):
    job = Beside(lambda: time.sleep(60), lambda r: r, lambda d: d)
    pid, t0 = job._pid, time.monotonic()
    job.close()
    assert _reaped(pid) and time.monotonic() - t0 < 30  # stopped, not waited for
    job.close()  # twice is harmless


# ---- in the planner, in a fresh interpreter ---------------------------------------------------------
# constrained parks every module: the step reads latents and embeddings from the cache and needs no
# encoder shapes; with cache_text=false the text is encoded on the device and the cached latents
# arrive with the shapes the child computed.
_SCENARIOS = r'''
import json, os, sys
import runner.plan.batch as batch
import runner.plan.simulate as simulate
from runner.plan import plan_step
from runner.cli.compose import compose_config
from runner.checks import validate

PARTLY = ["offload.park.cache_text=false"]
out = {"can_fork": __import__("runner.plan.second_core", fromlist=["x"]).can_fork()}

def plan(*overrides):
    cfg = compose_config(["+preset=constrained", *overrides])
    validate(cfg)
    d = plan_step(cfg).to_dict()
    d.pop("seconds")
    d["notes"].pop("timings_s")
    return d

forks = []
start = batch.start_encode_part_shapes
def recording(*a, **k):
    job = start(*a, **k)
    forks.append(job.forked)
    return job
simulate.start_encode_part_shapes = recording
real, parent = batch.encode_part_shapes, os.getpid()

def set_encode(fn):
    batch.encode_part_shapes = simulate.encode_part_shapes = fn

for name, overrides in (("all_cached", []), ("latents_cached", PARTLY)):
    batch.FORK_ABOVE_ELEMENTS = 10 ** 15
    in_place = plan(*overrides)
    batch.FORK_ABOVE_ELEMENTS = 0
    del forks[:]
    out[name] = {"equal": plan(*overrides) == in_place, "forks": list(forks)}

calls = []
def fails_in_the_child(*a):
    if os.getpid() != parent:
        os._exit(3)
    calls.append(1)
    return real(*a)
batch.FORK_ABOVE_ELEMENTS = 10 ** 15
in_place = plan(*PARTLY)
batch.FORK_ABOVE_ELEMENTS = 0
set_encode(fails_in_the_child)
out["child_fails"] = {"equal": plan(*PARTLY) == in_place, "redone": len(calls)}

def broken(*a):
    raise ValueError("encoder exploded")
set_encode(broken)
for name, threshold in (("broken_in_place", 10 ** 15), ("broken_in_child", 0)):
    batch.FORK_ABOVE_ELEMENTS = threshold
    try:
        plan(*PARTLY)
        out[name] = "no error"
    except ValueError as e:
        out[name] = str(e)
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def scenarios() -> dict[str, Any]:
    if not hasattr(os, "fork") or usable_cores() < 2:
        pytest.skip("no os.fork or one core")
    done = subprocess.run([sys.executable, "-c", _SCENARIOS], capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["can_fork"], "a fresh interpreter should be allowed to fork"
    return out


@pytest.mark.parametrize("case", ["all_cached", "latents_cached"])
def test_a_plan_with_the_shapes_from_a_child_equals_the_in_place_plan(scenarios, case):
    assert scenarios[case] == {"equal": True, "forks": [True]}


def test_a_plan_whose_child_fails_redoes_the_shapes_once_and_still_equals_the_in_place_plan(scenarios):
    assert scenarios["child_fails"] == {"equal": True, "redone": 1}


def test_an_error_in_the_encoders_is_raised_by_the_plan_in_place_and_from_a_failed_child(scenarios):
    assert scenarios["broken_in_place"] == scenarios["broken_in_child"] == "encoder exploded"
