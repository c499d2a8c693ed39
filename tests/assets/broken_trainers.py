"""User trainers that fail in the ways a half-written trainer does (tests/runner/cli/test_bad_inputs.py)."""
from __future__ import annotations


class RaisingInit:
    def __init__(self, cfg):
        raise KeyError("options.resolution_typo")


class MissingMethods:
    def __init__(self, cfg):
        self.cfg = cfg

    def build_models(self, device="cpu"):
        raise NotImplementedError
