"""model.path as users have their models: a hub id from the local hub cache, a diffusers folder,
an original single file (A1111/ComfyUI SDXL, Black Forest Labs' and ComfyUI's Flux).

Files are written from the tiny models by tests/original_layouts.py (the original key layouts,
written independently of the diffusers converters the loader uses), loaded back through the
trainer, and compared with the source weights bit for bit. The hub cache is a folder laid out as
huggingface_hub lays it out (refs/, snapshots/<commit>/ of symlinks, blobs/), built from the tiny
model's saved pipeline; HF_HUB_CACHE points at it. Nothing is downloaded.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate.utils import set_seed
from original_layouts import (
    COMMIT,
    clip_to_original,
    flux_to_original,
    hub_cache,
    sdxl_original,
    vae_to_original,
    write_sparse_safetensors,
)
from safetensors.torch import save_file

from runner.parts import build_trainer
from runner.cli.compose import compose_config
from runner.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

def trainer(*overrides: str):
    return build_trainer(compose_config(list(overrides)))


@pytest.fixture(scope="module")
def sdxl_models():
    t = trainer("trainer=sdxl")
    set_seed(0)
    return t, t.build_models("cpu")


def assert_same_weights(a, b, names) -> None:
    for name in names:
        sa, sb = a[name].state_dict(), b[name].state_dict()
        assert sa.keys() == sb.keys(), (name, sorted(set(sa) ^ set(sb))[:5])
        bad = [k for k in sa if not torch.equal(sa[k], sb[k])]
        assert not bad, (name, bad[:3])


# ---- hub ids -----------------------------------------------------------------------------------------
def test_hub_id_resolves_from_the_local_cache(sdxl_models, tmp_path, monkeypatch):
    t, models = sdxl_models
    pipeline_folder = tmp_path / "saved"
    t.pipeline(models).save_pretrained(pipeline_folder)
    cache = tmp_path / "hub"
    hub_cache(cache, "tiny-org/tiny-sdxl", pipeline_folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for spec in ("tiny-org/tiny-sdxl", "tiny-org/tiny-sdxl@main", f"tiny-org/tiny-sdxl@{COMMIT}"):
        loaded = trainer("trainer=sdxl", f"model.path={spec}")
        assert loaded.source == ("folder", str(cache / "models--tiny-org--tiny-sdxl" / "snapshots" / COMMIT))
        assert_same_weights(models, loaded.build_models("cpu"), models.modules)
    assert loaded.tokenizer("tokenizer_2").model_max_length == t.tokenizer("tokenizer_2").model_max_length


def test_an_uncached_hub_id_names_the_command_that_fetches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(UserError) as e:
        trainer("trainer=sdxl", "model.path=stabilityai/stable-diffusion-xl-base-1.0@v1.0")
    text = str(e.value)
    assert "hf download stabilityai/stable-diffusion-xl-base-1.0 --revision v1.0" in text
    assert "huggingface-cli download" in text and str(tmp_path / "empty") in text
    with pytest.raises(UserError) as e:  # not an id (three parts): a missing path
        trainer("trainer=sdxl", "model.path=no/such/folder")
    assert "does not exist" in str(e.value)


# ---- original single files: SDXL ------------------------------------------------------------------------
def test_sdxl_original_single_file_loads_every_module(sdxl_models, tmp_path, caplog):
    t, models = sdxl_models
    file = tmp_path / "sd_xl_tiny.safetensors"
    state = sdxl_original(models, t.size_configs())
    assert any(k.startswith("model.diffusion_model.input_blocks.") for k in state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(file))
    caplog.set_level("INFO", logger="runner")
    loaded = trainer("trainer=sdxl", f"model.path={file}")
    assert loaded.layout.family == "sdxl" and all(loaded.file_provides(n) for n in models.modules)
    assert_same_weights(models, loaded.build_models("cpu"), models.modules)
    assert "unet, vae, text_encoder, text_encoder_2 in the original SDXL layout" in caplog.text
    # the planner's build: shapes checked from the header, nothing read
    meta = loaded.build_models("meta")
    assert all(p.device.type == "meta" for p in meta["unet"].parameters())
    # loaded in the run's dtype, converted tensor by tensor
    bf16 = trainer("trainer=sdxl", f"model.path={file}", "model.dtype=bfloat16", "model.train=lora")
    m = bf16.build_models("cpu")
    assert m["text_encoder_2"].text_model.final_layer_norm.weight.dtype == torch.bfloat16
    assert torch.equal(m["vae"].decoder.conv_out.weight, models["vae"].decoder.conv_out.weight.to(torch.bfloat16))
    # the encoder cache knows these encoders come from the file
    assert t.module_source("vae")["random_init"] and bf16.module_source("vae")["file"] == str(file)


def test_sdxl_single_file_with_a_unet_only(sdxl_models, tmp_path, caplog):
    t, models = sdxl_models
    from original_layouts import unet_to_original

    file = tmp_path / "unet_only.safetensors"
    save_file({k: v.contiguous() for k, v in unet_to_original(models["unet"].state_dict(), t.size_configs()["unet"]).items()},
              str(file))
    loaded = trainer("trainer=sdxl", f"model.path={file}")
    built = loaded.build_models("cpu")
    assert_same_weights(models, built, ["unet"])
    assert "holds no vae: vae is randomly initialised" in caplog.text


@pytest.fixture(scope="module")
def full_sdxl_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("full") / "sd_xl_base_1.0.safetensors"
    write_full_sdxl(path)
    return path


def test_wrong_size_or_family_is_refused_before_reading_weights(sdxl_models, full_sdxl_file, tmp_path):
    t, models = sdxl_models
    file = tmp_path / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in sdxl_original(models, t.size_configs()).items()}, str(file))
    with pytest.raises(UserError) as e:
        trainer("trainer=flux", f"model.path={file}", "data.resolution=32")
    assert "not a flux checkpoint" in str(e.value) and "original SDXL layout" in str(e.value)
    # a full-size file (sparse: shapes only) read as the tiny architecture
    with pytest.raises(UserError) as e:
        trainer("trainer=sdxl", f"model.path={full_sdxl_file}", "model.train=lora").build_models("meta")
    assert "tensors of another shape" in str(e.value) and "set model.size=full" in str(e.value)


def write_full_sdxl(path: Path) -> None:
    """The full-size SDXL checkpoint's header (A1111 layout, fp16), all zeros, in no disk space."""
    from runner.families.sdxl.architecture import sdxl_configs

    t = trainer("trainer=sdxl", "model.size=full")
    models = t.build_models("meta")
    state = sdxl_original(models, sdxl_configs("full"))
    write_sparse_safetensors(path, {k: (tuple(v.shape), torch.float16) for k, v in state.items()})


