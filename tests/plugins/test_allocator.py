"""allocator=default: PYTORCH_CUDA_ALLOC_CONF composition and merging, CPU behaviour, validation."""
from __future__ import annotations

import dataclasses
import functools
import logging
import os

import pytest
import torch
from hydra.core.config_store import ConfigStore

from runner.parts import idle_parts
from runner.cli.compose import compose_config
from runner.context import RunContext
from runner.errors import UserError
from runner.plugin import PluginSchedule
from runner.plugins.allocator import (
    ENV,
    ENV_NEW,
    AllocatorConfig,
    DefaultAllocator,
    allocator_conf_string,
    apply_allocator_settings,
    check_config,
    merge_alloc_conf,
)
from runner.resolved import GiB, ResolvedRun, resolve


@functools.cache
def _base_run() -> ResolvedRun:
    return resolve(compose_config(["train.device=cpu"]))


def _run(budget_gb=None) -> ResolvedRun:
    """A CPU run with ``budget_gb`` (None: no budget)."""
    return dataclasses.replace(_base_run(), budget_bytes=None if budget_gb is None else int(budget_gb * GiB))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Every test starts without either variable; monkeypatch restores the real environment."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(ENV_NEW, raising=False)
    # No test may touch the real TF32 / CUDA state: pretend there is no CUDA unless a test says so.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, "expandable_segments:True"),
        (dict(expandable_segments=False), ""),
        (dict(max_split_size_mb=512), "expandable_segments:True,max_split_size_mb:512"),
        (
            dict(expandable_segments=False, max_split_size_mb=128, garbage_collection_threshold=0.8),
            "max_split_size_mb:128,garbage_collection_threshold:0.8",
        ),
    ],
)
def test_conf_string(kwargs, expected):
    assert allocator_conf_string(AllocatorConfig(**kwargs)) == expected


def test_merge_user_wins_key_by_key():
    merged, overridden = merge_alloc_conf(
        "expandable_segments:True,max_split_size_mb:512", "max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4]"
    )
    assert merged == "max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4],expandable_segments:True"
    assert overridden == ["max_split_size_mb"]
    assert merge_alloc_conf("expandable_segments:True", "") == ("expandable_segments:True", [])
    assert merge_alloc_conf("", "backend:cudaMallocAsync") == ("backend:cudaMallocAsync", [])


def test_env_var_set_when_cuda_not_initialised(caplog):
    with caplog.at_level(logging.INFO, logger="runner"):
        result = apply_allocator_settings(AllocatorConfig(max_split_size_mb=256), None, "cpu")
    assert os.environ[ENV] == "expandable_segments:True,max_split_size_mb:256"
    assert result.alloc_conf == os.environ[ENV] and result.took_effect and not result.cuda
    # One clear line on CPU, naming the value.
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("allocator:")]
    assert lines == [
        "allocator: no CUDA device; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,max_split_size_mb:256, "
        "memory cap and TF32 are no-ops on CPU"
    ]


def test_user_env_is_preserved_and_logged(monkeypatch, caplog):
    monkeypatch.setenv(ENV, "expandable_segments:False,max_split_size_mb:64")
    with caplog.at_level(logging.INFO, logger="runner"):
        result = apply_allocator_settings(AllocatorConfig(garbage_collection_threshold=0.6), None, "cpu")
    assert os.environ[ENV] == "expandable_segments:False,max_split_size_mb:64,garbage_collection_threshold:0.6"
    assert result.user_keys == ["expandable_segments", "max_split_size_mb"]
    assert "sets expandable_segments:False, which wins over allocator.default.expandable_segments" in caplog.text


def test_new_env_name_is_merged_in_place(monkeypatch):
    monkeypatch.setenv(ENV_NEW, "max_split_size_mb:64")
    result = apply_allocator_settings(AllocatorConfig(), None, "cpu")
    assert result.env_var == ENV_NEW
    assert os.environ[ENV_NEW] == "max_split_size_mb:64,expandable_segments:True"
    assert ENV not in os.environ


def test_warns_when_cuda_already_initialised(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with caplog.at_level(logging.WARNING, logger="runner"):
        result = apply_allocator_settings(AllocatorConfig(), None, "cpu")
    assert not result.took_effect
    assert "CUDA is already initialised" in caplog.text
    assert "expandable_segments:True" in caplog.text and "cannot take effect" in caplog.text


def test_nothing_to_set_leaves_env_alone():
    result = apply_allocator_settings(AllocatorConfig(expandable_segments=False), None, "cpu")
    assert ENV not in os.environ and result.alloc_conf == ""


@pytest.mark.parametrize(
    "kwargs, budget, match",
    [
        (dict(garbage_collection_threshold=1.0), None,
         r"allocator.default.garbage_collection_threshold=1.0 is not valid"),
        (dict(garbage_collection_threshold=0.0), None, r"allocator.default.garbage_collection_threshold"),
        (dict(max_split_size_mb=8), None,
         r"allocator.default.max_split_size_mb=8 is not valid: PyTorch needs at least 20"),
        (dict(cap_to_budget=True), None, r"allocator.default.cap_to_budget=true needs budget_gb"),
    ],
)
def test_validation(kwargs, budget, match):
    with pytest.raises(UserError, match=match):
        check_config(AllocatorConfig(**kwargs), budget)  # the node's checks and the run's budget, as a run makes them
    with pytest.raises(UserError, match=match):
        apply_allocator_settings(AllocatorConfig(**kwargs), budget, "cpu")


def test_the_plugin_checks_the_cap_against_the_runs_budget():
    with pytest.raises(UserError, match=r"allocator.default.cap_to_budget=true needs budget_gb"):
        DefaultAllocator(AllocatorConfig(cap_to_budget=True), _run(None)).validate()


def test_valid_cap_config_passes_validation():
    DefaultAllocator(AllocatorConfig(cap_to_budget=True), _run(12)).validate()


def test_plugin_configure_process_on_cpu(caplog):
    from omegaconf import OmegaConf

    run = _run(12.0)
    plugin = DefaultAllocator(OmegaConf.structured(AllocatorConfig(cap_to_budget=True)), run)
    cfg = OmegaConf.create({"budget_gb": 12.0})
    ctx = RunContext(run=run, schedule=PluginSchedule.build([plugin]), cfg=cfg, **idle_parts(run))
    assert [p.key for p in ctx.schedule.by_phase["configure_process"]] == ["allocator/default"]
    with caplog.at_level(logging.INFO, logger="runner"):
        ctx.run_phase("configure_process")
    assert plugin.result.memory_fraction is None  # the cap is a no-op on CPU
    assert ctx.notes["allocator conf"] == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert "no CUDA device" in caplog.text


def test_registered_schema():
    import runner.plugins  # noqa: F401

    repo = ConfigStore.instance().repo["allocator"]
    assert repo["default.yaml"].node.expandable_segments is True
    assert "none.yaml" in repo
