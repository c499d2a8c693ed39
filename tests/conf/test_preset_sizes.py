"""Every preset's tiny run keeps the tiny model's data shape (64 px, a video family's own few frames); a video
preset's clip shape applies at model.size=full; a typed value is kept at tiny size. The time each tiny run takes
to its first step is bench/tiny_first_step.py's (docs/benchmarks.md)."""
from __future__ import annotations

from pathlib import Path

import pytest

from runner.cli.compose import compose_config

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "preset").glob("*.yaml"))
FULL_FRAMES = {"wan_24gb": 49, "wan22_5b_16gb": 49, "wan22_a14b_24gb": 49, "hunyuan_video15_24gb": 61,
               "ltx2_24gb": 121}  # the presets' clip lengths at full size; image presets have none


@pytest.mark.parametrize("preset", PRESETS)
def test_a_tiny_run_has_the_tiny_models_data_shape_and_full_size_the_presets(preset):
    tiny = compose_config([f"+preset={preset}"]).data
    full = compose_config([f"+preset={preset}", "model.size=full"]).data
    assert (tiny.frames, tiny.width, tiny.height, tiny.resolution) == (None, None, None, 64)
    assert full.frames == FULL_FRAMES.get(preset) and full.resolution >= 480
    if preset in FULL_FRAMES:
        assert full.width > 64 and full.height > 64


def test_a_typed_value_is_kept_at_tiny_size():
    data = compose_config(["+preset=wan_24gb", "data.frames=13", "data.width=96"]).data
    assert (data.frames, data.width, data.height) == (13, 96, None)
