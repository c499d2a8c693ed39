"""The ``none`` option of every plugin kind: a disabled feature is a no-op plugin.

Having a real (empty) plugin rather than a missing one keeps the runner free of special cases:
every kind always has exactly one plugin, the schedule just leaves the empty ones out of every
phase (they implement none), and ``kind=none`` on the command line is an ordinary choice.
``allocator=none`` leaves the allocator, TF32 and PYTORCH_CUDA_ALLOC_CONF exactly as the
environment has them; the default allocator option is ``allocator=default`` (plugins/allocator.py).
"""
from __future__ import annotations

from runner.plugin import Plugin, PluginConfig
from runner.registry import register_plugin


@register_plugin
class NoAllocator(Plugin):
    kind = "allocator"
    name = "none"
    Config = PluginConfig
    description = "leave allocator settings, TF32 and PYTORCH_CUDA_ALLOC_CONF as the environment has them"


@register_plugin
class NoQuantization(Plugin):
    kind = "quantization"
    name = "none"
    Config = PluginConfig
    description = "no quantization: weights keep model.dtype"


@register_plugin
class NoOffload(Plugin):
    kind = "offload"
    name = "none"
    Config = PluginConfig
    description = "no offload: every module lives on the training device"


@register_plugin
class NoCheckpoint(Plugin):
    kind = "checkpoint"
    name = "none"
    Config = PluginConfig
    description = "no activation checkpointing: keep every activation for backward (fastest, most memory)"


@register_plugin
class NoTiling(Plugin):
    kind = "tiling"
    name = "none"
    Config = PluginConfig
    description = "no tiling: the VAE encodes whole images"
