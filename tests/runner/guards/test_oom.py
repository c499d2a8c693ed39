"""OOM recovery: split the micro-batch, retry the whole step, same math, no sample lost or repeated.

The out-of-memory errors are injected by a test-only plugin (``tiling=test_oom_injector``,
registered below, set with ``tiling.test_oom_injector.<key>``) whose forward pre-hook on the
trained U-Net raises a real ``torch.OutOfMemoryError`` while a micro-batch is larger than
``max_batch`` in the chosen steps, so it keeps failing until the loop has split enough. It also
records the sample seeds of every micro-batch the trainer's loss saw, and which attempts were
thrown away.

Equality claims, and why they hold:

* a run whose first step ran out of memory and was retried with micro-batch m ends with
  gradients and parameters *bit-identical* (``torch.equal``) to a run configured with
  micro-batch m from the start: once the partial gradients are dropped, the retry executes the
  same ops in the same order on the same values (one intra-op thread, see ``one_thread``). A
  double-counted or skipped micro-batch could not be bit-identical.
* against the un-split run (micro-batch = batch) the gradients differ only by float summation
  order (a + b vs. one batched reduction): measured max |diff| 1.0e-7 for gradients up to 0.14
  (median |g| 5e-4), so ``GRAD_ATOL = 1e-6``; one micro-batch counted twice would change them by
  about the gradient itself. The parameters after 3 AdamW steps differ more (measured up to
  1.4e-6, ``PARAM_ATOL = 1e-5``) because Adam divides by sqrt(v): for gradients near zero a
  rounding difference moves the update by a sizeable part of lr = 1e-4.
"""
from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runner.cli.compose import compose_config
from runner.errors import UserError
from runner.guards.oom import GIVE_UP_EXIT_CODE, OutOfMemoryGiveUp, is_out_of_memory
from runner.output.report import read_metrics
from runner.plugin import Plugin, PluginConfig
from runner.registry import register_plugin

ASSETS = Path(__file__).resolve().parents[3] / "tests" / "assets"
BATCH = 4
STEPS = 3
SEED = 0
BASE = ["trainer=custom", "trainer._target_=custom_trainer.PixelDiffusionTrainer", "data.resolution=16",
        f"train.batch_size={BATCH}", f"train.steps={STEPS}", "train.progress=false", "train.save_every=1",
        "train.keep_saved=5", "optimizer.lr=1e-4",
        # The preflight plan builds its own (simulated) plugin instances; these tests follow the real one.
        "train.preflight=false"]


# ---- the injector ------------------------------------------------------------------------------
@dataclass
class InjectorConfig(PluginConfig):
    name: str = "test_oom_injector"
    steps: list[int] = field(default_factory=lambda: [1])  # 1-based steps in which to raise
    max_batch: int = 1  # raise while a micro-batch has more samples than this
    from_call: int = 1  # ... from this forward call of the attempt on (earlier ones succeed)
    optimizer_step: int = 0  # raise in the optimizer step of this step instead (0: never)


RECORD: dict[str, "OOMInjector"] = {}


@register_plugin
class OOMInjector(Plugin):
    kind = "tiling"
    name = "test_oom_injector"
    Config = InjectorConfig
    description = "test only: raises torch.OutOfMemoryError in chosen steps"

    def __init__(self, config, run):
        super().__init__(config, run)
        self.step = 0
        self.calls = 0
        self.attempt: list[int] = []  # sample positions of this attempt's micro-batches
        self.counted: list[int] = []  # positions of completed steps, in order
        self.discarded: list[list[int]] = []
        self.ooms: list[tuple[int, str]] = []
        self.grads: dict[int, dict[str, torch.Tensor]] = {}  # step -> gradients the optimizer received
        RECORD["last"] = self

    def wrap_execution(self, ctx):
        loss = ctx.trainer.loss

        def recording_loss(models, batch):
            self.attempt += [int(s) - SEED * 1_000_003 for s in batch["sample_seed"]]
            return loss(models, batch)

        trainer = ctx.trainer
        trainer.loss = recording_loss
        ctx.hooks.add(ctx.models[next(iter(ctx.models.trained))], "test_oom_loss", self.key,
                      undo=lambda: setattr(trainer, "loss", loss))
        for name in ctx.models.trained:
            module = ctx.models[name]
            handle = module.register_forward_pre_hook(self._maybe_raise)
            ctx.hooks.add(module, "test_oom_injector", self.key, handle=handle, undo=handle.remove)

    def wrap_optimizer(self, ctx):
        original = ctx.optimizer.step
        trained = list(ctx.models.named_trainable_parameters())

        def step(optimizer, *args, **kwargs):
            self.grads[self.step] = {n: p.grad.clone() for n, p in trained}  # what this step applies
            if self.step == self.config.optimizer_step:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected in optimizer)")
            return original(*args, **kwargs)

        # A bound method: the LR scheduler wraps ``optimizer.step`` and expects one.
        ctx.optimizer.step = types.MethodType(step, ctx.optimizer)

    def _maybe_raise(self, module, args):
        self.calls += 1
        n = args[0].shape[0]
        if self.step in self.config.steps and n > self.config.max_batch and self.calls >= self.config.from_call:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB (injected: micro-batch {n} > {self.config.max_batch})")

    def on_step_start(self, ctx, step):
        self.step, self.calls, self.attempt = step + 1, 0, []

    def on_oom(self, ctx, step, error):
        assert all(p.grad is None for p in ctx.models["unet"].parameters()), "partial gradients must be gone"
        self.ooms.append((step, type(error).__name__))
        self.discarded.append(self.attempt)
        self.calls, self.attempt = 0, []

    def on_step_end(self, ctx, step):
        self.counted += self.attempt
        self.attempt = []


