"""Fit diffusion-model training into a memory budget by composing memory plugins around any trainer.

Public API for trainers and plugins:

* :class:`runner.trainer.Trainer`, :class:`runner.trainer.ModelSet`: the managed-mode protocol.
* :func:`runner.hosted.session`: hosted mode for a trainer that keeps its own loop.
* :class:`runner.plugin.Plugin`, :func:`runner.registry.register_plugin`: write a plugin.

The names below are imported on first use (PEP 562), not with the package: ``runner.trainer``
imports torch, and ``python -m runner --help`` or a config error must answer without it.
"""
from __future__ import annotations

from typing import Any

from runner.errors import UserError

__all__ = ["ModelSet", "Trainer", "UserError", "__version__", "per_sample_rand", "per_sample_randn"]

_FROM_TRAINER = ("ModelSet", "Trainer", "per_sample_rand", "per_sample_randn")


def __getattr__(name: str) -> Any:
    if name in _FROM_TRAINER:
        from runner import trainer

        return getattr(trainer, name)
    if name == "__version__":
        from runner.cli.version import runner_version

        return runner_version()
    raise AttributeError(f"module 'runner' has no attribute {name!r}")
