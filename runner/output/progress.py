"""Training progress: a tqdm bar on a terminal, plain log lines everywhere else.

Why two forms: tqdm redraws one line with ``\\r``. On a terminal that is the right display; in a
file (``nohup``, SLURM's ``slurm-N.out``, a CI log, ``| tee``) it becomes one endless line of
every redraw, unreadable and unsearchable. So without a terminal on stderr (where tqdm draws)
the bar is off and every ``log.every`` steps (default 10: a 100-step run prints ten lines), plus
the first and the last step, the ``runner`` logger writes one plain line::

    step 20/100  loss 0.1234 (mean of the last 10: 0.1301)  lr 1.0e-04  0.52 s/step  eta 0:00:41  rss 1.20G  pressure low

Hydra sends that logger to the console and to the job's log file, ``__main__.log`` in Hydra's run
directory. With a terminal the bar shows on screen and the same lines go to the log file only
(:func:`log_to_files`), so the file is the same with and without a terminal; the final summary
goes there too. ``train.progress=false`` turns the bar off (the log lines stay).
"""
from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any

log = logging.getLogger("runner")


def log_to_files(message: str, logger: logging.Logger = log, level: int = logging.INFO) -> None:
    """Write ``message`` to the file handlers ``logger``'s records reach (Hydra's ``__main__.log``),
    not to the console: for text the console already shows in another form (the bar, the
    printed summary)."""
    record = logger.makeRecord(logger.name, level, "(runner)", 0, message, (), None)
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
                handler.handle(record)
        current = current.parent if current.propagate else None


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """One training run's progress. ``bar`` shows tqdm (a terminal); lines are logged every
    ``every`` steps either way (to the console and the log file without a bar, the file only with it).
    """

    def __init__(self, total: int, initial: int, every: int, bar: bool) -> None:
        self.total, self.every = int(total), max(1, int(every))
        self.first = initial + 1  # the first step this process runs (a resumed run starts later)
        self.losses: list[float] = []
        self.started = time.perf_counter()
        self.bar = None
        if bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)

    def update(self, step: int, loss: float, lr: float, seconds: float, memory: dict[str, str]) -> None:
        """After step ``step`` (1-based): advance the bar and write the line when it is due."""
        self.losses.append(loss)
        if self.bar is not None:
            self.bar.set_postfix({"loss": f"{loss:.4f}", "s_step": f"{seconds:.2f}", **memory})  # in this order
            self.bar.update(1)
        if step % self.every and step not in (self.first, self.total):
            return
        line = self.line(step, loss, lr, memory)
        if self.bar is None:
            log.info("%s", line)
        else:
            log_to_files(line)

    def line(self, step: int, loss: float, lr: float, memory: dict[str, str]) -> str:
        recent = self.losses[-self.every:]
        mean = sum(recent) / len(recent)
        done = step - self.first + 1
        per_step = (time.perf_counter() - self.started) / done
        parts = [f"step {step}/{self.total}", f"loss {loss:.4f}"]
        if len(recent) > 1:
            parts[-1] += f" (mean of the last {len(recent)}: {mean:.4f})"
        parts += [f"lr {lr:.1e}", f"{per_step:.2f} s/step", f"eta {_duration(per_step * (self.total - step))}"]
        parts += [f"{k} {v}" for k, v in memory.items()]
        return "  ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class NoProgress:
    """Ranks other than 0 of a multi-process run: rank 0 reports the progress (runner/distributed/)."""

    def update(self, step: int, loss: float, lr: float, seconds: float, memory: dict[str, str]) -> None:
        return None

    def close(self) -> None:
        return None


def build_progress(cfg: Any, initial: int, main_process: bool = True) -> Progress | NoProgress:
    """The bar when ``train.progress`` is on and stderr is a terminal; log lines every ``log.every``.
    Ranks other than 0 of a multi-process run (``main_process=False``) report nothing."""
    if not main_process:
        return NoProgress()
    log_cfg = cfg.get("log") if hasattr(cfg, "get") else None
    every = int(log_cfg.get("every", 10)) if log_cfg is not None else 10
    bar = bool(cfg.train.get("progress", True)) and stderr_is_terminal()
    return Progress(int(cfg.train.steps), initial, every, bar)
