"""plugins/park/loaded.py: a cache fill that needs a module this process built without weights stops
with a UserError naming ``offload.park.cache_dir``, before any module runs (several processes on one
node: only rank 0 loads the modules whose outputs are cached, runner/distributed/loading.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from runner.errors import UserError
from runner.plugins.park.cache import CachePlan
from runner.plugins.park.loaded import not_loaded, require_loaded
from runner.trainer import ModelSet

SPECS = {"text": SimpleNamespace(modules=("text_encoder",)), "latents": SimpleNamespace(modules=("vae",))}


def models() -> ModelSet:
    with torch.device("meta"):
        empty = nn.Linear(4, 4)  # built as a rank other than 0 builds a cache-only module
    return ModelSet({"text_encoder": empty, "vae": nn.Linear(4, 4), "unet": nn.Linear(4, 4)}, trained={"unet"})


def test_a_missing_entry_of_a_module_not_loaded_here_is_refused_with_the_key():
    plan = CachePlan(keys={"text": ["a", "b"], "latents": ["c", "d"]}, missing={"text": [1], "latents": []})
    with pytest.raises(UserError) as e:
        require_loaded(models(), SPECS, plan, "/tmp/cache-rank1", "offload.park.cache_dir")
    text = str(e.value)
    assert text.startswith("offload.park.cache_dir: 1 encoder cache entries are missing in /tmp/cache-rank1")
    assert "did not load text_encoder " in text and "set offload.park.cache_dir to a path all of them read" in text


def test_missing_entries_of_loaded_modules_and_a_complete_cache_pass():
    m = models()
    assert not_loaded(m["text_encoder"]) and not not_loaded(m["vae"])
    require_loaded(m, SPECS, CachePlan(keys={"latents": ["c"]}, missing={"latents": [0], "text": []}), "/c", "k")
    require_loaded(m, SPECS, CachePlan(keys={"text": ["a"]}, missing={"text": []}), "/c", "k")
    captions = CachePlan(keys={"text": ["a"]}, missing={"text": []}, missing_captions={"text": [""]})
    with pytest.raises(UserError, match="did not load text_encoder"):  # a caption-dropout entry ("") to encode
        require_loaded(m, SPECS, captions, "/c", "k")
