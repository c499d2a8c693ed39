"""Wan 2.2 A14B (trainer=wan trainer.variant=2.2-a14b): one run trains one of its two experts
(``trainer.experts=high|low``; both in one run: test_wan_experts.py).

The expert's transformer comes from its own subfolder of the diffusers folder, its timesteps stay
in its range of the noise schedule, the choice is required and refused elsewhere, and a LoRA of
it trains and loads into WanPipeline as that pipeline's (high-noise) transformer.
"""
from __future__ import annotations

import pytest
import torch
from accelerate.utils import set_seed

from runner.__main__ import task
from runner.parts import build_trainer, prepare_models
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.errors import UserError
from runner.families.wan.architecture import A14B_BOUNDARY
from runner.output.report import read_metrics
from runner.resolved import resolve

pytestmark = pytest.mark.usefixtures("one_thread")
A14B = ["trainer=wan", "trainer.variant=2.2-a14b", "data.frames=5", "train.device=cpu", "train.progress=false",
        "data.demo_size=2"]


def trainer_of(*overrides: str):
    cfg = compose_config([*A14B, *overrides])
    return build_trainer(cfg, resolve(cfg))


def test_each_experts_timesteps_are_the_familys_scaled_into_its_range() -> None:
    seeds = torch.arange(64)
    base = trainer_of("trainer.variant=14b").timesteps(seeds)
    high = trainer_of("trainer.experts=high").timesteps(seeds)
    low = trainer_of("trainer.experts=low").timesteps(seeds)
    assert bool((high >= A14B_BOUNDARY).all()) and bool((low < A14B_BOUNDARY).all())
    torch.testing.assert_close(high, A14B_BOUNDARY + (1 - A14B_BOUNDARY) * base)
    torch.testing.assert_close(low, A14B_BOUNDARY * base)


def test_the_low_noise_expert_is_read_from_transformer_2(tmp_path) -> None:
    """A diffusers folder as Wan2.2-T2V-A14B-Diffusers lays it out: each expert is read from its own folder."""
    cfg = compose_config([*A14B, "trainer.experts=high"])
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    folder = tmp_path / "Wan2.2-T2V-A14B"
    for seed, sub in ((1, "transformer"), (2, "transformer_2")):
        set_seed(seed)
        trainer.build_models("cpu")["transformer"].save_pretrained(folder / sub)
    models = {}
    for expert in ("high", "low"):
        t = trainer_of(f"trainer.experts={expert}", f"model.path={folder}")
        models[expert] = t.build_models("cpu")["transformer"].state_dict()
    for expert, sub in (("high", "transformer"), ("low", "transformer_2")):
        from diffusers import WanTransformer3DModel

        saved = WanTransformer3DModel.from_pretrained(folder / sub).state_dict()
        assert all(torch.equal(models[expert][k], saved[k]) for k in saved)
    assert not torch.equal(models["high"]["proj_out.weight"], models["low"]["proj_out.weight"])
    # the boundary is the folder's (Wan2.2-I2V-A14B ships 0.9), else 0.875
    (folder / "model_index.json").write_text('{"_class_name": "WanPipeline", "boundary_ratio": 0.9}')
    low = trainer_of("trainer.experts=low", f"model.path={folder}")
    assert low.boundary == 0.9 and float(low.timesteps(torch.arange(64)).max()) < 0.9
    with pytest.raises(UserError, match="no 'transformer_2/' subfolder"):
        (tmp_path / "one").mkdir()
        (folder / "transformer").rename(tmp_path / "one" / "transformer")
        trainer_of("trainer.experts=low", f"model.path={tmp_path / 'one'}")


@pytest.mark.parametrize(("overrides", "names"), [
    ([], ["trainer.variant=2.2-a14b needs trainer.experts=both, high or low", "transformer_2/"]),
    (["trainer.experts=middle"], ["not 'middle'"]),
    (["trainer.variant=14b", "trainer.experts=high"], ["trainer.experts=high applies to trainer.variant=2.2-a14b only"]),
    (["trainer.variant=14b", "trainer.experts=both"], ["trainer.experts=both applies to trainer.variant=2.2-a14b only"]),
])
def test_the_expert_is_required_and_refused_elsewhere(overrides, names) -> None:
    with pytest.raises(UserError) as e:
        trainer_of(*overrides)
    assert all(n in str(e.value) for n in names), str(e.value)


def test_a_lora_of_the_high_noise_expert_trains_and_loads_into_wan_pipeline(tmp_path) -> None:
    from diffusers import WanPipeline

    out = tmp_path / "run"
    task(compose_config([*A14B, "trainer.experts=high", "model.train=lora", "train.steps=3", f"output_dir={out}"]))
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    export = next(out.rglob("pytorch_lora_weights.safetensors"))
    cfg = compose_config([*A14B, "trainer.experts=high"])
    run = resolve(cfg)
    trainer = build_trainer(cfg, run)
    set_seed(0)
    models = prepare_models(trainer.build_models("cpu"), cfg.model, run)
    pipe = WanPipeline(transformer=models["transformer"], vae=models["vae"], text_encoder=models["text_encoder"],
                       tokenizer=trainer.default_tokenizer("tokenizer"), scheduler=trainer.inference_scheduler())
    def latents() -> torch.Tensor:
        return pipe(prompt="a red square", num_frames=5, height=16, width=16, num_inference_steps=2,
                    output_type="latent", generator=torch.Generator().manual_seed(0)).frames

    before = latents()
    pipe.load_lora_weights(str(export.parent))
    after = latents()
    assert torch.isfinite(after).all() and not torch.equal(before, after)


def test_the_preset_composes_and_validates() -> None:
    cfg = compose_config(["+preset=wan22_a14b_24gb"])
    validate(cfg)
    assert (cfg.trainer.variant, cfg.trainer.experts) == ("2.2-a14b", "both")
    low = compose_config(["+preset=wan22_a14b_24gb", "trainer.experts=low"])
    assert low.trainer.experts == "low"
    assert "variant" not in compose_config(["+preset=wan22_a14b_24gb", "trainer=sdxl"]).trainer  # any trainer
