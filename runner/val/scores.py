"""CLIP and DINO scores of a run's samples (``val.scores=[clip,dino]``), beside the base model's.

``python -m runner sample.every=100 sample.prompts='[a photo of sks dog]' val.scores=[clip,dino]
val.score_models.clip=/models/clip-vit-large-patch14 val.score_models.dino=/models/dinov2-base`` writes
``scores.json`` in the run folder after the last step; job_summary.json and a sweep's sweep_summary.csv
take its values (runner/output/jobs.py), and ``sweep.objective=clip_score|dino_score`` can judge a trial.

What is scored: the images the sampler already drew (runner/sampling/), read back from ``samples/step-N``:

* **trained**: the newest ``samples/step-N`` (the last step, or where a pruned job stopped);
* **base**: ``samples/step-0``, drawn before the first step with the same prompts and seeds. A LoRA starts
  at zero (its up-projection is zero), so these are the base model's images, adapter off; for a full
  fine-tune they are the starting weights'. None when the folder has no step-0 (a resumed run's new folder).

The scores:

* ``clip_score``: the mean over samples of the cosine between the CLIP image embedding of each sample and
  the CLIP text embedding of its own prompt (CLIPModel's projected features; raw cosine in [-1, 1], not
  torchmetrics' 100 x max(cos, 0));
* ``dino_score``: concept fidelity, DreamBooth's DINO metric: the mean cosine over every (sample, training
  image) pair of the DINO embeddings (the pooled, layer-normed CLS token). The training images are the
  data set's samples that are trained on (held-out ones excluded), the first ``MAX_REFERENCES`` of them.

The models load from ``val.score_models.clip`` / ``.dino`` (local folders; safetensors only, nothing is
downloaded), checked before step 1 (runner/val/config.py). With ``model.size=tiny`` and no folder, tiny
random-weight models built from a transformers config score instead: the numbers then test the plumbing
only, which the log and ``score_weights`` say. Scoring runs on the run's device when it is a CUDA card
(on the host after an out-of-memory error there), else on the CPU, after training and export: a failure
is a warning and no scores, never the run's status.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runner.val.config import SCORES_JSON, score_names

if TYPE_CHECKING:
    from runner.context import RunContext

log = logging.getLogger("runner")

MAX_REFERENCES = 64  # training images the DINO score compares with
RANDOM_NOTE = "random-weight tiny test models (model.size=tiny, no val.score_models.*): plumbing only, not quality"


# ---- the models ------------------------------------------------------------------------------
def tiny_score_model(name: str) -> tuple[Any, Any, Any]:
    """(model, image processor, tokenizer or None) of tiny random weights, the same every time."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, Dinov2Config, Dinov2Model

    size = 32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if name == "clip":
            from runner.families.common.tokenizers import clip_tokenizer

            tower = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 2}
            config = CLIPConfig(text_config={**tower, "vocab_size": 514, "max_position_embeddings": 77,
                                             "bos_token_id": 512, "eos_token_id": 513},
                                vision_config={**tower, "image_size": size, "patch_size": 8}, projection_dim=16)
            crop = {"height": size, "width": size}
            return (CLIPModel(config).eval(), CLIPImageProcessor(size={"shortest_edge": size}, crop_size=crop),
                    clip_tokenizer(77))
        config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
                              image_size=size, patch_size=8)
        return Dinov2Model(config).eval(), _dino_processor(size), None


def _dino_processor(size: int) -> Any:
    """DINOv2's own preprocessing (BitImageProcessor, ImageNet mean/std) at a ``size`` px centre crop."""
    from transformers import BitImageProcessor
    from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    return BitImageProcessor(size={"shortest_edge": size * 256 // 224}, crop_size={"height": size, "width": size},
                             image_mean=IMAGENET_DEFAULT_MEAN, image_std=IMAGENET_DEFAULT_STD)


def load_score_model(name: str, folder: str) -> tuple[Any, Any, Any]:
    """(model, image processor, tokenizer or None) from a local folder, safetensors weights only."""
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer, CLIPImageProcessor, CLIPModel

    path = Path(folder).expanduser()
    kw = {"use_safetensors": True, "local_files_only": True}
    model = (CLIPModel if name == "clip" else AutoModel).from_pretrained(str(path), **kw).eval()
    if (path / "preprocessor_config.json").is_file():
        processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
    elif name == "clip":
        size = int(model.config.vision_config.image_size)
        processor = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    else:
        processor = _dino_processor(224)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True) if name == "clip" else None
    return model, processor, tokenizer


# ---- the scores ------------------------------------------------------------------------------
def _unit(x: Any) -> torch.Tensor:
    """Unit vectors of CLIP's projected features (transformers 5 returns them as the output's ``pooler_output``)."""
    x = x if isinstance(x, torch.Tensor) else x.pooler_output
    return torch.nn.functional.normalize(x.float(), dim=-1)


def _pixels(processor: Any, images: list[Any], device: torch.device) -> torch.Tensor:
    return processor(images=images, return_tensors="pt")["pixel_values"].to(device)


@torch.no_grad()
def clip_score(model: Any, processor: Any, tokenizer: Any, images: list[Any], prompts: list[str],
               device: torch.device) -> float:
    """Mean cosine of each image's CLIP embedding with its own prompt's."""
    longest = int(model.config.text_config.max_position_embeddings)
    tokens = tokenizer(prompts, padding=True, truncation=True, max_length=longest, return_tensors="pt").to(device)
    image = _unit(model.get_image_features(pixel_values=_pixels(processor, images, device)))
    text = _unit(model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]))
    return float((image * text).sum(-1).mean())


