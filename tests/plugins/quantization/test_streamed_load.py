"""Issue 29: a LoRA over a quantized base, loaded already quantized (runner/meta_weights.py).

The tiny SDXL U-Net's weights in a safetensors file (diffusers' layout, bfloat16; another seed than
the run's own init). With ``model.train=lora`` and ``quantization=[nf4]`` (or int8) the U-Net is built
on meta and each Linear layer is read from the file just before it is quantized (nf4, int8, fp8); the
rest is read after the plugins' ``transform_models``. Against today's path (loaded whole in ``model.dtype``, then
quantized; selected here by answering ``streamed_base`` "no", the one switch between the two):

* the same state, tensor for tensor (packed weights, quantization state, adapters, norms, buffers);
* the host peak of the setup holds the U-Net as quantized plus one tensor in flight, where today's
  holds it whole first;
* the same losses, exactly, over 2 steps of a one-process run.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed

from runner.parts import build_plugins, build_trainer, make_context, prepare_models
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.distributed import loading
from runner.memory.live_bytes import LiveBytesTracker
from runner.plugins.quantization.common import storage_bytes, weight_tensors
from runner.resolved import resolve
from runner.session import make_accelerator

LORA = ["trainer=sdxl", "model.train=lora", "model.dtype=bfloat16", "train.mixed_precision=bf16",
        "train.progress=false", "export.enabled=false", "data.demo_size=4", "train.batch_size=2"]


def tiny_unet_file(path: Path) -> Path:
    """The tiny SDXL U-Net's state dict (seed 1234, not the run's) in bfloat16 with the ``unet.`` prefix."""
    from safetensors.torch import save_file

    from runner.families.sdxl.trainer import SDXLTrainer

    torch.manual_seed(1234)
    unet = SDXLTrainer(compose_config(["trainer=sdxl", "model.train=full"])).build_models("cpu")["unet"]
    save_file({f"unet.{k}": v.to(torch.bfloat16).contiguous() for k, v in unet.state_dict().items()}, str(path))
    return path


@pytest.fixture(scope="module")
def unet_file(tmp_path_factory) -> Path:
    return tiny_unet_file(tmp_path_factory.mktemp("weights") / "unet.safetensors")


def whole_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Today's path: the load decision says the base is not streamed, so it is loaded whole, then quantized."""
    monkeypatch.setattr(loading, "streamed_base", lambda *args: (False, "the test's reference: loaded whole"))


def set_up(out: Path, *overrides: str) -> tuple[object, int]:
    """The run's setup as runner/__main__.py does it (build, then the plugins' phases) under a
    LiveBytesTracker; the context and the host peak."""
    cfg = compose_config([f"output_dir={out}", *LORA, *overrides])
    validate(cfg)
    run = resolve(cfg)
    ctx = make_context(cfg, run, build_plugins(cfg, run), out)
    ctx.trainer = build_trainer(cfg, run)
    ctx.accelerator = make_accelerator(run)
    set_seed(run.seed)
    tracker = LiveBytesTracker()
    with tracker:
        ctx.models = prepare_models(loading.build_models_for_rank(ctx), cfg.model, run)
        ctx.apply_setup_phases()
    return ctx, tracker.snapshot()["devices"]["cpu"]["peak_bytes"]


@pytest.mark.parametrize("method", ["nf4", "int8", "fp8"])
def test_the_streamed_base_is_the_whole_load_quantized_bit_for_bit(tmp_path, unet_file, monkeypatch, method):
    extra = [f"quantization=[{method}]", f"model.path={unet_file}"]
    streamed, streamed_peak = set_up(tmp_path / "streamed", *extra)
    assert not streamed.models.unread  # every weight read by now
    with monkeypatch.context() as m:
        whole_load(m)
        whole, whole_peak = set_up(tmp_path / "whole", *extra)
    a, b = whole.models["unet"].state_dict(), streamed.models["unet"].state_dict()
    assert list(a) == list(b)
    assert streamed.facts.quantized["unet"] == whole.facts.quantized["unet"] > 0
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key
    # Host: the other modules (held whole either way), and the U-Net as its final tensors (quantized
    # layers, the rest in model.dtype, its buffers). Streamed, the setup never holds more than that plus
    # one tensor in flight; whole, it held every weight of the file in model.dtype first.
    unet = streamed.models["unet"]
    others = storage_bytes(t for n, mod in streamed.models.items() if n != "unet" for t in (*mod.parameters(), *mod.buffers()))
    final = storage_bytes(weight_tensors(unet)) + storage_bytes(unet.buffers())
    from safetensors import safe_open

    itemsize = streamed.run.frozen_dtype.itemsize
    with safe_open(str(unet_file), framework="pt") as f:
        keys = f.keys()  # a safe_open handle is not iterable
        sizes = [math.prod(f.get_slice(k).get_shape()) * itemsize for k in keys]
    assert streamed_peak - others <= final + max(sizes)
    assert whole_peak - others >= sum(sizes) > final + max(sizes)


