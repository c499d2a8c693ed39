"""What planning does to its own process, so that a simulated step is quick on a busy machine.

Nothing here changes a planned figure: one intra-op thread (nothing real is computed), the
trainer's model classes imported up front with the collector paused, and the objects that
existed before the plan frozen out of the garbage collector's full passes while it runs.
runner/plan/simulate.py wraps every plan in them.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch

from runner.hostmem import collector_paused


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """No intra-op threads while planning: nothing is computed, and on a busy machine the thread
    pool's barriers made the few real CPU ops (LoRA init) take milliseconds each."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def import_model_classes(trainer: Any) -> None:
    """Import the trainer's model classes now, so that the freeze below covers them.

    Why: the first plan in a process imports the model families (diffusers' model packages,
    transformers' text encoders, and through them peft, bitsandbytes and parts of torch._dynamo
    and torch._inductor): about a million objects that live as long as the process. Imported
    inside the plan, they are young objects that every full collection of the plan walks: 8-9
    of them, ~1 s of a full-size plan. Imported first (with the collector paused: it would only
    walk the growing heap), they are frozen with the rest. A trainer without ``module_classes``
    (the built-in families have it) imports inside the plan as before.
    """
    module_classes = getattr(trainer, "module_classes", None)
    if not callable(module_classes):
        return
    with collector_paused():  # an import makes long-lived objects, not garbage (runner/hostmem.py)
        module_classes()


@contextlib.contextmanager
def old_objects_frozen() -> Iterator[None]:
    """Keep the garbage collector off the objects that existed before the plan.

    A full collection walks every tracked object: after importing torch, diffusers and
    transformers that is millions, ~0.3 s a pass, and a plan triggers several (imports of the
    model classes, the park plugin's collect after dropping modules). Frozen objects are
    skipped, not leaked: they return to the collector when the plan ends. Objects the plan
    creates are collected as usual, so a dropped module is still freed when a plugin asks.
    """
    if gc.get_freeze_count():  # the application froze objects itself: leave its choice alone
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
