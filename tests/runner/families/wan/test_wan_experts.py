"""Wan 2.2 A14B with both experts in one run (trainer.experts=both, runner/families/wan/experts.py).

Each step trains the expert its draw picks, every sample's t in that expert's range; the other
expert (weights, LoRA, optimizer state) waits on the host and its LoRA is left bit for bit alone by
the optimizer; both LoRAs are saved, resumed and exported, and load into WanPipeline's two
transformers.
"""
from __future__ import annotations

import json

import pytest
import torch
from accelerate.utils import set_seed
from safetensors import safe_open
from safetensors.torch import load_file

from runner.__main__ import task
from runner.parts import build_trainer, idle_parts, prepare_models
from runner.cli.compose import compose_config
from runner.context import RunContext
from runner.errors import UserError
from runner.families.wan.architecture import A14B_BOUNDARY
from runner.families.wan.experts import MODULE, move_expert, optimizer_state
from runner.loop import trainer_step_start
from runner.optim.build import build_optimizer
from runner.output.report import read_metrics
from runner.plan import plan_step
from runner.plugin import PluginSchedule
from runner.resolved import resolve

pytestmark = pytest.mark.usefixtures("one_thread")
BOTH = ["trainer=wan", "trainer.variant=2.2-a14b", "trainer.experts=both", "data.frames=5", "train.device=cpu",
        "train.progress=false", "data.demo_size=2", "model.train=lora"]


def trainer_of(*overrides: str):
    cfg = compose_config([*BOTH, *overrides])
    return build_trainer(cfg, resolve(cfg))


def steps_of(trainer, expert: str, n: int = 64) -> list[int]:
    return [k for k in range(n) if trainer.expert_of_step(k) == expert]


def lora_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def test_each_step_draws_one_expert_by_its_share_and_scales_t_into_its_range() -> None:
    trainer = trainer_of()
    draws = [trainer.expert_of_step(k) for k in range(2000)]
    again, other_seed = trainer_of(), trainer_of("train.seed=7")
    assert draws == [again.expert_of_step(k) for k in range(2000)]  # from the seed and the step alone
    share = draws.count("high") / len(draws)
    assert abs(share - (1 - A14B_BOUNDARY)) < 0.03, share  # 0.125 of the range is the high-noise expert's
    assert draws != [other_seed.expert_of_step(k) for k in range(2000)]
    seeds = torch.arange(64)
    family = trainer_of("trainer.experts=high").timesteps(seeds)  # a one-expert run's draw of the same samples
    trainer.active = "high"
    torch.testing.assert_close(trainer.timesteps(seeds), family)
    trainer.active = "low"
    t = trainer.timesteps(seeds)
    assert bool((t < A14B_BOUNDARY).all())
    torch.testing.assert_close(t, trainer_of("trainer.experts=low").timesteps(seeds))


def test_both_experts_are_built_trained_and_differ() -> None:
    trainer = trainer_of()
    set_seed(0)
    models = trainer.build_models("cpu")
    assert models.trained == {"transformer", "transformer_2"}
    assert set(models.blocks) == {"transformer", "transformer_2"} and all(len(b) == 3 for b in models.blocks.values())
    high, low = models["transformer"], models["transformer_2"]
    assert lora_of(high).keys() == lora_of(low).keys() and any("lora_A" in k for k in lora_of(low))
    assert not torch.equal(high.proj_out.weight, low.proj_out.weight)


def setup_context(*overrides: str) -> RunContext:
    """A real context with no plugins, the models placed by the run's setup and the configured optimizer."""
    cfg = compose_config([*BOTH, *overrides])
    run = resolve(cfg)
    ctx = RunContext(run=run, schedule=PluginSchedule.build([]), cfg=cfg, **idle_parts(run))
    ctx.trainer = build_trainer(cfg, run)
    set_seed(0)
    ctx.models = prepare_models(ctx.trainer.build_models("cpu"), cfg.model, run)
    ctx.apply_setup_phases()
    ctx.optimizer = build_optimizer(cfg.optimizer, list(ctx.models.trainable_parameters()))
    return ctx