@torch.no_grad()
def dino_embeddings(model: Any, processor: Any, images: list[Any], device: torch.device) -> torch.Tensor:
    """Unit DINO embeddings (the pooled CLS token), in batches of 16."""
    out = []
    for lo in range(0, len(images), 16):
        result = model(pixel_values=_pixels(processor, images[lo:lo + 16], device))
        pooled = getattr(result, "pooler_output", None)
        out.append(_unit(pooled if pooled is not None else result.last_hidden_state[:, 0]))
    return torch.cat(out)


def dino_score(samples: torch.Tensor, references: torch.Tensor) -> float:
    """Mean cosine over every (sample, reference) pair of unit embeddings."""
    return float((samples @ references.T).mean())


# ---- the run's images ------------------------------------------------------------------------
def sample_folders(out: Path) -> tuple[Path | None, Path | None]:
    """(``samples/step-0``, the newest ``samples/step-N`` with N > 0), each None when absent."""
    steps = {int(d.name[5:]): d for d in (out / "samples").glob("step-*") if d.is_dir() and d.name[5:].isdigit()}
    last = max((n for n in steps if n > 0), default=None)
    return steps.get(0), (steps[last] if last is not None else None)


def read_samples(folder: Path, settings: dict[str, Any]) -> tuple[list[Any], list[str]]:
    """The folder's images (RGB) and their prompts, in prompt order (missing files skipped)."""
    from PIL import Image

    images, prompts = [], []
    for name, prompt in zip(settings["files"], settings["prompts"]):
        if (folder / name).is_file():
            with Image.open(folder / name) as im:
                images.append(im.convert("RGB"))
            prompts.append(str(prompt))
    return images, prompts


def reference_images(ctx: RunContext) -> list[Any]:
    """The first ``MAX_REFERENCES`` trained-on images of the data set (held-out ones excluded), as RGB images."""
    from PIL import Image

    dataset = ctx.trainer.dataset()
    indices = list(getattr(ctx.validation, "train", None) or range(len(dataset)))[:MAX_REFERENCES]
    out = []
    for i in indices:
        pixels = dataset[i].get("pixel_values")
        if pixels is None:
            continue
        while pixels.dim() > 3:  # a clip: its first frame
            pixels = pixels[0]
        arr = ((pixels.float() + 1) * 127.5).clamp(0, 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        out.append(Image.fromarray(arr, "RGB"))
    return out


# ---- one run ---------------------------------------------------------------------------------
def score_run(ctx: RunContext) -> dict[str, Any] | None:
    """Write ``scores.json`` for the run's samples (module docstring); None when ``val.scores`` is empty.
    Never raises: a failure is a warning and no scores."""
    names = score_names(ctx.cfg)
    if not names:
        return None
    out = Path(ctx.output_dir)
    (out / SCORES_JSON).unlink(missing_ok=True)  # a resumed run's folder: no stale scores
    try:
        return _score(ctx, names, out)
    except Exception as e:  # noqa: BLE001 - scores must never cost the run that trained
        log.warning("val.scores: no scores (%s: %s)", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def _score(ctx: RunContext, names: list[str], out: Path) -> dict[str, Any] | None:
    from runner.guards.oom import is_out_of_memory

    base, last = sample_folders(out)
    if last is None:
        log.warning("val.scores: no samples/step-N after step 0 in %s: nothing to score", out)
        return None
    settings = json.loads((out / "samples" / "prompts.json").read_text(encoding="utf-8"))
    folders = {"": last, "base_": base}
    device = ctx.device if ctx.device.type == "cuda" else torch.device("cpu")
    try:
        values = _values(ctx, names, folders, settings, device)
    except Exception as e:
        if device.type == "cpu" or not is_out_of_memory(e):
            raise
        log.warning("val.scores: out of device memory; scoring on the CPU instead")
        torch.cuda.empty_cache()
        values = _values(ctx, names, folders, settings, torch.device("cpu"))
    given = ctx.cfg.val.score_models
    result = {"step": int(last.name[5:]), "base_step": 0 if base is not None else None, **values,
              "models": {n: str(given.get(n)) if given.get(n) is not None else "random" for n in names},
              "random_weights": [n for n in names if given.get(n) is None]}
    (out / SCORES_JSON).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    text = ", ".join(f"{n}_score {_fmt(values.get(f'{n}_score'))} (base {_fmt(values.get(f'base_{n}_score'))})"
                     for n in names)
    log.info("val.scores: step %d: %s (%s)", result["step"], text, out / SCORES_JSON)
    if result["random_weights"]:
        log.warning("val.scores: %s scored with %s", ", ".join(result["random_weights"]), RANDOM_NOTE)
    return result


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _values(ctx: RunContext, names: list[str], folders: dict[str, Path | None], settings: dict[str, Any],
            device: torch.device) -> dict[str, float | None]:
    """``clip_score``, ``base_clip_score``, ``dino_score``, ``base_dino_score`` (those of ``names``)."""
    given = ctx.cfg.val.score_models
    values: dict[str, float | None] = {}
    for name in names:
        folder = given.get(name)
        model, processor, tokenizer = tiny_score_model(name) if folder is None else load_score_model(name, str(folder))
        model.to(device)
        refs = reference_images(ctx) if name == "dino" else None
        refs = dino_embeddings(model, processor, refs, device) if refs else None
        for prefix, where in folders.items():
            if where is None or (name == "dino" and refs is None):  # no step-0 samples; no training images
                values[f"{prefix}{name}_score"] = None
                continue
            images, prompts = read_samples(where, settings)
            if name == "clip":
                values[f"{prefix}clip_score"] = clip_score(model, processor, tokenizer, images, prompts, device)
            else:
                values[f"{prefix}dino_score"] = dino_score(dino_embeddings(model, processor, images, device), refs)
        del model
    return values