# ---- helpers -----------------------------------------------------------------------------------
@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # One intra-op thread: bitwise-reproducible CPU kernels (and no OpenMP stalls on 2 shared cores).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    sys.path.insert(0, str(ASSETS))
    yield
    sys.path.remove(str(ASSETS))
    torch.set_num_threads(n)


def train_run(out: Path, *overrides: str):
    from runner.__main__ import task

    cfg = compose_config([*BASE, f"output_dir={out}", *overrides])
    RECORD.clear()
    task(cfg)
    return read_metrics(out / "metrics.jsonl"), RECORD.get("last")


def params(out: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / f"step-{step:08d}" / "trainable.safetensors"))


def state(out: Path, step: int = STEPS) -> dict:
    return json.loads((out / "checkpoints" / f"step-{step:08d}" / "state.json").read_text())


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}; max diff {max_diff(a, b)}"


@dataclass
class Reference:
    out: Path
    grads: dict[int, dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, Reference]:
    """Runs without OOM (the injector only records), configured with micro-batch 4, 2 and 1."""
    root = tmp_path_factory.mktemp("ref")
    out = {}
    for accum in (1, 2, 4):
        micro = BATCH // accum
        rows, inj = train_run(root / f"m{micro}", f"train.grad_accum={accum}", "tiling=test_oom_injector",
                              "tiling.test_oom_injector.steps=[]")
        assert [r["micro_batch_size"] for r in rows] == [micro] * STEPS and not inj.ooms
        out[micro] = Reference(root / f"m{micro}", inj.grads)
    return out


def assert_close_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=k)


ALL_SAMPLES = list(range(STEPS * BATCH))
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6  # against the un-split run: summation order only (module docstring)
PARAM_ATOL = 1e-5


# ---- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "accum, inject, final_micro, retries",
    [
        (1, ["tiling.test_oom_injector.max_batch=2"], 2, 1),  # 4 -> 2
        # 2 -> 1 after the first pass's backward
        (2, ["tiling.test_oom_injector.max_batch=1", "tiling.test_oom_injector.from_call=2"], 1, 1),
        (1, ["tiling.test_oom_injector.max_batch=1"], 1, 2),  # 4 -> 2 -> 1 within one step
    ],
    ids=["4to2", "2to1-after-partial-gradients", "4to2to1"],
)
def test_split_in_first_step_equals_configured_micro_batch(tmp_path, references, caplog, accum, inject, final_micro,
                                                           retries):
    caplog.set_level("WARNING", logger="runner")
    rows, inj = train_run(tmp_path, f"train.grad_accum={accum}", "tiling=test_oom_injector", *inject)
    assert [r["micro_batch_size"] for r in rows] == [final_micro] * STEPS
    assert [r["oom_retries"] for r in rows] == [retries, 0, 0]
    assert inj.ooms == [(1, "OutOfMemoryError")] * retries
    assert inj.counted == ALL_SAMPLES  # every sample exactly once, in order
    if "tiling.test_oom_injector.from_call=2" in inject:
        assert inj.discarded[0] == [0, 1, 2, 3]  # pass 1 (0, 1) finished its backward, pass 2 failed
    warnings = [r.getMessage() for r in caplog.records if "out of memory in step" in r.getMessage()]
    assert len(warnings) == retries and "step 1" in warnings[0], warnings
    assert f"-> {final_micro}" in warnings[-1]
    assert state(tmp_path)["micro_batch_size"] == final_micro

    for step in range(1, STEPS + 1):
        assert_equal(inj.grads[step], references[final_micro].grads[step])
        assert_close_grads(inj.grads[step], references[BATCH].grads[step])
    assert_equal(params(tmp_path), params(references[final_micro].out))
    assert max_diff(params(tmp_path), params(references[BATCH].out)) <= PARAM_ATOL


def test_split_with_random_flip_equals_configured_micro_batch(tmp_path, references):
    """data.random_flip is decided per visit from each sample's seed, before the step is split:
    a retried step flips the same samples, so it is bit-identical to a run configured that way."""
    flip = ["data.random_flip=true", "tiling=test_oom_injector"]
    _, ref = train_run(tmp_path / "m2", "train.grad_accum=2", *flip, "tiling.test_oom_injector.steps=[]")
    rows, inj = train_run(tmp_path / "split", "train.grad_accum=1", *flip, "tiling.test_oom_injector.max_batch=2")
    assert [r["oom_retries"] for r in rows] == [1, 0, 0] and inj.counted == ALL_SAMPLES
    for step in range(1, STEPS + 1):
        assert_equal(inj.grads[step], ref.grads[step])
    assert_equal(params(tmp_path / "split"), params(tmp_path / "m2"))
    assert max_diff(params(tmp_path / "m2"), params(references[2].out)) > 0  # the flips changed the training


