"""Fit diffusion-model training into a memory budget by composing memory plugins around any trainer.

Public API for trainers and plugins:

* :class:`runner.trainer.Trainer`, :class:`runner.trainer.ModelSet`: the managed-mode protocol.
* :func:`runner.hosted.session`: hosted mode for a trainer that keeps its own loop.
* :class:`runner.plugin.Plugin`, :func:`runner.registry.register_plugin`: write a plugin.
"""
from runner.errors import UserError
from runner.trainer import ModelSet, Trainer, per_sample_rand, per_sample_randn

__all__ = ["ModelSet", "Trainer", "UserError", "per_sample_rand", "per_sample_randn"]