def test_full_size_single_file_needs_the_reference_tokenizers(full_sdxl_file, tmp_path, monkeypatch):
    full = full_sdxl_file
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UserError) as e:
        trainer("trainer=sdxl", "model.size=full", f"model.path={full}")
    assert ('hf download stabilityai/stable-diffusion-xl-base-1.0 --include "tokenizer/*" "tokenizer_2/*"'
            in str(e.value))
    # with the tokenizers in the cache (here: the tiny model's, saved as the reference repo's folders)
    tokenizers = tmp_path / "tokenizers"
    tiny = trainer("trainer=sdxl")
    for name in ("tokenizer", "tokenizer_2"):
        tiny.tokenizer(name).save_pretrained(tokenizers / name)
    hub_cache(tmp_path / "hub", "stabilityai/stable-diffusion-xl-base-1.0", tokenizers)
    t = trainer("trainer=sdxl", "model.size=full", f"model.path={full}", "model.train=lora")
    assert t.tokenizer("tokenizer").model_max_length == 77
    models = t.build_models("meta")  # every module checked against the file's header on meta
    assert sum(p.numel() for p in models["unet"].parameters()) > 2_500_000_000


# ---- original single files: Flux ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def flux_models():
    t = trainer("trainer=flux", "data.resolution=32")
    set_seed(0)
    return t, t.build_models("cpu")


