"""Train and eval modes of the optimizer (``optimizer=adamw_schedulefree``): which weights the model holds.

Schedule-free AdamW keeps two sequences: ``z`` in its state and ``y``, the point where gradients are
taken, in the parameters; the weights it *evaluates* are a third, ``x``, computed from the two by
``optimizer.eval()`` (and undone by ``optimizer.train()``). Its README: call ``optimizer.train()``
where the model trains and ``optimizer.eval()`` where it is evaluated, "and the optimizer should also
be placed in eval mode when storing checkpoints". The runner does that for you (managed mode):

* before each training step's forward: train mode (:func:`to_training_point`);
* checkpoints (runner/loop.py ``Loop.save``) and the end of the run: eval mode, and the weights stay
  there until the next step needs them (:func:`to_evaluation_point`). So every checkpoint, and the
  export after the last step, holds ``x``; a sample at a step that was just saved is drawn from the
  same weights without switching again;
* samples (``sample.every``) and validation (``val.every``): eval mode inside the pass, then the
  training point is restored *exactly* from a host copy taken before (:func:`at_evaluation_point`).
  ``train()`` would recompute ``y`` from ``x`` and ``z``, which rounds in the last bits; restored,
  turning samples or validation on changes no weight of the run;
* a resume loads ``x`` (the checkpoint) and the state, and the first step's switch computes ``y``
  exactly as the saved run did after saving, so a resumed run continues bit for bit.

The host copy costs the trained weights' size in host RAM during a sample or validation pass (not
device memory: the switch itself is in place). A hosted loop (runner/hosted.py) gets the optimizer
in train mode and calls ``opt.eval()``/``opt.train()`` itself around its evaluations, as the README
of schedulefree says.

Every other optimizer has no modes: each function here is then a no-op. Wrappers (``offload=optimizer``)
forward ``train``/``eval`` and copy the switched host weights to the device (runner/plugins/optimizer_wrappers.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def has_modes(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or what it wraps) switches weights between train and eval mode."""
    groups = getattr(optimizer, "param_groups", None)
    return bool(groups) and "train_mode" in groups[0] and callable(getattr(optimizer, "eval", None))


def training(optimizer: Any) -> bool:
    return any(g["train_mode"] for g in optimizer.param_groups)


def to_training_point(optimizer: Any) -> None:
    """Train mode, if the optimizer has modes and is not in it (before a training step)."""
    if has_modes(optimizer) and not training(optimizer):
        optimizer.train()


def to_evaluation_point(optimizer: Any) -> None:
    """Eval mode, kept until :func:`to_training_point` (checkpoints, the end of the run)."""
    if has_modes(optimizer) and training(optimizer):
        optimizer.eval()


@contextmanager
def at_evaluation_point(optimizer: Any) -> Iterator[None]:
    """Eval mode inside the block; the mode and the weights as they were after it, bit for bit."""
    if not has_modes(optimizer) or not training(optimizer):
        yield
        return
    optimizer.eval(keep_train_point=True)
    try:
        yield
    finally:
        optimizer.train()
