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
    logged; other records pass. What the command line's check says before a job belongs to that job: a
    warning then counts as said (the console showed it), a once-INFO line is held and logged when the job's
    logging is up (before it no handler shows INFO)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()
        self.said_before: set[str] = set()  # warnings shown before the next job started
        self.held: list[logging.LogRecord] = []
        self.job: str | None = None
        self.raised_level = False  # INFO enabled until the first job, so once-lines said before it are held

    def filter(self, record: logging.LogRecord) -> bool:
        job = _job()
        if job is not None and job != self.job:
            self._new_job(job)
        if record.levelno != logging.WARNING and not getattr(record, "once", False):
            return True
        text = record.getMessage()
        if job is None:
            if record.levelno >= logging.WARNING:
                self.said_before.add(text)
                return True
            if text not in {r.getMessage() for r in self.held}:
                self.held.append(record)
            return False
        if text in self.seen:
            return False
        self.seen.add(text)
        return True

    def _new_job(self, job: str) -> None:
        """A job starts (a sweep's next one says its warnings again, in its own log)."""
        self.job = job
        self.seen, self.said_before = self.said_before, set()
        if self.raised_level:  # the job's logging is configured now: its levels decide
            _LOG.setLevel(logging.NOTSET)
            self.raised_level = False
        held, self.held = self.held, []
        for record in held:
            _LOG.handle(record)


def warn_once() -> WarnOnce:
    """Install the filter on the ``runner`` logger (once per process) and return it."""
    for f in _LOG.filters:
        if isinstance(f, WarnOnce):
            return f
    f = WarnOnce()
    _LOG.addFilter(f)
    if _LOG.level == logging.NOTSET:
        _LOG.setLevel(logging.INFO)
        f.raised_level = True
    return f
