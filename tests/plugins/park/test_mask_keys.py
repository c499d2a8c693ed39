"""The encoder cache with ``data.masks``: a latent entry holds its loss mask, so its key must follow the
mask. Turning masks on, or editing one mask, must never read an entry encoded without it (or with
the old one); text entries do not depend on masks and are shared."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from runner.build import build_trainer
from runner.cli.compose import compose_config
from runner.config.checks import validate
from runner.plugins.park.cache import EncoderCache, plan_cache
from runner.resolved import resolve

pytestmark = pytest.mark.usefixtures("one_thread")


def trainer(data: Path, *overrides: str):
    cfg = compose_config([f"data.path={data}", "data.resolution=32", "train.device=cpu", *overrides])
    validate(cfg)
    return build_trainer(cfg, resolve(cfg))


def write(root: Path) -> None:
    (root / "masks").mkdir(parents=True)
    for i, name in enumerate("abc"):
        Image.new("RGB", (40, 48), (40 * i, 100, 200)).save(root / f"{name}.png")
        (root / f"{name}.txt").write_text("a cat")
        mask = np.zeros((48, 40), dtype=np.uint8)
        mask[: 10 + 5 * i, :20] = 255
        Image.fromarray(mask, "L").save(root / "masks" / f"{name}.png")


@pytest.mark.parametrize("random_flip", [False, True])
def test_latent_keys_follow_the_masks(tmp_path, random_flip):
    data = tmp_path / "data"
    write(data)
    cache = EncoderCache(tmp_path / "cache")
    flip = [f"data.random_flip={str(random_flip).lower()}"]
    plain = trainer(data, "data.missing_caption=empty", *flip)  # without data.masks, masks/ holds images
    masked = trainer(data, "data.masks=true", *flip)
    assert masked.encode_parts()["latents"].inputs == ("pixel_values", "mask")
    off = plan_cache(plain, plain.dataset(), ["latents", "text"], cache, random_flip=random_flip)
    on = plan_cache(masked, masked.dataset(), ["latents", "text"], cache, random_flip=random_flip)
    assert len(on.keys["latents"]) == 3 * (2 if random_flip else 1) == len(set(on.keys["latents"]))
    assert set(on.keys["latents"]).isdisjoint(off.keys["latents"])  # masks on: no entry without a mask is read
    # the text part reads no mask; the plain run's folder has 3 more "images" (the masks), the masked run's 3
    assert on.keys["text"][0] in off.keys["text"]
    # an edited mask changes its own image's latent keys only (both orientations)
    mask = np.array(Image.open(data / "masks" / "b.png"))
    mask[-1, -1] = 255
    Image.fromarray(mask, "L").save(data / "masks" / "b.png")
    again = plan_cache(masked, masked.dataset(), ["latents", "text"], cache, random_flip=random_flip)
    changed = [i for i, (x, y) in enumerate(zip(on.keys["latents"], again.keys["latents"])) if x != y]
    assert changed == ([1, 4] if random_flip else [1])
    assert again.keys["text"] == on.keys["text"]