def one_step(ctx: RunContext, step: int, set_to_none: bool) -> None:
    trainer_step_start(ctx, step)
    loss = ctx.trainer.loss(ctx.models, ctx.trainer.example_batch(2, "cpu"))
    loss.backward()
    ctx.optimizer.step()
    ctx.optimizer.zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("set_to_none", [True, False])  # False: the loop's zero_grad under dist=ddp
def test_the_inactive_experts_lora_and_state_are_bit_unchanged_by_the_others_steps(set_to_none) -> None:
    ctx = setup_context("optimizer.name=adamw", "optimizer.weight_decay=0.1")
    trainer, models = ctx.trainer, ctx.models
    low_step, high_steps = steps_of(trainer, "low")[0], steps_of(trainer, "high")[:2]
    before = lora_of(models["transformer_2"])
    one_step(ctx, low_step, set_to_none)
    assert trainer.active == "low"
    trained_low = lora_of(models["transformer_2"])
    assert any(not torch.equal(before[k], trained_low[k]) for k in before)  # the active expert's LoRA trains
    state = optimizer_state(ctx.optimizer)
    low_params = [p for p in models["transformer_2"].parameters() if p.requires_grad]
    low_state = {id(p): {k: v.clone() for k, v in state[p].items()} for p in low_params}
    high_before = lora_of(models["transformer"])
    for k in high_steps:
        one_step(ctx, k, set_to_none)
        assert trainer.active == "high" and all(p.grad is None for p in low_params)
    after = lora_of(models["transformer_2"])
    assert all(torch.equal(trained_low[k], after[k]) for k in trained_low)  # no decay, no moment, no update
    for p in low_params:
        assert all(torch.equal(v, state[p][k]) for k, v in low_state[id(p)].items())  # step count included
    assert any(not torch.equal(high_before[k], v) for k, v in lora_of(models["transformer"]).items())
    assert trainer.switches == 2


def test_an_expert_moves_with_its_lora_state_and_the_parameter_objects_stay() -> None:
    """The move itself, to a device that is not the host (``meta``: shapes only, so not back)."""
    ctx = setup_context()
    one_step(ctx, steps_of(ctx.trainer, "low")[0], True)
    module = ctx.models["transformer_2"]
    params = list(module.parameters())
    state = optimizer_state(ctx.optimizer)
    trained = [p for p in params if p.requires_grad]
    assert trained and all(p in state for p in trained)
    move_expert(module, "meta", state)
    assert all(p.device.type == "meta" for p in module.parameters())
    assert all(a is b for a, b in zip(module.parameters(), params))  # the optimizer's parameter objects
    assert all(state[p]["exp_avg"].device.type == "meta" for p in trained)
    assert all(state[p]["step"].device.type == "cpu" for p in trained)  # AdamW's step count stays a host scalar


def test_the_plan_is_the_active_experts_step_and_the_other_waits_on_the_host() -> None:
    """The planner (a CUDA target on ``meta``): the low-noise expert is never on the device."""
    cfg = compose_config([o for o in BOTH if o != "train.device=cpu"])
    plan = plan_step(cfg)
    assert "transformer" in plan.by_module and "transformer_2" not in plan.by_module
    parked = int(plan.notes["parked expert bytes"])
    trainer = trainer_of()
    expert = prepare_models(trainer.build_models("meta"), cfg.model, resolve(cfg))["transformer_2"]
    assert parked == sum(t.numel() * t.element_size() for t in [*expert.parameters(), *expert.buffers()])
    assert plan.host_steady_bytes >= parked
    assert "transformer_2 (low-noise) waits on the host" in plan.notes["parked on the host"]
    assert plan.host_pinned_bytes == parked  # pinned for the target GPU: nothing else of this run pins
    one = plan_step(compose_config([*(o for o in BOTH if o != "train.device=cpu"), "trainer.experts=high"]))
    update, update_one = (p.step_time["detail"]["optimizer_update"] for p in (plan, one))
    assert update["host_elements"] == 0 and update["device_elements"] == update_one["device_elements"]  # one LoRA steps
    nf4 = plan_step(compose_config([*(o for o in BOTH if o != "train.device=cpu"), "quantization=[nf4]"]))
    assert 0 < nf4.host_pinned_bytes < int(nf4.notes["parked expert bytes"])  # bitsandbytes' layers move pageable


