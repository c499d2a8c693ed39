"""Configs are tested by composing them: every preset, every error a user is likely to make."""
from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from runner.cli.compose import compose_config, expand_sweeps, precheck
from runner.checks import validate
from runner.errors import UserError
from runner.files import conf_dir

PRESETS = sorted(p.stem for p in (conf_dir() / "preset").glob("*.yaml"))


def test_presets_shipped():
    assert {"sdxl_24gb", "flux_24gb", "flux_kontext_24gb", "constrained"} <= set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_and_validates(preset):
    cfg = compose_config([f"+preset={preset}"])
    validate(cfg)
    assert cfg.preset == preset
    # the budget a preset's name states (sd15_8gb: 8 GiB); constrained is the 12 GB one
    named = re.search(r"_(\d+)gb", preset)
    assert cfg.budget_gb == (12 if preset == "constrained" else int(named.group(1)))
    for kind in ("allocator", "quantization", "offload", "checkpoint", "tiling"):
        for name, node in cfg[kind].items():  # each selected plugin's node, at <kind>.<name>
            assert node.name == name, (kind, name)


def test_default_config_is_tiny_sdxl():
    cfg = compose_config([])
    validate(cfg)
    assert cfg.model.size == "tiny"
    assert cfg.trainer._target_.endswith("SDXLTrainer")
    assert not cfg.checkpoint and not cfg.offload  # no plugin of either kind selected


def test_overrides_reach_every_public_key():
    cfg = compose_config(["+preset=sdxl_24gb", "train.steps=7", "model.size=full", "budget_gb=10.5",
                          "checkpoint.blocks.every_n=3", "checkpoint.blocks.mode=every_n"])
    assert (cfg.train.steps, cfg.model.size, cfg.budget_gb) == (7, "full", 10.5)
    assert cfg.checkpoint.blocks.every_n == 3 and cfg.checkpoint.blocks.mode == "every_n"


def test_preset_picks_plugins_and_cli_can_change_them():
    assert list(compose_config(["+preset=sdxl_24gb"]).checkpoint) == ["blocks"]
    assert list(compose_config(["+preset=sdxl_24gb", "checkpoint=none"]).checkpoint) == []
    assert compose_config(["+preset=flux_24gb"]).trainer._target_.endswith("FluxTrainer")


def test_misspelled_key_suggests_the_closest():
    with pytest.raises(UserError) as e:
        compose_config(["train.stepz=3"])
    msg = str(e.value)
    assert "train.stepz" in msg and "Did you mean 'steps'" in msg


def test_misspelled_plugin_param_suggests_within_the_chosen_plugin():
    with pytest.raises(UserError) as e:
        compose_config(["checkpoint=blocks", "checkpoint.blocks.every_m=2"])
    assert "checkpoint.blocks.every_m" in str(e.value) and "every_n" in str(e.value)


def test_wrong_type_names_the_key():
    with pytest.raises(UserError) as e:
        compose_config(["train.steps=many"])
    assert "train.steps" in str(e.value) and "many" in str(e.value)


def test_unknown_plugin_lists_valid_names_closest_first():
    with pytest.raises(UserError) as e:
        compose_config(["checkpoint=blokcs"])
    msg = str(e.value)
    assert "blokcs" in msg and "Valid names: blocks" in msg


def test_unknown_preset_and_trainer():
    with pytest.raises(UserError, match="sdxl_24gb"):
        compose_config(["+preset=sdxl_24"])
    with pytest.raises(UserError, match="Valid names: sdxl"):
        compose_config(["trainer=sdx"])


@pytest.mark.parametrize(
    "override, key",
    [("model.size=huge", "model.size"), ("train.mixed_precision=fp8", "train.mixed_precision"),
     ("train.steps=0", "train.steps"), ("train.grad_accum=3", "train.grad_accum"),
     ("model.train=dora", "model.train"), ("budget_gb=-1", "budget_gb"), ("mode=fly", "mode")],
)
def test_semantic_errors_name_the_key(override, key):
    with pytest.raises(UserError) as e:
        validate(compose_config([override]))
    assert key in str(e.value)


def test_sweep_expansion_checks_every_combination():
    combos = expand_sweeps(["+preset=sdxl_24gb,constrained", "train.steps=1,2"])
    assert len(combos) == 4
    precheck(["+preset=sdxl_24gb,constrained", "train.steps=2"], multirun=True)
    with pytest.raises(UserError, match="train.steps"):
        precheck(["train.steps=2,abc"], multirun=True)


def test_resolved_config_is_plain_yaml():
    cfg = compose_config(["+preset=constrained"])
    text = OmegaConf.to_yaml(cfg, resolve=True)
    assert "constrained" in text and "budget_gb: 12" in text


@pytest.mark.parametrize("overrides, resolution", [
    ([], 64),                                          # tiny models train at 64 px
    (["model.size=full"], 1024),                       # full size plans/trains SDXL's and Flux's 1024 px
    (["+preset=flux_24gb", "model.size=full"], 1024),
    (["model.size=full", "data.resolution=512"], 512),  # an explicit value wins
    (["trainer=sd15", "model.size=full"], 512),         # a trainer's own native size: SD1.5 at 512 px
    (["trainer=sd15", "trainer.variant=sd21", "model.size=full"], 768),  # SD2.1 at 768 px
    (["trainer=sd35", "model.size=full"], 1024),
    (["trainer=sd15"], 64),
])
def test_data_resolution_follows_model_size_unless_set(overrides, resolution):
    cfg = compose_config(overrides)
    validate(cfg)
    assert cfg.data.resolution == resolution
    assert OmegaConf.to_container(cfg, resolve=True)["data"]["resolution"] == resolution


def test_a_preset_key_the_chosen_plugin_lacks_names_the_preset_and_the_choice():
    # flux_24gb sets offload.park.cache_latents; offload=none selects no park plugin to take it.
    # (constrained no longer sets a plugin key: the quantization default skips what it used to list.)
    with pytest.raises(UserError, match=r"preset flux_24gb sets offload\.park\.cache_latents, but offload=park is "
                                        r"not selected \(offload=none\)"):
        validate(compose_config(["+preset=flux_24gb", "offload=none"]))
