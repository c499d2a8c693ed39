"""The read side of :class:`runner.memory.live_bytes.LiveBytesTracker`: bytes now and at the peak,
by category and module, peak resets and JSON snapshots.

Kept apart from the dispatch-side bookkeeping (live_bytes.py) so that each file has one job: the
counting there is on the hot path of every simulated op; these views run a few times per step.
"""
from __future__ import annotations

from typing import Any

CATEGORIES: tuple[str, ...] = ("weights", "gradients", "optimizer_state", "activations", "temporaries", "other")
"""Categories reported; "other" = pre-existing storages first seen as op inputs, or born outside a phase."""

OPTIONAL_CATEGORIES: tuple[str, ...] = ("ema",)
"""Categories of features that are off by default, reported only where they hold bytes (so a plan or
profile without them has the same keys as before): "ema" = the EMA copy of the trained weights."""

NO_PHASE = "(none)"
NO_MODULE = "(none)"


class TrackerViews:
    """Mixin of LiveBytesTracker: every query reads the tracker's counters after draining the
    queue of dead storages, so a free is always accounted before it is read."""

    current: dict[str, int]
    peak: dict[str, int]
    max_since_mark: dict[str, int]

    def current_bytes(self, device: str = "cpu") -> int:
        self._drain()
        return self.current.get(device, 0)

    def now_by_category(self, device: str) -> dict[str, int]:
        """Live bytes per category now, cheaply (the planner's timeline reads it after every op)."""
        self._drain()
        return self._cat_current.get(device, {})

    def now_total(self, device: str) -> int:
        self._drain()
        return self.current.get(device, 0)

    def innermost_module(self) -> str | None:
        """The module whose forward (or backward) is running now, None outside any."""
        return self._modules[-1].name if self._modules else None

    def peak_bytes(self, device: str = "cpu") -> int:
        self._drain()
        return self.peak.get(device, 0)

    def _breakdown(self, device: str, at_peak: bool) -> dict[tuple[str, str | None], int]:
        if at_peak and not self._peak_pending.get(device):
            return self._cm_at_peak.get(device, {})
        return self._cm_current.get(device, {})

    def category_bytes(self, device: str = "cpu", at_peak: bool = False) -> dict[str, int]:
        """Live bytes per category now (or at the device's peak)."""
        self._drain()
        out = {c: 0 for c in CATEGORIES}
        for (cat, _), n in self._breakdown(device, at_peak).items():
            out[cat] = out.get(cat, 0) + n
        return out

    def module_bytes(self, device: str = "cpu", at_peak: bool = False) -> dict[str, dict[str, int]]:
        """Live bytes per module label and category, now (or at the device's peak).

        Labels are what births were tagged with (innermost module hook) or what :meth:`track`
        set; bytes without a label are under ``"(none)"``. Zero entries are left out.
        """
        self._drain()
        out: dict[str, dict[str, int]] = {}
        for (cat, mod), n in self._breakdown(device, at_peak).items():
            if n:
                per = out.setdefault(NO_MODULE if mod is None else mod, {})
                per[cat] = per.get(cat, 0) + n
        return out

    def take_max_since_mark(self) -> dict[str, int]:
        """The highest live bytes per device since the previous call (or the start), then start
        again from the current level.

        A profile samples live bytes at phase edges only; inside a checkpointed backward the
        recomputed activations come and go between two edges, so the sampled points can miss the
        real peak by a fifth. Every allocation updates this running maximum, so no peak between
        two points is lost; unlike :meth:`reset_peaks` it leaves the run-wide peaks alone.
        """
        self._drain()
        out = {d: max(n, self.current.get(d, 0)) for d, n in self.max_since_mark.items()}
        for d, n in self.current.items():
            out.setdefault(d, n)
        self.max_since_mark = dict(self.current)
        return out

    def reset_peaks(self) -> None:
        """Start peaks (global, phase, category-at-peak, module) again from the current level."""
        self._drain()
        self.peak = dict(self.current)
        self._peak_seq = {d: self._seq for d in self.current}
        self._peak_phase = {d: "(reset)" for d in self.current}
        self._peak_module = {d: None for d in self.current}
        self._cm_at_peak = {}
        self._peak_pending = {d: True for d in self.current}  # the current breakdown is the peak's
        self.phase_peaks.clear()
        self._phase_temporaries.clear()
        for st in self._module_stats.values():
            for k in st:
                st[k] = 0

    def snapshot(self) -> dict[str, Any]:
        """A JSON-serialisable dict of everything counted so far (bytes are ints)."""
        self._drain()
        devices = {}
        for dev in sorted(set(self.current) | set(self.peak)):
            devices[dev] = {
                "current_bytes": self.current.get(dev, 0),
                "peak_bytes": self.peak.get(dev, 0),
                "peak_phase": self._peak_phase.get(dev, NO_PHASE),
                "peak_module": self._peak_module.get(dev),
                "peak_by_category": self.category_bytes(dev, at_peak=True),
                "current_by_category": self.category_bytes(dev),
                "peak_by_module": self.module_bytes(dev, at_peak=True),
                "peak_by_phase": {ph: p[dev] for ph, p in self.phase_peaks.items() if dev in p},
                "temporaries_by_phase": {ph: t[dev] for ph, t in self._phase_temporaries.items() if dev in t},
            }
        modules = {
            name: {**st, "live_bytes": self._module_live.get(name, 0)} for name, st in self._module_stats.items()
        }
        return {"devices": devices, "modules": modules, "live_storages": len(self._live)}

    def report(self) -> dict[str, Any]:
        """:meth:`snapshot` plus a one-line human summary per device under ``"summary"``."""
        snap = self.snapshot()
        lines = []
        for dev, d in snap["devices"].items():
            cats = ", ".join(f"{c} {_gib(v)}" for c, v in d["peak_by_category"].items() if v)
            lines.append(f"{dev}: peak {_gib(d['peak_bytes'])} in {d['peak_phase']} ({cats}); now {_gib(d['current_bytes'])}")
        snap["summary"] = lines
        return snap


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if abs(n) >= 2**26 else f"{n / 2**20:.2f} MiB"
