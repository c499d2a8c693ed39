"""Hosted mode (runner/hosted.py): a user's own loop gets everything managed mode gives."""
from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.errors import UserError
from runner.module_changes import marked
from runner.hosted import session
from runner.plan import PlanDoesNotFit

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets"
sys.path.insert(0, str(ASSETS))
from toy_model import batches, make_unet, my_loss  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def hosted_losses(tmp: Path, *overrides: str, optimizer=None, steps: int = 3) -> tuple[list[float], nn.Module, object]:
    """The README's hosted loop, in process."""
    run = session(["train.device=cpu", "optimizer.lr=1e-3", *overrides], output_dir=tmp)
    unet, opt, loader = run.prepare(make_unet(), optimizer, batches(steps), loss_fn=my_loss, example_batch=batches(1)[0])
    seen = {}
    for batch in loader:
        with run.step():
            loss = my_loss(unet, batch)
            run.backward(loss)
        seen["checkpointed"] = any(marked(m, "checkpoint") for m in unet.modules())
        opt.step()
        opt.zero_grad()
        run.log(loss)
    run.finish()
    return run.result.losses, unet, (run, opt, seen)


def plain_losses(steps: int = 3) -> list[float]:
    unet = make_unet()
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    out = []
    for batch in batches(steps):
        loss = my_loss(unet, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_hosted_loop_equals_the_plain_loop_and_applies_plugins(tmp_path):
    plain = plain_losses()
    same, _, _ = hosted_losses(tmp_path / "a")
    torch.testing.assert_close(torch.tensor(same), torch.tensor(plain), rtol=0, atol=0)
    ckpt, unet, (_, _, seen) = hosted_losses(tmp_path / "b", "checkpoint=blocks")
    torch.testing.assert_close(torch.tensor(ckpt), torch.tensor(plain), rtol=1e-5, atol=1e-6)  # memory, not math
    assert seen["checkpointed"], "checkpoint=blocks was not applied during the loop"
    assert not any(marked(m, "checkpoint") for m in unet.modules()), "finish() must undo every plugin change"


def test_hosted_run_writes_the_outputs_of_a_managed_run(tmp_path):
    losses, _, _ = hosted_losses(tmp_path, "profile.enabled=true", "profile.start=1", "profile.steps=2")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["loss"] for r in rows] == losses
    assert {"s_per_step", "host_rss_gb", "mem_pressure"} <= set(rows[0])
    for name in ("resolved_config.yaml", "versions.json", "plan.json", "memory_timeline.json"):
        assert (tmp_path / name).is_file(), name
    plan = json.loads((tmp_path / "plan.json").read_text())
    weights = sum(p.numel() * 4 for p in make_unet().parameters())
    assert plan["by_category"]["weights"] >= weights  # the preflight planned the prepared module


def test_configured_optimizer_when_the_loop_passes_none(tmp_path):
    _, _, (_, opt, _) = hosted_losses(tmp_path, "optimizer=adamw8bit", steps=1)
    assert "8bit" in type(opt).__name__


def test_a_configured_schedule_free_optimizer_arrives_in_train_mode(tmp_path):
    """schedulefree refuses to step in eval mode, its starting mode: the loop gets it ready to step, and its
    own opt.eval()/opt.train() around evaluations give the training weights back."""
    _, unet, (_, opt, _) = hosted_losses(tmp_path, "optimizer=adamw_schedulefree", steps=2)
    assert all(g["train_mode"] for g in opt.param_groups)
    trained = [p.detach().clone() for p in unet.parameters()]
    opt.eval(keep_train_point=True)
    assert any(not torch.equal(a, p) for a, p in zip(trained, unet.parameters()))  # the averaged weights
    opt.train()
    assert all(torch.equal(a, p) for a, p in zip(trained, unet.parameters()))


def test_an_optimizer_instance_and_an_explicit_optimizer_choice_conflict(tmp_path):
    run = session(["train.device=cpu", "optimizer=adafactor"], output_dir=tmp_path)
    unet = make_unet()
    with pytest.raises(UserError, match="optimizer=adafactor is configured, but the loop passed its own AdamW"):
        run.prepare(unet, torch.optim.AdamW(unet.parameters()), batches(1))
    run.finish()


def test_lora_and_dtypes_are_applied_to_the_loop_s_modules(tmp_path):
    # train.cpu_autocast keeps model.dtype on a CPU (runner/resolved.py: else everything is float32 there)
    run = session(["train.device=cpu", "train.cpu_autocast=true", "model.train=lora", "model.lora_rank=2",
                   "model.dtype=bfloat16", "model.lora_targets=[conv1,conv2]"], output_dir=tmp_path)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    models, opt, _ = run.prepare({"unet": make_unet(), "encoder": frozen}, None, None, trained={"unet"})
    trainable = [n for n, p in models["unet"].named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert {p.dtype for n, p in models["unet"].named_parameters() if "lora_" not in n} == {torch.bfloat16}
    assert {p.dtype for n, p in models["unet"].named_parameters() if "lora_" in n} == {torch.float32}
    assert models["encoder"].weight.dtype == torch.bfloat16
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in models["unet"].parameters()
                                                                     if p.requires_grad}
    run.finish()


def test_preflight_refuses_a_loop_over_budget(tmp_path):
    run = session(["train.device=cpu", "budget_gb=0.001"], output_dir=tmp_path)
    with pytest.raises(PlanDoesNotFit, match="budget_gb=0.001"):
        run.prepare(make_unet(), None, batches(1), loss_fn=my_loss, example_batch=batches(1)[0])
    run.finish()