def test_a_streamed_one_process_run_gives_the_whole_loads_losses(tmp_path, unet_file, monkeypatch, caplog):
    from runner.__main__ import task
    from runner.output.report import read_metrics

    common = ["quantization=[nf4]", f"model.path={unet_file}", "train.steps=2", *LORA]
    with caplog.at_level("INFO", logger="runner"):
        task(compose_config([f"output_dir={tmp_path / 'streamed'}", *common]))
    assert "the base is built on meta and read layer by layer from its safetensors files" in caplog.text
    assert "each layer read from its file just before it was quantized" in caplog.text
    with monkeypatch.context() as m:
        whole_load(m)
        task(compose_config([f"output_dir={tmp_path / 'whole'}", *common]))
    streamed = read_metrics(tmp_path / "streamed" / "metrics.jsonl")
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    assert [r["loss"] for r in streamed] == [r["loss"] for r in whole] and len(whole) == 2


def test_random_init_and_dora_are_loaded_whole_and_say_why(unet_file):
    from runner.distributed.loading import load_mode

    def mode(*overrides: str) -> tuple[str, str]:
        cfg = compose_config([*LORA, "quantization=[nf4]", *overrides])
        run = resolve(cfg)
        return load_mode(build_trainer(cfg, run), run.dist, run.train_mode, cfg)

    assert mode(f"model.path={unet_file}")[0] == "quantized"
    random = mode()
    assert random[0] == "whole" and "random init" in random[1]
    dora = mode(f"model.path={unet_file}", "model.lora_dora=true")
    assert dora[0] == "whole" and "DoRA" in dora[1]
    other = mode(f"model.path={unet_file}", "quantization.nf4.modules=[text_encoder]")
    assert other[0] == "whole" and "quantization" not in other[1]


def test_the_plan_simulates_the_streamed_load_and_its_host_peak_is_the_real_one(tmp_path, unet_file, monkeypatch):
    """The planner runs the same read (runner/plan/quantized_reads.py: fake tensors of the file's shapes and
    dtypes, read where the run reads): its setup's host peak is the tracker's in a real setup within
    5 %, streamed and whole, and the streamed one is the lower."""
    from runner.plan import plan_step

    extra = ["quantization=[nf4]", f"model.path={unet_file}", "train.device=cpu"]
    peaks = {}
    for streamed in (True, False):
        with monkeypatch.context() as m:
            if not streamed:
                whole_load(m)
            _, real_peak = set_up(tmp_path / f"real-{streamed}", *extra)
            cfg = compose_config(["mode=plan", f"output_dir={tmp_path / 'plan'}", *LORA, *extra])
            validate(cfg)
            plan = plan_step(cfg)
        assert plan.host_peak_phase == "setup"
        assert plan.host_peak_bytes == pytest.approx(real_peak, rel=0.05), (streamed, plan.host_peak_bytes, real_peak)
        line = "read layer by layer" if streamed else "loaded whole in model.dtype, then quantized"
        assert line in plan.notes["base load"]
        peaks[streamed] = plan.host_peak_bytes
        print(f"{'streamed' if streamed else 'whole'}: setup host peak planned {plan.host_peak_bytes}, real {real_peak}")
    assert peaks[True] < 0.75 * peaks[False], peaks


def test_each_fsdp_ranks_planned_host_is_one_streamed_process(tmp_path, unet_file):
    """dist=fsdp: every rank reads its own quantized base layer by layer, as one process does (the
    simulation runs that read; runner/plan/dist.py adds no term): the plan's host RAM per rank is the
    one-process plan's setup peak, and the plan says how the ranks load it."""
    from runner.plan import plan_step

    extra = ["mode=plan", "quantization=[nf4]", f"model.path={unet_file}", "train.device=cpu", *LORA,
             "train.batch_size=4"]
    one = plan_step(compose_config([f"output_dir={tmp_path / 'one'}", *extra]))
    two = plan_step(compose_config([f"output_dir={tmp_path / 'two'}", *extra, "dist=fsdp", "dist.world_size=2"]))
    assert two.host_ranks["load"] == "quantized"
    assert "every rank reads layer by layer" in two.host_ranks["why"]
    assert two.host_ranks["per_rank_bytes"] == one.host_peak_bytes


def test_a_quantization_subclass_without_a_reader_gets_the_base_read_whole_first(tmp_path, unet_file, monkeypatch):
    """Another package's quantization plugin whose ``quantize`` takes no ``read``: the base is read
    whole before it quantizes (today's bytes), not handed over with its weights still on meta."""
    from runner.plugins.quantization import bnb

    def old_quantize(self, module, skip, keep, ctx):  # the signature before the reader
        return bnb.apply_bnb_quantization(module, "nf4", skip=skip, keep=keep, compute_dtype=self.compute_dtype(),
                                          double_quant=bool(self.config.double_quant), simulate=ctx.simulate)

    extra = ["quantization=[nf4]", f"model.path={unet_file}"]
    reference, _ = set_up(tmp_path / "reference", *extra)
    monkeypatch.setattr(bnb.NF4Quantization, "quantize", old_quantize)
    ctx, _ = set_up(tmp_path / "old", *extra)
    assert not ctx.models.unread
    a, b = reference.models["unet"].state_dict(), ctx.models["unet"].state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
