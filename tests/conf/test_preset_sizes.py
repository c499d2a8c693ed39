"""A video preset's clip shape applies at model.size=full; a tiny run keeps the tiny model's unless typed."""
from __future__ import annotations

import pytest

from runner.cli.compose import compose_config


@pytest.mark.parametrize("preset", ["wan_24gb", "wan22_5b_16gb", "wan22_a14b_24gb"])
def test_the_clip_shape_follows_the_model_size(preset):
    tiny = compose_config([f"+preset={preset}"]).data
    full = compose_config([f"+preset={preset}", "model.size=full"]).data
    assert (tiny.frames, tiny.width, tiny.height) == (None, None, None)
    assert full.frames == 49 and full.width > 64 and full.height > 64


def test_a_typed_value_is_kept_at_tiny_size():
    data = compose_config(["+preset=wan_24gb", "data.frames=13", "data.width=96"]).data
    assert (data.frames, data.width, data.height) == (13, 96, None)
