"""Diffusers classes by name, imported with transformers' logging at error level."""
from __future__ import annotations

import functools


@functools.cache
def pipeline_class(name: str) -> type:
    """``diffusers.<name>`` (a pipeline class), imported with transformers' logging at error level.

    Why: importing a pipeline makes transformers import the image processors it ships with, and
    each warns that torchvision is missing and it falls back to PIL; no trainer, export or sample
    here runs an image processor, so the warning is noise in every run's log.
    """
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        import diffusers

        return getattr(diffusers, name)
    finally:
        hf_logging.set_verbosity(level)
