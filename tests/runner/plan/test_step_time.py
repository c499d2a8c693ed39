"""Step-time prediction (runner/plan/cost.py, speed.py, calibrate.py, runner/devices.py): the counts it is
built on, the device table, the copies plugins record, and where the prediction is shown.

Counts are checked against independent references (PyTorch's FlopCounterMode on a real step; the
stream plugin's own statistics); times are never asserted (the machine is shared), only that the
model composes its inputs as documented.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from planner_truth import _Phases, prepared_step
from torch.utils.flop_counter import FlopCounterMode

from runner.cli.compose import compose_config
from runner.checks import validate
from runner.devices import FIELDS, DeviceSpec, device_spec, device_table
from runner.errors import UserError
from runner.loop import forward_backward
from runner.memory.live_bytes import LiveBytesTracker
from runner.plan import calibrate, plan_step
from runner.plan.cost import EXTRA_FORMULAS, CostCounter, PhaseCost, Roofline
from runner.plan.speed import Target, Trained, predict
from runner.resolved import resolve

ROOT = Path(__file__).resolve().parents[3]
ASSETS = ROOT / "tests" / "assets"
PIXEL = ["trainer=custom", "trainer._target_=custom_trainer.PixelDiffusionTrainer", "data.resolution=16"]
REQUIRED = ("h100_sxm", "h100_pcie", "a100_40gb", "a100_80gb", "l40s", "rtx6000_ada", "rtx4090", "rtx4080",
            "rtx3090", "rtx3060_12gb", "a6000")


@pytest.fixture(autouse=True)
def _assets_on_path(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ASSETS))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def compose(*overrides: str):
    cfg = compose_config(list(overrides))
    validate(cfg)
    return cfg


# ---- counts --------------------------------------------------------------------------------------
def test_planned_flops_equal_flopcountermode_on_a_real_cpu_step():
    cfg = compose(*PIXEL, "train.device=cpu")
    plan = plan_step(cfg)
    ctx, params, raw, micro = prepared_step(cfg)
    counter = CostCounter(Roofline({}, {}, 1e9, 0.0), Roofline({}, {}, 1e9, 0.0), device_type="cpu")
    tracker = LiveBytesTracker()
    tracker.op_observer = counter.observe
    try:
        with FlopCounterMode(display=False, custom_mapping=EXTRA_FORMULAS) as reference, tracker:
            forward_backward(ctx, raw, micro, _Phases(tracker))
    finally:
        ctx.teardown()
    real = counter.total(("forward", "backward")).flops
    # FlopCounterMode with the two CPU attention kernels its table lacks (the mid-block's attention)
    assert real == reference.get_total_flops() > 0
    assert plan.step_time["flops"] == real  # and the simulated step computes what the real one does


def test_checkpoint_recompute_is_counted_in_backward():
    plain = plan_step(compose("train.device=cpu", "data.resolution=64"))
    ckpt = plan_step(compose("train.device=cpu", "data.resolution=64", "checkpoint=blocks"))
    fwd = plain.step_time["detail"]["phases"]["forward"]["flops"]
    extra = ckpt.step_time["detail"]["phases"]["backward"]["flops"] - plain.step_time["detail"]["phases"]["backward"]["flops"]
    assert ckpt.step_time["detail"]["phases"]["forward"]["flops"] == fwd
    assert 0.5 * fwd < extra <= fwd  # the checkpointed blocks' forward, run again (not the convs outside blocks)


def test_cpu_attention_is_counted_with_the_attention_formula():
    q = torch.randn(1, 2, 16, 8)
    counter = CostCounter(Roofline({}, {}, 1e9, 0.0), Roofline({}, {}, 1e9, 0.0), device_type="cpu")
    tracker = LiveBytesTracker()
    tracker.op_observer = counter.observe
    with tracker, tracker.phase("forward"):
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert counter.total().flops == 2 * (2 * 1 * 2 * 16 * 16 * 8)  # QK^T and PV


def test_copies_between_host_and_device_are_counted_and_the_stream_plugin_records_its_own():
    plan = plan_step(compose("offload=stream", "offload.stream.device_fraction=0.5", "model.train=lora"))
    st = plan.step_time
    streamed = plan.notes["stream: host-to-device bytes"]
    assert streamed > 0 and st["h2d_bytes"] >= streamed  # the batch and anything else come on top
    assert st["detail"]["copies_overlapped_share"]["h2d"] > 0
    phases = st["detail"]["phases"]
    assert phases["forward"]["h2d_bytes"] > 0 and phases["backward"]["h2d_bytes"] > 0  # reloaded for backward


# ---- the model ---------------------------------------------------------------------------------------
def _target(serial: bool) -> Target:
    r = Roofline({torch.float32: 1e12}, {torch.float32: 1e12}, 1e11, 1e-6)
    return Target("t", "test", r, r, h2d_bytes_per_s=1e10, host_op_s=1e-5, serial=serial, source="test",
                  peak_flops=1e12)


def test_side_stream_copies_hide_behind_compute_and_blocking_ones_add_up():
    from runner.context import Transfer

    counter = CostCounter(*(2 * [_target(False).device]))
    counter.phases["forward"] = PhaseCost(ops=10, kernels=10, device_s=1.0, h2d_bytes=int(5e9))
    overlapped = predict(counter, _target(False), micro_batches=1, simulated_micro=1, optimizer="adamw",
                         transfers={"offload/stream": Transfer(h2d_bytes=int(5e9), overlapped=True)},
                         trained=Trained(), fused=False)
    blocking = predict(counter, _target(False), micro_batches=1, simulated_micro=1, optimizer="adamw",
                       transfers={"offload/park": Transfer(h2d_bytes=int(5e9))}, trained=Trained(), fused=False)
    assert overlapped.phases["forward"] == pytest.approx(1.0)  # 0.5 s of copies under 1 s of compute
    assert blocking.phases["forward"] == pytest.approx(1.5)
    counter.phases["forward"] = PhaseCost(ops=10, kernels=10, device_s=0.2, h2d_bytes=int(5e9))
    slow = predict(counter, _target(False), micro_batches=1, simulated_micro=1, optimizer="adamw",
                   transfers={"offload/stream": Transfer(h2d_bytes=int(5e9), overlapped=True)},
                   trained=Trained(), fused=False)
    assert slow.phases["forward"] == pytest.approx(0.5) and "PCIe" in slow.bound


def test_a_gpu_overlaps_dispatch_and_kernels_a_cpu_does_not():
    counter = CostCounter(*(2 * [_target(False).device]))
    counter.phases["forward"] = PhaseCost(ops=1000, kernels=1000, device_s=0.004)  # dispatch: 1000 x 10 us = 0.01 s
    gpu = predict(counter, _target(False), micro_batches=1, simulated_micro=1, transfers={}, optimizer="adamw",
                  trained=Trained(), fused=False)
    cpu = predict(counter, _target(True), micro_batches=1, simulated_micro=1, transfers={}, optimizer="adamw",
                  trained=Trained(), fused=False)
    assert gpu.phases["forward"] == pytest.approx(0.01) and cpu.phases["forward"] == pytest.approx(0.014)


def test_micro_batches_scale_the_simulated_passes_and_fused_moves_the_update_into_backward():
    counter = CostCounter(*(2 * [_target(False).device]))
    counter.phases["forward"] = PhaseCost(ops=1, kernels=1, device_s=1.0)
    counter.phases["backward"] = PhaseCost(ops=1, kernels=1, device_s=2.0)
    trained = dict(device_elements=10**9, device_bytes=4 * 10**9, device_params=100)
    four = predict(counter, _target(False), micro_batches=4, simulated_micro=2, transfers={}, optimizer="adamw",
                   trained=Trained(**trained), fused=False)
    fused = predict(counter, _target(False), micro_batches=1, simulated_micro=1, transfers={}, optimizer="adamw",
                    trained=Trained(**trained), fused=True)
    assert four.phases["forward"] == pytest.approx(2.0) and four.phases["backward"] == pytest.approx(4.0)
    update = 24 * 4e9 / 1e11 + 1000 * 1e-6  # adamw: 24 parameter-sized passes, 10 kernels a parameter
    assert four.phases["optimizer"] == pytest.approx(update)
    assert fused.phases["optimizer"] == 0 and fused.phases["backward"] == pytest.approx(2.0 + update)


# ---- the device table -------------------------------------------------------------------------------
def test_the_table_has_the_required_gpus_with_every_field():
    table = device_table()
    assert set(REQUIRED) <= set(table)
    for name in REQUIRED:
        spec = device_spec({"name": name})
        assert isinstance(spec, DeviceSpec) and spec.usable_gib <= spec.memory_gib
        assert spec.bf16_tflops >= spec.tf32_tflops >= 0.5 * spec.fp32_tflops  # dense tensor >= dense tf32
    text = (ROOT / "conf" / "devices.yaml").read_text()
    assert "sparsity" in text and "datasheet" in text  # the sources, and which figures are not used


def test_a_named_device_sets_and_caps_the_budget():
    default = resolve(compose("device.name=rtx4080", "mode=plan"), target="cuda")
    assert default.budget_bytes == int(15.4 * 2**30) and default.gpu.name == "rtx4080"
    capped = resolve(compose("device.name=rtx4080", "budget_gb=24", "mode=plan"), target="cuda")
    smaller = resolve(compose("device.name=rtx4080", "budget_gb=10", "mode=plan"), target="cuda")
    assert capped.budget_bytes == default.budget_bytes and smaller.budget_bytes == 10 * 2**30
    assert resolve(compose("mode=plan"), target="cuda").gpu is None  # no name: no budget default, as before


def test_a_budget_above_the_named_card_is_said_once_before_anything_is_built(caplog):
    """budget_gb above the card's usable memory is capped (above) and the user is told, naming the
    key and the largest valid value; a budget within the card says nothing."""
    from runner.checks import check_run

    with caplog.at_level("WARNING", logger="runner"):
        validate(compose_config(["device.name=rtx4080", "budget_gb=24", "mode=plan"]))  # both stages, once
    said = [r.getMessage() for r in caplog.records if "budget_gb=24" in r.getMessage()]
    assert len(said) == 1 and "usable_gib 15.4" in said[0] and "at most 15.4" in said[0], said
    caplog.clear()
    with caplog.at_level("WARNING", logger="runner"):
        check_run(compose_config(["device.name=rtx4080", "budget_gb=10", "mode=plan"]), keep=False)
    assert not [r for r in caplog.records if "budget_gb" in r.getMessage()]


def test_a_users_own_gpu_from_a_yaml_file_and_single_field_overrides(tmp_path):
    mine = tmp_path / "my_gpu.yaml"
    mine.write_text(yaml.safe_dump({"name": "my_gpu", "label": "My GPU", **{f: 10.0 for f in FIELDS}}))
    spec = resolve(compose(f"device.spec={mine}", "device.h2d_gbps=3", "mode=plan"), target="cuda").gpu
    assert spec.name == "my_gpu" and spec.h2d_gbps == 3.0 and spec.bf16_tflops == 10.0
    plan = plan_step(compose(f"device.spec={mine}", "mode=plan"))
    assert plan.step_time["device"] == "My GPU" and plan.budget_bytes == 10 * 2**30


@pytest.mark.parametrize("overrides, words", [
    (["device.name=rtx409"], ["rtx409", "rtx4090"]),
    (["device.spec=/no/such.yaml"], ["device.spec", "not a file"]),
    (["device.name=rtx4090", "device.hbm_gbps=-1"], ["hbm_gbps=-1"]),
    (["device.name=rtx4090", "train.device=cpu"], ["train.device=cpu"]),
])
def test_bad_device_settings_are_one_message(overrides, words):
    with pytest.raises(UserError) as e:
        compose(*overrides, "mode=plan")
    assert all(w in str(e.value) for w in words), str(e.value)


# ---- where it shows ----------------------------------------------------------------------------------
def test_plan_json_and_the_table_show_the_step_time_beside_the_peak(tmp_path):
    from runner.plan import plan_command

    plan = plan_command(compose("mode=plan", "device.name=h100_sxm", f"output_dir={tmp_path}"), tmp_path)
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["step_time"]["seconds"] == plan.seconds_per_step > 0
    assert saved["step_time"]["device"].startswith("NVIDIA H100 SXM5")
    table = plan.format_table().splitlines()
    at = next(i for i, line in enumerate(table) if line.startswith("device memory:"))
    # the verdict, the caching allocator's reserved bytes (a CUDA plan), then the step time
    assert table[at + 2].startswith("  reserved by the caching allocator")
    assert table[at + 3].startswith("step time:") and "s/step" in table[at + 3]


def test_without_a_device_the_step_time_is_for_the_reference_card_and_says_so():
    plan = plan_step(compose("mode=plan"))
    assert "reference card" in plan.step_time["device"] and plan.budget_bytes is None


def test_the_cpu_calibration_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "_MEASURED", {})
    first = calibrate.calibration(1)
    assert not first["cached"] and calibrate.cache_file().is_file()
    monkeypatch.setattr(calibrate, "_MEASURED", {})
    again = calibrate.calibration(1)
    assert again["cached"] and again["op_s"] == first["op_s"]
    assert all(first[k] > 0 for k in ("matmul_fp32_flops", "conv_fp32_flops", "bytes_per_s", "op_s"))
    plan = plan_step(compose("train.device=cpu"))
    assert plan.step_time["device"].startswith("this CPU") and "measured" in plan.step_time["source"]


@pytest.mark.parametrize("overrides", [["device.name=h200"], ["device.name=h200", "offload=stream",
                                                              "model.train=full"], ["train.device=cpu"]])
def test_a_plans_detail_recomputes_its_own_prediction(overrides):
    """bench/step_time_fit.py (GPU) and bench/gpu_calibrate.py (CPU) refit the host costs from a plan's
    step_time.detail alone: that detail must hold everything the prediction used (GPU, streamed copies,
    and the CPU's serial model), and a larger host cost can only lengthen the step."""
    import sys
    from dataclasses import replace

    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_calibrate import phase_seconds
    from step_time_fit import predict_row

    from runner.plan.host import HostCosts

    st = plan_step(compose("mode=plan", *overrides)).step_time
    host = st["detail"]["host"]
    if host is None:  # the CPU's serial model
        own = st["detail"]["rates"]["host_op_s"]
        assert phase_seconds(st, own) == pytest.approx(st["seconds"], rel=1e-4)
        assert phase_seconds(st, 2 * own) > phase_seconds(st, own)
        return
    rec, costs = {"detail": st["detail"], "shape": host["shape"]}, HostCosts(**host["costs"])
    assert predict_row(rec, costs) == pytest.approx(st["seconds"], rel=1e-4)
    assert predict_row(rec, replace(costs, kernel_op_s=2 * costs.kernel_op_s)) > predict_row(rec, costs)
    assert st["host_syncs_per_step"] >= 1 and st["card_ops_per_step"] > 0 and 0 < st["mfu"] <= st["utilisation"]

def test_host_syncs_per_step_by_what_the_step_does():
    """The planner's count of host syncs (runner/plan/host.py): the loss read per micro-batch and the norm
    read are per step; only an update that syncs per parameter (bitsandbytes 0.50) or fused backward's
    per-parameter read grows with the parameters (as the H200 rows ran; the code now has neither)."""
    from runner.plan.host import StepShape

    def total(*args, **kw):
        return sum(StepShape(*args, **kw).syncs().values())

    assert total("adamw", 100, 2, False) == total("adamw", 200, 2, False) == 3
    assert total("adamw8bit", 100, 1, False) == total("adamw8bit", 200, 1, False) == 2  # runner/optim/eight_bit.py
    assert total("paged_adamw8bit", 100, 1, False) == 2 + 100  # bitsandbytes' own step
    assert StepShape("adamw8bit", 100, 1, True).syncs() == {"backward": 2, "optimizer": 0}
    # the H200 rows ran bitsandbytes' step and the host-read hook: priced as they ran
    assert StepShape("adamw8bit", 100, 1, True, update_syncs_per_param=1, hook_syncs_per_param=1).syncs() == {
        "backward": 2 + 2 * 100, "optimizer": 0}
