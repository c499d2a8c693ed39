"""The runner's fixed vocabularies (valid values of config keys), on the ground floor: torch-free and
importing nothing of the runner, so the checks, the builders, the guards and the trainers read them
without importing runner/config/."""
from __future__ import annotations

MODES = ("train", "plan", "fit", "export", "plugins", "cache")  # runner/__main__.py:MODE_TASKS
SIZES = ("tiny", "full")
DTYPES = ("float32", "bfloat16", "float16")
TRAIN_DTYPES = ("float32", "bfloat16")  # model.train_dtype (bfloat16 = kohya's --full_bf16)
PRECISIONS = ("no", "bf16", "fp16")
NONFINITE_POLICIES = ("skip", "stop")  # train.on_nonfinite (runner/guards/nonfinite.py)
# diffusers.optimization.SchedulerType's values (train.lr_scheduler). Listed here because importing
# diffusers to validate a config costs ~4 s; tests/runner/cli/test_bad_inputs.py checks the list.
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "piecewise_constant")

# model.train: ``full`` trains the denoiser's own weights; the others a peft adapter (runner/adapters.py).
ADAPTERS = ("lora", "lokr", "loha")
TRAIN_MODES = ("full", *ADAPTERS)


def is_adapter(train: object) -> bool:
    """Whether ``model.train=train`` trains a peft adapter (not the whole denoiser)."""
    return str(train) in ADAPTERS