def test_flux_bfl_transformer_file(flux_models, tmp_path, caplog):
    t, models = flux_models
    file = tmp_path / "flux1-tiny.safetensors"
    save_file({k: v.contiguous() for k, v in flux_to_original(models["transformer"].state_dict()).items()}, str(file))
    loaded = trainer("trainer=flux", "data.resolution=32", f"model.path={file}")
    built = loaded.build_models("cpu")
    assert_same_weights(models, built, ["transformer"])
    assert "holds no vae" in caplog.text


def test_comfyui_all_in_one_flux_file(flux_models, tmp_path):
    t, models = flux_models
    state = flux_to_original(models["transformer"].state_dict(), "model.diffusion_model.")
    state.update(vae_to_original(models["vae"].state_dict(), t.size_configs()["vae"], "vae."))
    clip = {k: v for k, v in models["text_encoder"].state_dict().items() if not k.endswith("position_ids")}
    state.update(clip_to_original(clip, "text_encoders.clip_l.transformer."))
    state.update({"text_encoders.t5xxl.transformer." + k: v for k, v in models["text_encoder_2"].state_dict().items()
                  if k != "encoder.embed_tokens.weight"})  # stored once, as shared.weight
    file = tmp_path / "flux_aio.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(file))
    built = trainer("trainer=flux", "data.resolution=32", f"model.path={file}").build_models("cpu")
    assert_same_weights(models, built, models.modules)
    t5 = built["text_encoder_2"]
    assert t5.shared.weight is t5.encoder.embed_tokens.weight  # tied again


def test_our_flux_conversion_equals_diffusers_at_full_width():
    """diffusers' converter hard-codes FLUX.1's width; ours reads it from the config. On the full-size
    layout (two blocks of each kind, 3 columns per tensor: the converters split rows only) they agree."""
    import diffusers
    from diffusers.loaders.single_file_utils import (
        convert_flux_transformer_checkpoint_to_diffusers,
    )

    from runner.families.common.single_file import convert_flux_transformer
    from runner.families.flux.architecture import flux_configs

    config = {**flux_configs("full")["transformer"], "num_layers": 2, "num_single_layers": 2}
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in diffusers.FluxTransformer2DModel.from_config(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    narrow = {k: torch.randn((s[0], 3) if len(s) > 1 else (s[0],), generator=g) for k, s in shapes.items()}
    original = flux_to_original(narrow)
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(original))
    ours = convert_flux_transformer(dict(original), config, None)
    assert sorted(ours) == sorted(theirs) == sorted(narrow)
    assert all(torch.equal(ours[k], theirs[k]) and torch.equal(ours[k], narrow[k]) for k in ours)


def test_a_folder_unet_read_tensor_by_tensor_into_its_empty_build_equals_from_pretrained(sdxl_models, tmp_path):
    """dist=fsdp's sharded load (runner/distributed/loading.py) in one process: the U-Net of a diffusers folder
    (saved in bfloat16, as 3+ safetensors shards with an index) built empty (parameters on meta, buffers
    real) and filled from the files named by ``weight_files`` equals ``from_pretrained``'s load, tensor
    for tensor and dtype for dtype (here every rank would read only its rows of the same tensors)."""
    import copy

    from runner.distributed.loading import _read_slices, materialize

    t, models = sdxl_models
    folder = tmp_path / "saved"
    t.pipeline(models).save_pretrained(folder)
    unet = copy.deepcopy(models["unet"])
    torch.nn.Module.to(unet, torch.bfloat16).save_pretrained(folder / "unet", max_shard_size="500KB")
    loaded = trainer("trainer=sdxl", f"model.path={folder}", "model.train=full")
    files = loaded.weight_files("unet")
    assert len({f for f, _ in files.values()}) >= 3
    reference = loaded.build_models("cpu")["unet"]
    assert set(files) == set(reference.state_dict())
    loaded.empty_modules = frozenset({"unet"})
    empty = loaded.build_models("cpu")["unet"]
    assert all(p.is_meta for p in empty.parameters()) and not any(b.is_meta for b in empty.buffers())
    materialize(empty, torch.device("cpu"))
    _read_slices(empty, files)
    assert_same_weights({"unet": reference}, {"unet": empty}, ["unet"])
    assert [p.dtype for p in empty.parameters()] == [p.dtype for p in reference.parameters()]
