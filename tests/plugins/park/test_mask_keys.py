"""The encoder cache with ``data.masks``: a latent entry holds its loss mask, so its key must follow the
mask. Turning masks on, or editing one mask, must never read an entry encoded without it (or with
the old one); text entries do not depend on masks and are shared."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from runner.parts import build_trainer
from runner.cli.compose import compose_config
from runner.checks import validate
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


@pytest.mark.parametrize("random_flip", [False, True])
def test_latent_keys_follow_the_references(tmp_path, random_flip):
    """``data.references`` (an edit trainer): a latent entry holds the references' latents too, so an edited
    reference changes its own target's keys (both orientations) and nothing else."""
    data = tmp_path / "data"
    (data / "control").mkdir(parents=True)
    for i, name in enumerate("abc"):
        Image.new("RGB", (40, 48), (40 * i, 100, 200)).save(data / f"{name}.png")
        (data / f"{name}.txt").write_text("make it red")
        Image.new("RGB", (40, 48), (100, 40 * i, 20)).save(data / "control" / f"{name}.png")
    cache = EncoderCache(tmp_path / "cache")
    edit = trainer(data, "trainer=flux_kontext", "data.references=1", f"data.random_flip={str(random_flip).lower()}")
    assert edit.encode_parts()["latents"].inputs == ("pixel_values", "references")
    before = plan_cache(edit, edit.dataset(), ["latents", "text"], cache, random_flip=random_flip)
    assert len(before.keys["latents"]) == 3 * (2 if random_flip else 1) == len(set(before.keys["latents"]))
    Image.new("RGB", (40, 48), (1, 2, 3)).save(data / "control" / "b.png")
    after = plan_cache(edit, edit.dataset(), ["latents", "text"], cache, random_flip=random_flip)
    changed = [i for i, (x, y) in enumerate(zip(before.keys["latents"], after.keys["latents"])) if x != y]
    assert changed == ([1, 4] if random_flip else [1])
    assert after.keys["text"] == before.keys["text"]
