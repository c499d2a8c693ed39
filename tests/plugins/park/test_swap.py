"""offload=park's swap: a parked module's weights stay on the host and are on the device only for its
calls (root or inner model), with no copy back; tied weights swapped once; hosted mode parks too.

"device" on this CPU-only machine is either the CPU itself (same code path, no copies) or ``meta``,
which stands in for a second device where a test must see weights arrive and leave; the CUDA test
runs on a GPU only. (Split from test_park.py, which keeps the encoder cache's runs and keys.)
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.module_changes import marked
from runner.memory.live_bytes import LiveBytesTracker
from runner.plugins.park import park_module, unpark_module

# One intra-op thread (tests/conftest.py): faster tiny ops, bitwise-reproducible runs.
pytestmark = pytest.mark.usefixtures("one_thread")


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])



def tiny_vae():
    from diffusers import AutoencoderKL

    from runner.families.sdxl.architecture import sdxl_configs

    torch.manual_seed(0)
    return AutoencoderKL.from_config(sdxl_configs("tiny")["vae"]).eval().requires_grad_(False)


def test_park_swaps_weights_onto_the_device_only_for_the_call():
    """``meta`` plays the device: weights appear there for the call and leave with no copy back."""
    vae = tiny_vae()
    host_ptrs = {n: p.data_ptr() for n, p in vae.named_parameters()}
    weight_bytes = module_bytes(vae)
    parked = park_module(vae, "meta")
    seen = {}
    vae.encoder.conv_in.register_forward_pre_hook(lambda m, a: seen.update(device=m.weight.device))
    tracker = LiveBytesTracker()
    assert tracker.track(vae, "weights") == weight_bytes  # the host copies
    with tracker:
        out = vae.encode(torch.zeros(1, 3, 32, 32, device="meta")).latent_dist.mean  # not via forward()
        during = tracker.peak_bytes("meta")
        del out
    assert seen["device"].type == "meta" and parked.loads == 1
    assert during >= weight_bytes  # every weight was on the device during the call
    assert tracker.current_bytes("meta") == 0  # ... and none after it
    assert tracker.current_bytes("cpu") == weight_bytes  # no device-to-host copy: no new host storage
    assert {n: p.data_ptr() for n, p in vae.named_parameters()} == host_ptrs
    assert all(p.device.type == "cpu" for p in vae.parameters())

    vae(torch.zeros(1, 3, 32, 32, device="meta"))  # forward -> encode -> decode: one move in
    assert parked.loads == 2 and parked.depth == 0
    unpark_module(vae)
    assert not {"forward", "encode", "decode"} & set(vae.__dict__)


def test_an_inner_model_called_directly_gets_its_weights_on_the_device():
    """Z-Image calls Qwen3's ``.model`` (no LM head), Qwen-Image ``.model.language_model``: not the
    parked root's forward. Its weights must be on the device for that call too (on a GPU the call
    would otherwise mix host weights with device inputs), and leave it afterwards."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    qwen = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8)).eval()
    qwen.requires_grad_(False)
    parked = park_module(qwen, "meta")
    seen = {}
    qwen.model.layers[0].register_forward_pre_hook(lambda m, a: seen.update(device=m.mlp.up_proj.weight.device))
    out = qwen.model(input_ids=torch.zeros(1, 4, dtype=torch.long, device="meta")).last_hidden_state
    assert out.device.type == "meta" and seen["device"].type == "meta" and parked.loads == 1 and parked.depth == 0
    assert all(p.device.type == "cpu" for p in qwen.parameters())
    qwen(input_ids=torch.zeros(1, 4, dtype=torch.long, device="meta"))  # the root: one move in, inner calls nest
    assert parked.loads == 2 and parked.depth == 0
    parked.remove()
    qwen.model(input_ids=torch.zeros(1, 4, dtype=torch.long))  # hooks gone: no move
    assert parked.loads == 2


def test_park_on_cpu_is_the_same_path_and_exact():
    vae = tiny_vae()
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        ref = vae.encode(x).latent_dist.mean
        parked = park_module(vae, "cpu")
        out = vae.encode(x).latent_dist.mean
    assert parked.loads == 1 and torch.equal(ref, out)
    parked.remove()
    with pytest.raises(ValueError, match="frozen"):
        park_module(nn.Linear(2, 2), "cpu")


def test_tied_weights_are_swapped_once():
    from transformers import T5Config, T5EncoderModel

    t5 = T5EncoderModel(T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)).eval()
    t5.requires_grad_(False)
    assert t5.shared.weight is t5.encoder.embed_tokens.weight
    parked = park_module(t5, "cpu")
    assert sum(t is t5.shared.weight for t, _ in parked.swapped) == 1
    parked.remove()


def test_hosted_mode_parks_frozen_modules(tmp_path):
    from runner.hosted import session

    run = session(["offload=park", "offload.park.cache_latents=false", "offload.park.cache_text=false",
                   "train.device=cpu"], output_dir=tmp_path)
    ctx = run.ctx
    denoiser, frozen = nn.Linear(4, 4), tiny_vae()
    models, _, _ = run.prepare({"denoiser": denoiser, "vae": frozen})
    assert ctx.facts.parked == {"vae"} and "vae" in ctx.facts.placed
    assert ctx.facts.encode_on_device is False  # no trainer: nothing is encoded by the runner
    frozen.encode(torch.zeros(1, 3, 16, 16))
    assert marked(frozen, "park").loads == 1
    run.finish()
    assert "encode" not in frozen.__dict__ and marked(frozen, "park") is None


# ---- CUDA -------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_park_on_cuda_holds_weights_only_during_the_call():
    vae = tiny_vae()
    nbytes = module_bytes(vae)
    parked = park_module(vae, "cuda", pin_memory=True)
    assert all(p.is_pinned() for p in vae.parameters())
    host_ptrs = [p.data_ptr() for p in vae.parameters()]  # the pinned copies, made once
    x = torch.rand(1, 3, 64, 64, device="cuda")
    with torch.no_grad():  # warm-up: cuBLAS/cuDNN allocate their workspaces on first use
        vae.encode(x)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    during = {}
    vae.encoder.conv_in.register_forward_pre_hook(lambda m, a: during.update(bytes=torch.cuda.memory_allocated()))
    with torch.no_grad():
        out = vae.encode(x).latent_dist.mean
    torch.cuda.synchronize()
    assert out.device.type == "cuda" and parked.loads == 2
    assert during["bytes"] - before >= nbytes
    del out
    assert torch.cuda.memory_allocated() == before  # the device copies are gone
    assert all(p.device.type == "cpu" for p in vae.parameters())
    assert [p.data_ptr() for p in vae.parameters()] == host_ptrs  # swapped back, not copied back
    parked.remove()
