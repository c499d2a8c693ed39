"""A parked module's calls align devices as accelerate's hooks do (plugins/park/align.py), on the
simulated card (``cuda_sim``), which raises CUDA's device-mismatch error where a GPU would."""
from __future__ import annotations

import pytest
import torch
from transformers import CLIPTextConfig, CLIPTextModel

from runner.side_streams import SIM_DEVICE
from runner.memory.cuda_sim import DEVICE_KEY, HOST_KEY, SimulatedCuda
from runner.plugins.park import park_module, unpark_module

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_clip() -> CLIPTextModel:
    torch.manual_seed(0)
    cfg = CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=8, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1)
    return CLIPTextModel(cfg).eval().requires_grad_(False)


def test_a_parked_encoder_takes_ids_where_its_parameters_say_and_answers_there():
    ids = torch.randint(0, 64, (2, 8))
    reference = tiny_clip()
    expect, embedded = reference(input_ids=ids).last_hidden_state, reference.embeddings(input_ids=ids)
    with SimulatedCuda(None) as card:
        encoder = tiny_clip()
        parked = park_module(encoder, SIM_DEVICE, "cpu", pin_memory=False)
        assert next(encoder.parameters()).device == torch.device("cpu")  # the weights are on the host between calls
        assert encoder.device == SIM_DEVICE and isinstance(encoder, CLIPTextModel)  # where its calls run
        # The common pattern: the ids sent to the parameters' device (the host). Without alignment
        # this stops in aten.embedding with CUDA's mismatch error.
        host_out = encoder(input_ids=ids.to(next(encoder.parameters()).device)).last_hidden_state
        assert card.tracker.place_of(host_out) == HOST_KEY  # back where the caller's ids were
        card_out = encoder(input_ids=ids.to(encoder.device)).last_hidden_state
        assert card.tracker.place_of(card_out) == DEVICE_KEY  # a caller on the card stays there
        # An inner module called directly (as Z-Image calls Qwen3's .model): aligned the same way.
        inner = encoder.embeddings(input_ids=ids)
        assert card.tracker.place_of(inner) == HOST_KEY and torch.equal(inner, embedded)
        assert torch.equal(host_out, expect) and torch.equal(card_out.cpu(), expect)
        assert parked.loads == 3 and parked.depth == 0
        unpark_module(encoder)
        assert type(encoder) is CLIPTextModel and encoder.device == torch.device("cpu")


def test_nested_inputs_move_and_containers_are_rebuilt_not_changed():
    from runner.plugins.park.align import first_device, send_to

    with SimulatedCuda(None):
        kwargs = {"a": [torch.zeros(2), (torch.ones(1), 3)], "b": {"c": torch.arange(2)}}
        moved = send_to(kwargs, SIM_DEVICE)
        assert first_device(kwargs) == torch.device("cpu") and first_device(moved) == SIM_DEVICE
        assert moved["a"][1][0].device == SIM_DEVICE and moved["b"]["c"].device == SIM_DEVICE and moved["a"][1][1] == 3
        assert kwargs["a"][0].device == torch.device("cpu")  # the caller's dict is untouched
        assert first_device({"x": 1}) is None
