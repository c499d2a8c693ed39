"""Each warning of the ``runner`` logger is said once per job: checks that run again (a fit's candidates,
a preflight after validation) would otherwise repeat the same line."""
from __future__ import annotations

import logging

_LOG = logging.getLogger("runner")


def _job() -> str | None:
    """The job's output folder under Hydra (a ``-m`` sweep runs several jobs in one process), else None."""
    from hydra.core.hydra_config import HydraConfig

    return str(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


class WarnOnce(logging.Filter):
    """Drops a WARNING (or a record logged with ``extra={"once": True}``) whose text this job has already
    logged; other records pass. A warning the command line's check printed before the first job counts as
    that job's (the console showed it); an INFO line from then does not (no handler showed it yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()
        self.job: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING and not getattr(record, "once", False):
            return True
        job, text = _job(), record.getMessage()
        if job is None:
            if record.levelno >= logging.WARNING:
                self.seen.add(text)
            return True
        if job != self.job:
            if self.job is not None:  # a sweep's next job says its warnings again, in its own log
                self.seen.clear()
            self.job = job
        if text in self.seen:
            return False
        self.seen.add(text)
        return True


def warn_once() -> WarnOnce:
    """Install the filter on the ``runner`` logger (once per process) and return it."""
    for f in _LOG.filters:
        if isinstance(f, WarnOnce):
            return f
    f = WarnOnce()
    _LOG.addFilter(f)
    return f
