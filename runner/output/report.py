"""Run outputs: metrics.jsonl, the resolved config with package versions, the final summary."""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

PACKAGES = ("torch", "diffusers", "transformers", "peft", "accelerate", "bitsandbytes", "safetensors",
            "hydra-core", "omegaconf")


class MetricsWriter:
    """One JSON object per line, flushed every row so a crash loses at most the current step."""

    def __init__(self, path: Path, append: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        from runner.errors import storage_error

        try:
            self._f.write(json_text(row) + "\n")
            self._f.flush()
        except OSError as e:
            raise storage_error(e, "Writing a row of metrics.jsonl", self._f.name) from None

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a torn last line (a run killed mid-write) is skipped."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


class NullMetrics:
    """Ranks other than 0 of a multi-process run: rank 0 writes metrics.jsonl (runner/distributed/)."""

    def write(self, row: dict[str, Any]) -> None:
        return None

    def close(self) -> None:
        return None


def drop_metrics_after(path: Path, step: int) -> int:
    """Keep the rows of ``path`` up to ``step`` (a resume from that step); how many were dropped.

    Rows after a checkpoint's step were trained by a run that then lost them (killed after the
    save, or resumed from an older checkpoint); the resumed run writes those steps again, and a
    curve with every step once is what plots and the sweep summary expect. Rewritten atomically.
    """
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    kept = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except json.JSONDecodeError:  # a torn last line of a killed run
            continue
    dropped = len(lines) - len(kept)
    if dropped:
        write_text_atomic(path, "".join(line + "\n" for line in kept))
        logging.getLogger("runner").info("metrics.jsonl: dropped %d rows after step %d (the resumed run writes "
                                         "those steps again)", dropped, step)
    return dropped


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as ``None``: JSON has no spelling for them, and a bare
    ``NaN`` makes a file no strict JSON reader accepts."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def json_text(value: Any, indent: int | None = None) -> str:
    return json.dumps(json_safe(value), indent=indent, allow_nan=False)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` so that a reader sees the old content or the new, never a torn or empty file:
    a temporary file in the same folder, fsynced, then renamed over it."""
    from runner.files import fix_fd_mode

    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        fix_fd_mode(fd)  # mkstemp makes it 0600; a run's outputs are 0644 like any file (runner/files.py)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def write_run_info(out: Path, cfg: DictConfig) -> None:
    """resolved_config.yaml (every value, interpolations resolved) + versions.json."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (out / "versions.json").write_text(json.dumps(package_versions(), indent=2) + "\n")


def summary(result: Any, out: Path) -> str:
    losses = result.losses
    if not losses:
        return f"No step was run. Outputs in {out}"
    k = max(1, len(losses) // 5)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    lines = [
        f"steps: {result.steps_done}   loss: {first:.4f} (first {k}) -> {last:.4f} (last {k})   "
        f"s/step: {result.seconds_per_step:.3f}",
        f"outputs: {out}  (metrics.jsonl, resolved_config.yaml, versions.json{', checkpoints/' if result.checkpoint else ''})",
    ]
    skipped = getattr(result, "nonfinite_skips", 0)
    if skipped:
        lines.append(f"warning: {skipped} step(s) skipped on a non-finite loss or gradient; their samples are named in "
                     "the log (a corrupt image or caption, or a learning rate too high)")
    if result.checkpoint:
        lines.append(f"checkpoint: {result.checkpoint}  (resume with train.resume={result.checkpoint})")
    state_bytes = getattr(result, "notes", {}).get("optimizer state bytes")
    if state_bytes is not None:
        lines.append(f"optimizer state: {state_bytes} bytes ({state_bytes / 2**20:.2f} MiB)")
    return "\n".join(lines)


def print_summary(result: Any, out: Path) -> str:
    """The summary on stdout and in the job's log file (Hydra's ``__main__.log``); returned too."""
    from runner.output.progress import log_to_files

    text = summary(result, out)
    print(text)
    log_to_files("summary:\n" + text)
    return text