def test_a_run_switches_experts_saves_both_and_exports_both(tmp_path) -> None:
    from diffusers import WanPipeline

    trainer = trainer_of()
    steps = max(steps_of(trainer, "high")[0], steps_of(trainer, "low")[0]) + 1  # both experts train
    out = tmp_path / "run"
    task(compose_config([*BOTH, f"train.steps={steps}", f"output_dir={out}"]))
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == steps and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    ckpt = out / "checkpoints" / f"step-{steps:08d}"
    weights = load_file(str(ckpt / "trainable.safetensors"))
    for name in MODULE.values():  # both LoRAs trained: lora_B starts at zero
        b = [v for k, v in weights.items() if k.startswith(f"{name}.") and "lora_B" in k]
        assert b and any(bool(v.abs().sum() > 0) for v in b), name
    export = ckpt / "export"
    files = set(json.loads((export / "export.json").read_text())["files"])
    expected = {f"{stem}_{e}_noise.safetensors" for stem in ("pytorch_lora_weights", "lora_comfy") for e in ("high", "low")}
    assert expected <= files and all((export / f).is_file() for f in expected)
    comfy = {}
    for e in ("high", "low"):
        with safe_open(str(export / f"lora_comfy_{e}_noise.safetensors"), "pt") as f:
            comfy[e] = set(f.keys())
    assert comfy["high"] == comfy["low"] and all(k.startswith("diffusion_model.blocks.") for k in comfy["high"])

    cfg = compose_config(BOTH)
    run = resolve(cfg)
    set_seed(0)
    models = prepare_models(trainer.build_models("cpu"), cfg.model, run)
    pipe = WanPipeline(transformer=models["transformer"], transformer_2=models["transformer_2"], vae=models["vae"],
                       text_encoder=models["text_encoder"], tokenizer=trainer.default_tokenizer("tokenizer"),
                       scheduler=trainer.inference_scheduler(), boundary_ratio=A14B_BOUNDARY)

    def latents() -> torch.Tensor:
        return pipe(prompt="a red square", num_frames=5, height=16, width=16, num_inference_steps=8,
                    output_type="latent", generator=torch.Generator().manual_seed(0)).frames

    plain = latents()
    pipe.load_lora_weights(str(export), weight_name="pytorch_lora_weights_high_noise.safetensors")
    with_high = latents()
    pipe.load_lora_weights(str(export), weight_name="pytorch_lora_weights_low_noise.safetensors",
                           load_into_transformer_2=True, adapter_name="low_noise")
    with_both = latents()
    assert torch.isfinite(with_both).all()
    assert not torch.equal(plain, with_high) and not torch.equal(with_high, with_both)


