"""``sweep_samples.png``: the same prompt across a sweep's jobs, one row per job (its last sampled step).

Each job's samples are ``samples/step-N/<prompt number>-<words>.png`` (runner/sampling/); the row shows the
newest step's first ``columns`` prompts, labelled with the job number, its status and its swept overrides.
Nothing is written when no job drew samples (``sample.every=0``, the default).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

SWEEP_SAMPLES_PNG = "sweep_samples.png"
LABEL_H = 14  # pixels of text above each row


def last_samples(job_dir: Path, columns: int) -> list[Path]:
    """The job's newest ``samples/step-N`` folder's first ``columns`` images (by prompt number)."""
    steps = [d for d in (job_dir / "samples").glob("step-*") if d.is_dir() and d.name[5:].isdigit()]
    if not steps:
        return []
    newest = max(steps, key=lambda d: int(d.name[5:]))
    return sorted(newest.glob("*.png"))[:columns]


def write_sweep_samples(rows: list[dict[str, Any]], path: Path, columns: int = 1, size: int = 128) -> Path | None:
    """The grid of every job's last samples (``size`` px squares), or None when no job has any."""
    from PIL import Image, ImageDraw

    found = [(r, last_samples(Path(str(r.get("dir", ""))), columns)) for r in rows]
    found = [(r, images) for r, images in found if images]
    if not found:
        return None
    width = max(size * columns, 160)
    grid = Image.new("RGB", (width, len(found) * (size + LABEL_H)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (r, images) in enumerate(found):
        top = i * (size + LABEL_H)
        draw.text((2, top + 1), f"job {r.get('job')} {r.get('status')}: {Path(str(r.get('dir'))).name}"[:60],
                  fill="black")
        for j, image in enumerate(images):
            with Image.open(image) as im:
                grid.paste(im.convert("RGB").resize((size, size)), (j * size, top + LABEL_H))
    grid.save(path)
    return path