def test_split_mid_run_keeps_the_smaller_micro_batch_and_resume_honours_it(tmp_path, references, caplog):
    caplog.set_level("WARNING", logger="runner")
    out = tmp_path / "run"
    rows, inj = train_run(out, "train.grad_accum=1", "tiling=test_oom_injector", "tiling.test_oom_injector.steps=[2]",
                          "tiling.test_oom_injector.max_batch=2", "profile.enabled=true", "profile.steps=3")
    assert [r["micro_batch_size"] for r in rows] == [4, 2, 2]
    assert [r["oom_retries"] for r in rows] == [0, 1, 0]
    assert inj.ooms == [(2, "OutOfMemoryError")]
    assert inj.counted == ALL_SAMPLES
    [warning] = [r.getMessage() for r in caplog.records if "out of memory in step" in r.getMessage()]
    assert "step 2" in warning and "4 -> 2" in warning
    assert [state(out, s)["micro_batch_size"] for s in (1, 2, 3)] == [4, 2, 2]
    # Step 1 ran un-split: identical to the micro-batch-4 run; steps 2-3 ran split like the
    # micro-batch-2 run, from slightly different parameters: close to both.
    assert_equal(inj.grads[1], references[4].grads[1])
    assert_equal(params(out, 1), params(references[4].out, 1))
    for step in (2, 3):
        assert_close_grads(inj.grads[step], references[4].grads[step])
        assert_close_grads(inj.grads[step], references[2].grads[step])
    assert max_diff(params(out), params(references[4].out)) <= PARAM_ATOL

    # The profiler (on for all 3 steps, which must not change a value) marks where the OOM hit.
    timeline = json.loads((out / "memory_timeline.json").read_text())["points"]
    assert [p["point"] for p in timeline if p["step"] == 2] == [
        "step_start", "forward_failed", "after_forward", "after_backward", "after_forward", "after_backward",
        "after_optimizer", "step_end"]
    [failed] = [p for p in timeline if p["point"] == "forward_failed"]
    assert "micro-batch 4 > 2" in failed["error"]

    more, _ = train_run(tmp_path / "resumed", "train.grad_accum=1", f"train.resume={out}", f"train.steps={STEPS + 1}")
    assert [r["micro_batch_size"] for r in more] == [2]


def test_give_up_at_micro_batch_one_saves_the_last_completed_step(tmp_path, references, capsys):
    from runner.__main__ import task
    from runner.cli.launch import run_job

    out = tmp_path / "run"
    cfg = compose_config([*BASE, f"output_dir={out}", "train.grad_accum=1", "tiling=test_oom_injector",
                          "tiling.test_oom_injector.steps=[2]", "tiling.test_oom_injector.max_batch=0"])
    RECORD.clear()
    with pytest.raises(SystemExit) as e:
        run_job(task, cfg)  # what the CLI runs for a single (non -m) run (runner.cli.launch.launch)
    assert e.value.code == GIVE_UP_EXIT_CODE == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "error: Out of memory in step 2 even with micro-batch 1" in err
    ckpt = out / "checkpoints" / "step-00000001"
    assert f"train.resume={ckpt}" in err
    inj = RECORD["last"]
    assert inj.ooms == [(2, "OutOfMemoryError")] * 3  # at 4, 2 and 1
    assert inj.counted == list(range(BATCH))  # only step 1's samples were applied
    assert (out / "checkpoints" / "latest").read_text().strip() == ckpt.name
    saved = state(out, 1)
    assert (saved["step"], saved["samples_seen"], saved["micro_batch_size"]) == (1, BATCH, 1)
    assert_equal(params(out, 1), params(references[4].out, 1))  # the failed step changed nothing
    assert len(read_metrics(out / "metrics.jsonl")) == 1
    summary = json.loads((out / "job_summary.json").read_text())
    assert summary["status"] == "oom" and summary["exit_code"] == 3 and summary["steps_done"] == 1


def test_oom_in_the_optimizer_step_is_not_retried(tmp_path):
    with pytest.raises(OutOfMemoryGiveUp, match="optimizer step of step 2") as e:
        train_run(tmp_path, "tiling=test_oom_injector", "tiling.test_oom_injector.steps=[]",
                  "tiling.test_oom_injector.optimizer_step=2")
    assert "step-00000001" in str(e.value)  # names the last saved checkpoint
    assert RECORD["last"].ooms == [(2, "OutOfMemoryError")]
    assert not (tmp_path / "checkpoints" / "step-00000002").exists()


def test_is_out_of_memory_recognises_real_allocator_errors():
    with pytest.raises(RuntimeError) as cpu:
        torch.empty(2**55, dtype=torch.uint8)  # the CPU allocator's real failure (not an OutOfMemoryError)
    assert is_out_of_memory(cpu.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))  # kernels, bitsandbytes
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only allocator error types count
    assert issubclass(OutOfMemoryGiveUp, UserError)