def test_readme_diff_is_at_most_ten_changed_lines():
    def code(name: str) -> list[str]:
        lines = (ASSETS / name).read_text().splitlines()
        return lines[1:]  # the docstring line says which file is which

    diff = difflib.unified_diff(code("plain_loop.py"), code("hosted_loop.py"), lineterm="", n=0)
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    assert len(added) <= 10, added


@pytest.mark.slow
def test_hosted_script_takes_overrides_and_sweeps(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ASSETS), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    plain = subprocess.run([sys.executable, str(ASSETS / "plain_loop.py")], env=env, capture_output=True, text=True,
                           timeout=300)
    r = subprocess.run([sys.executable, str(ASSETS / "hosted_loop.py"), "-m", "train.device=cpu", "optimizer.lr=1e-3,1e-4",
                        f"hydra.sweep.dir={tmp_path}", "train.progress=false"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = (tmp_path / "sweep_summary.csv").read_text().splitlines()
    assert len(rows) == 3 and all(",ok," in row for row in rows[1:]), rows
    first_job = [line for line in r.stdout.splitlines() if line.startswith("loss ")][:3]
    assert first_job == [line for line in plain.stdout.splitlines() if line.startswith("loss ")]
    bad = subprocess.run([sys.executable, str(ASSETS / "hosted_loop.py"), "train.devise=cpu"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Did you mean 'device'" in bad.stderr and "Traceback" not in bad.stderr


def test_an_optimizer_built_before_lora_is_refused_not_left_training_nothing(tmp_path):
    """model.train=lora attaches adapters in prepare(): an optimizer the loop built before holds the
    frozen base and none of them, so it is refused with what to pass instead; a factory works."""
    run = session(["train.device=cpu", "model.train=lora", "model.lora_targets=[conv1,conv2]"], output_dir=tmp_path)
    unet = make_unet()
    with pytest.raises(UserError, match=r"does not hold \d+ of the \d+ tensors this run trains \(model.train=lora"):
        run.prepare(unet, torch.optim.AdamW(unet.parameters()), batches(1))
    run.finish()
    run = session(["train.device=cpu", "model.train=lora", "model.lora_targets=[conv1,conv2]"],
                  output_dir=tmp_path / "factory")
    unet, opt, _ = run.prepare(make_unet(), lambda params: torch.optim.AdamW(params, lr=1e-3), batches(1))
    trained = {id(p) for p in unet.parameters() if p.requires_grad}
    assert trained and {id(p) for g in opt.param_groups for p in g["params"]} == trained
    run.finish()


def test_a_tuple_batch_is_planned_like_a_dict(tmp_path):
    """A DataLoader over a TensorDataset yields tuples: the preflight plans them (it read only dicts)."""
    def tuple_loss(unet, batch):
        x, t = batch
        return my_loss(unet, {"x": x, "t": t})

    example = batches(1)[0]
    run = session(["train.device=cpu"], output_dir=tmp_path)
    run.prepare(make_unet(), None, None, loss_fn=tuple_loss, example_batch=(example["x"], example["t"]))
    run.finish()
    assert json.loads((tmp_path / "plan.json").read_text())["peak_bytes"] > 0
    run = session(["train.device=cpu"], output_dir=tmp_path / "str")
    with pytest.raises(UserError, match=r"prepare\(example_batch=...\) got a str"):
        run.prepare(make_unet(), None, None, loss_fn=tuple_loss, example_batch="x")
    run.finish()


def test_typed_train_steps_ends_the_loop_and_a_typed_batch_size_is_refused(tmp_path):
    """train.steps typed for a hosted loop is honoured (the prepared loader stops there); a typed
    train.batch_size would do nothing (the loop's loader makes its batches), so it is refused."""
    losses, _, _ = hosted_losses(tmp_path / "two", "train.steps=2", steps=3)
    assert len(losses) == 2
    losses, _, _ = hosted_losses(tmp_path / "all", steps=3)  # not typed: every batch the loader yields
    assert len(losses) == 3
    with pytest.raises(UserError, match=r"train.batch_size set for a hosted loop"):
        session(["train.device=cpu", "train.batch_size=8"], output_dir=tmp_path / "batch")


def test_a_hosted_main_returns_what_the_loop_returned(tmp_path, monkeypatch):
    from hydra.core.global_hydra import GlobalHydra

    from runner.hosted import hosted

    @hosted
    def main(run):
        unet, opt, loader = run.prepare(make_unet(), None, batches(1))
        return {"device": str(run.device), "params": sum(p.numel() for p in unet.parameters())}

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["loop.py", "train.device=cpu", f"hydra.run.dir={tmp_path / 'h'}",
                                      f"output_dir={tmp_path / 'o'}"])
    try:
        value = main()
    finally:
        GlobalHydra.instance().clear()
    assert value == {"device": "cpu", "params": sum(p.numel() for p in make_unet().parameters())}


def test_a_hosted_loop_runs_on_the_simulated_card_like_managed_mode(tmp_path):
    """``train.device=cuda_sim`` in hosted mode: the user's loop on the simulated card (the model and the
    loader's batches on the card, CUDA's branches of the plugins) trains the plain loop's losses, and
    the card's measured peak is the preflight plan's (a CUDA plan) within 3 %."""
    losses, _, _ = hosted_losses(tmp_path, "train.device=cuda_sim")
    # On a card the runner's AdamW is torch's fused kernel, the plain loop's on the host the per-parameter one:
    # the same update up to float rounding (measured 2.1e-7 relative at step 2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses()), rtol=2e-6, atol=0)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert {r["memory_source"] for r in rows} == {"cuda_sim"} and plan["target"] == "cuda"
    assert all(r["card_ops"] > 0 and r["host_syncs"] >= 1 for r in rows)  # the card counts the user's loop too (the loss)
    assert 0.97 <= max(r["memory_peak_gb"] for r in rows) * 2**30 / plan["peak_bytes"] <= 1.03
