"""log.tracker through accelerate: a real TensorBoard event file, read back; validation of the key."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import tensorboard  # noqa: E402,F401  (the test extra installs it: a missing TensorBoard fails, not skips)
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from runner.__main__ import task
from runner.cli.compose import compose_config
from runner.checks import validate
from runner.errors import UserError
from runner.output.report import read_metrics
from runner.output.trackers import NoTracking, flat_hparams


def read_events(folder: Path) -> EventAccumulator:
    files = sorted(folder.glob("events.out.tfevents.*"))  # hparams go to a subfolder of their own
    assert files, f"no TensorBoard event file under {folder}"
    acc = EventAccumulator(str(files[0].parent), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_gets_every_metrics_row_the_config_and_images(tmp_path):
    cfg = compose_config([f"output_dir={tmp_path}", "train.progress=false", "train.steps=3", "train.batch_size=1",
                          "log.tracker=tensorboard", "log.project=proj", "train.preflight=false"])
    task(cfg)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    acc = read_events(tmp_path / "tracker" / "proj")
    losses = acc.Scalars("loss")
    assert [e.step for e in losses] == [1, 2, 3]
    for event, row in zip(losses, rows):
        assert math.isclose(event.value, row["loss"], rel_tol=1e-6)  # float32 in the event file
    assert [e.value for e in acc.Scalars("samples_seen")] == [1.0, 2.0, 3.0]
    assert "memory_peak_gb" not in acc.Tags()["scalars"]  # None on CPU: not logged as a number
    config_text = acc.Tensors("resolved_config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "steps: 3" in config_text and "tracker: tensorboard" in config_text


def test_log_images_writes_the_pixels(tmp_path):
    from accelerate import Accelerator

    from runner.output.trackers import AccelerateTracking

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    tracking = AccelerateTracking(accelerator, "p", {"a": {"b": [1, 2]}})
    pixels = np.zeros((8, 12, 3), dtype=np.uint8)
    pixels[:, :6] = (255, 0, 0)
    tracking.log_images(5, {"sample/cat": Image.fromarray(pixels)})
    tracking.close()
    acc = read_events(tmp_path / "p")
    (image,) = acc.Images("sample/cat")
    assert (image.step, image.width, image.height) == (5, 12, 8)
    decoded = np.asarray(Image.open(__import__("io").BytesIO(image.encoded_image_string)).convert("RGB"))
    assert np.array_equal(decoded, pixels)


def test_flat_hparams_are_scalars():
    assert flat_hparams({"train": {"steps": 3, "lr": float("nan")}, "model": {"targets": ["q", "k"]}, "x": None}) == {
        "train.steps": 3, "train.lr": "nan", "model.targets": "['q', 'k']", "x": None}


def test_no_tracker_is_a_no_op_and_writes_nothing(tmp_path):
    cfg = compose_config([f"output_dir={tmp_path}", "train.progress=false", "train.steps=1", "train.batch_size=1",
                          "train.preflight=false"])
    task(cfg)
    assert not (tmp_path / "tracker").exists()
    NoTracking().log_images(1, {"a": Image.new("RGB", (2, 2))})  # callable without a tracker


def test_unknown_tracker_names_the_valid_ones():
    with pytest.raises(UserError, match=r"log.tracker='tensorbord'.*Valid: tensorboard"):
        validate(compose_config(["log.tracker=tensorbord"]))


@pytest.mark.parametrize("name, package", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_missing_tracker_package_is_a_user_error(name, package):
    import importlib.util

    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed here")
    with pytest.raises(UserError, match=rf"log.tracker={name} needs the Python package '{package}'.*pip install {package}"):
        validate(compose_config([f"log.tracker={name}"]))


def test_samples_reach_the_tracker(tmp_path):
    """sample.every with log.tracker: each sample image is logged at its step, as written to samples/."""
    cfg = compose_config([f"output_dir={tmp_path}", "train.progress=false", "train.steps=2", "train.batch_size=1",
                          "log.tracker=tensorboard", "log.project=proj", "train.preflight=false", "sample.every=2",
                          "sample.steps=2", "sample.resolution=32", "sample.prompts=[a red square]"])
    task(cfg)
    acc = read_events(tmp_path / "tracker" / "proj")
    (tag,) = [t for t in acc.Tags()["images"] if t.startswith("sample/")]
    assert tag == "sample/00-a-red-square"
    images = acc.Images(tag)
    assert [i.step for i in images] == [0, 2]  # the start and the end, as in samples/step-0 and step-2
    written = Image.open(tmp_path / "samples" / "step-2" / "00-a-red-square.png").convert("RGB")
    logged = Image.open(__import__("io").BytesIO(images[-1].encoded_image_string)).convert("RGB")
    assert np.array_equal(np.asarray(logged), np.asarray(written))