def test_a_resumed_run_ends_on_the_uninterrupted_runs_loras(tmp_path) -> None:
    trainer = trainer_of()
    first_high = steps_of(trainer, "high")[0]
    steps = first_high + 2  # the resume starts before the high-noise expert's first step
    whole, part = tmp_path / "whole", tmp_path / "part"
    task(compose_config([*BOTH, f"train.steps={steps}", f"output_dir={whole}", "export.enabled=false"]))
    task(compose_config([*BOTH, f"train.steps={first_high}", f"output_dir={part}", "export.enabled=false"]))
    task(compose_config([*BOTH, f"train.steps={steps}", f"output_dir={part}", "export.enabled=false",
                         f"train.resume={part / 'checkpoints' / f'step-{first_high:08d}'}"]))
    a = load_file(str(whole / "checkpoints" / f"step-{steps:08d}" / "trainable.safetensors"))
    b = load_file(str(part / "checkpoints" / f"step-{steps:08d}" / "trainable.safetensors"))
    assert a.keys() == b.keys() and {k.split(".")[0] for k in a} == set(MODULE.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    # mode=export of the checkpoint (a fresh CPU build with its trained weights loaded) writes both experts' files
    from runner.export.checkpoint import export_checkpoint

    ckpt = part / "checkpoints" / f"step-{steps:08d}"
    export = export_checkpoint(compose_config([*BOTH, f"train.steps={steps}"]), ckpt)
    for e in ("high", "low"):
        exported = load_file(str(export / f"pytorch_lora_weights_{e}_noise.safetensors"))
        module = MODULE[e]
        trained = {k[len(module) + 1:]: v for k, v in b.items() if k.startswith(f"{module}.") and "lora_B" in k}
        assert trained and all(torch.equal(exported[f"transformer.{k.replace('.default', '')}"], v)
                               for k, v in trained.items())


def one_expert_file(folder) -> str:
    """One expert's transformer as a diffusers-layout single file (what model.path=<file> reads)."""
    from safetensors.torch import save_file

    path = str(folder / "expert.safetensors")
    set_seed(0)
    expert = trainer_of("trainer.experts=high").build_models("cpu")["transformer"]
    save_file({k: v.contiguous() for k, v in expert.state_dict().items() if "lora" not in k}, path)
    return path


@pytest.mark.parametrize(("overrides", "names"), [
    (["model.train=full"], ["model.train=full", "trainer.experts=high or low"]),
    (["sample.every=2"], ["sample.every=2", "trainer.experts=both"]),
    (["ema.enabled=true"], ["ema.enabled=true", "trainer.experts=both"]),
    (["dist=ddp"], ["dist=ddp is not built for trainer.experts=both"]),
    (["data.val_fraction=0.5"], ["data.val_fraction", "not built for trainer.experts=both"]),
    (["model.path=FILE"], ["is one file", "transformer_2/"]),
])
def test_what_both_experts_do_not_support_is_refused_before_step_1(overrides, names, tmp_path) -> None:
    if overrides == ["model.path=FILE"]:
        overrides = [f"model.path={one_expert_file(tmp_path)}"]
    with pytest.raises(UserError) as e:
        trainer_of(*overrides)
    assert all(n in str(e.value) for n in names), str(e.value)


@pytest.mark.parametrize("plugin", ["stream", "optimizer"])
def test_offloads_that_place_trained_weights_are_refused_with_both_experts(plugin) -> None:
    with pytest.raises(UserError, match=f"offload={plugin} is not built for trainer.experts=both"):
        trainer_of(f"offload=[park,{plugin}]")


def test_mode_fit_holds_the_parked_expert_against_the_host_ram(tmp_path, monkeypatch) -> None:
    """mode=fit plans the active expert's step; the parked expert's host bytes count against fit.host_ram_gb."""
    from bad_input import run_main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    common = ["mode=fit", *(o for o in BOTH if o != "train.device=cpu"), "budget_gb=1"]
    parked = int(plan_step(compose_config(common[1:])).notes["parked expert bytes"])
    r = run_main([*common, f"output_dir={tmp_path / 'roomy'}"])
    assert r.code == 0, r.text[-3000:]
    winner = json.loads((tmp_path / "roomy" / "fit.json").read_text())["winner"]
    assert winner is not None and winner["confirmed"] and winner["host_bytes"] >= parked
    run_main([*common, f"fit.host_ram_gb={parked / 2 / 2**30:.9f}", f"output_dir={tmp_path / 'tight'}"])
    assert json.loads((tmp_path / "tight" / "fit.json").read_text())["winner"] is None  # no setting leaves the host room
