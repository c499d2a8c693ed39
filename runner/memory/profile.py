"""Memory profiler of a few training steps (``profile.enabled=true``): timeline, largest
allocations with their module, leak check, and on CUDA a snapshot for PyTorch's memory viewer.

Outputs, in the run's output directory:

* ``memory_timeline.json``: one point per (step, phase boundary): ``step_start``,
  ``after_forward`` and ``after_backward`` (once per micro-batch pass), ``after_optimizer``,
  ``step_end``; a failed phase (out of memory) leaves a ``forward_failed`` / ``backward_failed``
  point taken while the failed pass's tensors were still alive. Each point holds the live tensor
  bytes on the training device (by category: weights, gradients, optimizer_state, activations,
  temporaries, other), host RSS, on CUDA the allocator's allocated/reserved bytes, and the
  ``top_k`` largest live tensor storages, each with its parameter name (weights, optimizer
  state) or the module whose forward created it (activations), and
  ``peak_live_bytes_since_previous``: the highest live bytes between the previous point and this
  one. Points sit at phase edges, and inside a checkpointed backward the recomputed activations
  rise and fall between two edges (the edges alone missed a fifth of the peak on a tiny SDXL
  fine-tune with park, 8-bit AdamW and block checkpointing); the tracker sees every allocation
  and keeps this running maximum, so ``peak_live_bytes`` in the record is the true peak. ``largest`` repeats the list at
  the point with the most live bytes; ``leaks`` lists leak warnings.
* ``memory_timeline.png``: the same timeline plotted (matplotlib, Agg; no display needed).
* ``memory_snapshot.pickle`` (CUDA only): ``torch.cuda.memory._dump_snapshot`` of the profiled
  steps, with a stack trace per allocation; drag it onto https://pytorch.org/memory_viz. On CPU
  it is skipped and the log and JSON say so (PyTorch records allocation history only for CUDA).

Where the numbers come from: live bytes are counted by
:class:`~runner.memory.live_bytes.LiveBytesTracker` on every device (exact storage bytes; on CUDA
the allocator's figures sit beside them, larger by block rounding, cached blocks and library
workspaces). The tracker is a ``TorchDispatchMode``: while it is active every op goes through
Python, so the profiled steps run several times slower than the others (``s_per_step`` in
metrics.jsonl shows by how much). That is why only ``profile.steps`` steps are profiled and the
rest of the run is untouched; a disabled profiler is a :class:`NullProfiler` whose methods do
nothing.

Leak check: a training step should end with the same live bytes every time. When the live bytes
at ``step_end`` rise from one step to the next, by more than ``profile.leak_threshold_mb``, in
``profile.leak_steps`` consecutive steps, the log warns once (with the categories that grew)
and the warning is stored under ``leaks``. One-off growth (the optimizer state created in the
first step) does not repeat and so does not trigger it. A cache that fills over the first epoch
does repeat: the built-in demo set keeps each image it drew (on CPU at 16 px and batch 4 that is
+12 KiB per step, at 64 px and batch 2 +96 KiB), which is why the default threshold is 1 MiB per
step; a real leak in training (a loss kept with its graph, outputs appended to a list) grows by
the activations of a step, far more.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runner.errors import UserError
from runner.memory.cuda_sim import DEVICE_KEY as SIM_DEVICE_KEY
from runner.memory.live_bytes import LiveBytesTracker
from runner.memory.live_bytes_views import CATEGORIES, OPTIONAL_CATEGORIES
from runner.memory.stats import host_rss

if TYPE_CHECKING:
    from runner.context import RunContext

log = logging.getLogger("runner")

MIB = 2**20
TIMELINE_JSON = "memory_timeline.json"
TIMELINE_PNG = "memory_timeline.png"
SNAPSHOT = "memory_snapshot.pickle"


# ---- leak detection (a plain function of the numbers, tested on its own) ------------------------
@dataclass
class Leak:
    point: str
    steps: list[int]  # the consecutive steps whose values rose, first to last
    values: list[int]  # live bytes at ``point`` in those steps

    @property
    def rises(self) -> list[int]:
        return [b - a for a, b in zip(self.values, self.values[1:])]


@dataclass
class LeakDetector:
    """Warns when the value at one point rose in ``steps`` consecutive steps, each by more than
    ``threshold_bytes``; once per rising streak."""

    steps: int = 3
    threshold_bytes: int = 0
    _history: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    _reported: dict[str, bool] = field(default_factory=dict)

    def update(self, point: str, step: int, live_bytes: int) -> Leak | None:
        hist = self._history.setdefault(point, [])
        if hist and hist[-1][0] != step - 1:  # not consecutive (resume, gap): start over
            hist.clear()
        hist.append((step, live_bytes))
        streak = 0
        for (_, a), (_, b) in zip(reversed(hist[:-1]), reversed(hist[1:])):
            if b - a > self.threshold_bytes:
                streak += 1
            else:
                break
        if streak < self.steps:
            self._reported[point] = False
            return None
        if self._reported.get(point):
            return None
        self._reported[point] = True
        window = hist[-(self.steps + 1):]
        return Leak(point, [s for s, _ in window], [v for _, v in window])


# ---- the profilers ----------------------------------------------------------------------------------
class NullProfiler:
    """``profile.enabled=false``: every call is a no-op, so the loop has no ``if``."""

    enabled = False

    def begin_step(self, step: int) -> None: ...

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def end_step(self) -> None: ...

    def close(self) -> None: ...


class _ProfilingTracker(LiveBytesTracker):
    """The tracker plus a view of its live records, for the largest-allocation lists. ``place``: on
    the simulated card (``train.device=cuda_sim``) every tensor is CPU memory, so each storage counts
    where the card's own tracker placed it (card or host), not under its CPU device."""

    def __init__(self, place: Callable[[torch.Tensor], str] | None = None) -> None:
        super().__init__()
        self._place = place

    def _device_key(self, t: torch.Tensor, born: bool) -> str:
        return self._place(t) if self._place is not None else super()._device_key(t, born)

    def device_type(self, t: torch.Tensor) -> str:
        """Where ``t`` counts: ``cuda``, ``cpu``, or the simulated card's key."""
        return self._device_key(t, False).split(":")[0]

    def largest(self, k: int, device_type: str) -> list[Any]:
        self._drain()
        recs = [r for r in self._live.values() if r.device.split(":")[0] == device_type]
        recs.sort(key=lambda r: r.nbytes, reverse=True)
        return recs[:k]


class MemoryProfiler:
    """Profiles steps ``start .. start + steps - 1``; see the module docstring for the outputs."""

    enabled = True

    def __init__(self, cfg: Any, ctx: RunContext, out_dir: Path) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.out_dir = Path(out_dir)
        self.first = int(cfg.start)
        self.last = int(cfg.start) + int(cfg.steps) - 1
        card = ctx.card if getattr(ctx.card, "simulates", False) else None  # train.device=cuda_sim
        self.device_type = SIM_DEVICE_KEY if card is not None else ctx.device.type
        self.cuda = self.device_type == "cuda" and torch.cuda.is_available()
        self.tracker = _ProfilingTracker(card.tracker.place_of if card is not None else None)
        self.leaks = LeakDetector(int(cfg.leak_steps), int(float(cfg.leak_threshold_mb) * MIB))
        self.points: list[dict[str, Any]] = []
        self.leak_reports: list[dict[str, Any]] = []
        self.snapshot_note = "not taken"
        self._names: dict[int, str] = {}  # storage key -> parameter / optimizer-state name
        self._step: int | None = None  # the step being profiled (None: not in a profiled step)
        self._pass = 0
        self._started = False
        self._finished = False
        self._t0 = time.perf_counter()
        if int(cfg.steps) <= int(cfg.leak_steps):
            log.info("profile: leak detection needs profile.steps > profile.leak_steps (%d <= %d); it will not fire",
                     int(cfg.steps), int(cfg.leak_steps))

    # -- loop interface ----------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        if self._finished or not self.first <= step <= self.last:
            return
        if not self._started:
            self._start()
        self._name_optimizer_state()
        self._step, self._pass = step, 0
        self.tracker.__enter__()
        self.mark("step_start")

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._step is None:
            yield
            return
        try:
            with self.tracker.phase(name):
                yield
        except BaseException as e:
            # Taken while the failed pass's tensors are still referenced by the exception.
            self.mark(f"{name}_failed", error=f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            self._pass = 0  # an out-of-memory retry starts the step's passes over
            raise
        self.mark(f"after_{name}")
        if name == "backward":
            self._pass += 1

    def end_step(self) -> None:
        if self._step is None:
            return
        self._name_optimizer_state()  # state born in this step's optimizer phase gets its label now
        point = self.mark("step_end")
        leak = self.leaks.update("step_end", self._step, point["live_bytes"])
        if leak is not None:
            self._report_leak(leak)
        step = self._step
        self._exit_tracker()
        if step >= self.last:
            self._finish()

    def close(self) -> None:
        """End of the run (also after an error): leave the dispatch mode, write what was recorded."""
        self._exit_tracker()
        if self._started and not self._finished:
            self._finish()
        elif not self._started:
            log.info("profile: no step in %d-%d ran in this run; nothing recorded", self.first, self.last)

    # -- recording ---------------------------------------------------------------------------------
    def mark(self, point: str, **extra: Any) -> dict[str, Any]:
        tr = self.tracker
        tr._drain()
        grads = self._gradient_names()
        by_device = {d: n for d, n in tr.current.items() if d.split(":")[0] == self.device_type}
        peak_since = sum(n for d, n in tr.take_max_since_mark().items() if d.split(":")[0] == self.device_type)
        cats = {c: 0 for c in CATEGORIES}
        for d in by_device:
            for c, n in tr.category_bytes(d).items():
                cats[c] = cats.get(c, 0) + n  # an optional category (ema) only when present
        entry: dict[str, Any] = {
            "step": self._step,
            "point": point,
            "pass": self._pass,
            "t": round(time.perf_counter() - self._t0, 6),
            "live_bytes": sum(by_device.values()),
            "peak_live_bytes_since_previous": peak_since,  # every allocation counted, not only the edges
            "live_by_category": cats,
            "host_rss_bytes": host_rss(),
            "cuda_allocated_bytes": None,
            "cuda_reserved_bytes": None,
            "largest": [self._describe(r, grads) for r in tr.largest(int(self.cfg.top_k), self.device_type)],
            **extra,
        }
        if self.device_type != "cpu":
            entry["host_live_bytes"] = tr.current.get("cpu", 0)
        if self.cuda:
            entry["cuda_allocated_bytes"] = torch.cuda.memory_allocated(self.ctx.device)
            entry["cuda_reserved_bytes"] = torch.cuda.memory_reserved(self.ctx.device)
        self.points.append(entry)
        return entry

    def _describe(self, rec: Any, grads: dict[int, str]) -> dict[str, Any]:
        name = self._names.get(rec.key) or grads.get(rec.key)
        return {
            "bytes": rec.nbytes,
            "category": rec.category,
            "module": rec.module,
            "tensor": name,
            "device": rec.device,
        }

    # -- setup and teardown ------------------------------------------------------------------------
    def _start(self) -> None:
        self._started = True
        models = self.ctx.models
        for name, module in models.items():
            self.tracker.track(module, "weights")
            self.tracker.attach_module_hooks(module, depth=int(self.cfg.module_depth), prefix=name)
            for pname, p in [*module.named_parameters(), *module.named_buffers()]:
                self._name(p, f"{name}.{pname}")
        ema = self.ctx.ema.tensors()  # ema.enabled: the EMA copy, in its own category
        if ema:
            self.tracker.track(ema, "ema")
        if self.cuda and self.cfg.snapshot:
            # Python stacks only: C++ unwinding on every allocation ("all") costs far more.
            torch.cuda.memory._record_memory_history(max_entries=int(self.cfg.snapshot_max_entries), stacks="python")
            self.snapshot_note = "recording"
        elif self.cfg.snapshot:
            self.snapshot_note = f"skipped: PyTorch records allocation history only on CUDA (device: {self.ctx.device})"
            log.info("profile: memory snapshot %s", self.snapshot_note)
        else:
            self.snapshot_note = "off (profile.snapshot=false)"
        log.info("profile: recording memory of steps %d-%d (every op is counted; these steps run slower)",
                 self.first, self.last)

    def _name(self, t: Any, name: str) -> None:
        if isinstance(t, torch.Tensor):
            try:
                self._names.setdefault(t.untyped_storage()._cdata, name)
            except (RuntimeError, NotImplementedError, TypeError):
                pass

    def _name_optimizer_state(self) -> None:
        """Label the optimizer's state tensors (they appear after the first step)."""
        opt = self.ctx.optimizer
        if opt is None:
            return
        pnames = {id(p): n for m_name, m in self.ctx.models.items() for n, p in
                  ((f"{m_name}.{k}", v) for k, v in m.named_parameters())}
        tensors = []
        for p, st in getattr(opt, "state", {}).items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and self.tracker.device_type(v) == self.device_type:
                    tensors.append(v)
                    self._name(v, f"optimizer {k} of {pnames.get(id(p), '?')}")
        if tensors:
            self.tracker.track(tensors, "optimizer_state")

    def _gradient_names(self) -> dict[int, str]:
        """Storage key -> "grad of <parameter>" for the gradients alive now (they change every step)."""
        out: dict[int, str] = {}
        for m_name, m in self.ctx.models.items():
            for pname, p in m.named_parameters():
                if p.grad is not None:
                    try:
                        out[p.grad.untyped_storage()._cdata] = f"grad of {m_name}.{pname}"
                    except (RuntimeError, NotImplementedError, TypeError):
                        pass
        return out

    def _exit_tracker(self) -> None:
        if self._step is not None:
            self._step = None
            self.tracker.__exit__(None, None, None)

    def _report_leak(self, leak: Leak) -> None:
        first = next(p for p in self.points if p["step"] == leak.steps[0] and p["point"] == leak.point)
        last = next(p for p in reversed(self.points) if p["step"] == leak.steps[-1] and p["point"] == leak.point)
        grew = {c: last["live_by_category"][c] - first["live_by_category"][c] for c in CATEGORIES}
        grew = {c: d for c, d in grew.items() if d > 0}
        report = {"point": leak.point, "steps": leak.steps, "live_bytes": leak.values, "rises": leak.rises,
                  "grew_by_category": grew}
        self.leak_reports.append(report)
        log.warning(
            "profile: possible memory leak: live bytes at %s rose in each of steps %d-%d (%s; %s). Something keeps "
            "tensors alive across steps (a list of losses with their graph, a growing cache, a hook).",
            leak.point, leak.steps[1], leak.steps[-1], ", ".join(f"+{r / MIB:.2f} MiB" for r in leak.rises),
            ", ".join(f"{c} +{d / MIB:.2f} MiB" for c, d in grew.items()) or "no category grew",
        )

    def _finish(self) -> None:
        self._finished = True
        self.tracker.detach_module_hooks()
        snapshot_path = None
        if self.cuda and self.snapshot_note == "recording":
            snapshot_path = self.out_dir / SNAPSHOT
            try:
                torch.cuda.memory._dump_snapshot(str(snapshot_path))
                self.snapshot_note = f"{snapshot_path} (open in https://pytorch.org/memory_viz)"
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        peak = max(self.points, key=lambda p: p["live_bytes"], default=None)
        true_peak = max(self.points, key=lambda p: p["peak_live_bytes_since_previous"], default=None)
        record = {
            "device": str(self.ctx.device),
            "live_bytes_source": "runner.memory.live_bytes.LiveBytesTracker (tensor storage bytes on the training device)",
            "steps": [self.first, self.last],
            "points": self.points,
            # The highest live bytes of the profiled steps, reached between the previous point and this one.
            "peak_live_bytes": true_peak["peak_live_bytes_since_previous"] if true_peak else None,
            "peak_before": {"step": true_peak["step"], "point": true_peak["point"]} if true_peak else None,
            "largest": {"step": peak["step"], "point": peak["point"], "allocations": peak["largest"]} if peak else None,
            "leaks": self.leak_reports,
            "snapshot": self.snapshot_note,
        }
        (self.out_dir / TIMELINE_JSON).write_text(json.dumps(record, indent=1) + "\n")
        if self.points:
            plot_timeline(self.points, self.out_dir / TIMELINE_PNG, str(self.ctx.device))
        log.info("profile: %s, %s; snapshot: %s", self.out_dir / TIMELINE_JSON, self.out_dir / TIMELINE_PNG,
                 self.snapshot_note)
        if true_peak:
            log.info("profile: peak live tensors %.2f MiB, reached before step %s %s (highest sampled point: "
                     "%.2f MiB)", true_peak["peak_live_bytes_since_previous"] / MIB, true_peak["step"],
                     true_peak["point"], peak["live_bytes"] / MIB)
        if peak:
            lines = [f"  {a['bytes'] / MIB:9.2f} MiB  {a['category']:<15} {a['tensor'] or a['module'] or '(unattributed)'}"
                     for a in peak["largest"]]
            log.info("profile: largest live allocations at step %s %s:\n%s", peak["step"], peak["point"], "\n".join(lines))


def plot_timeline(points: list[dict[str, Any]], path: Path, device: str) -> None:
    """The timeline as a PNG. Uses the Agg canvas directly (no pyplot, no global backend switch)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    x = list(range(len(points)))
    fig = Figure(figsize=(max(8.0, 0.25 * len(points)), 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    cats = [c for c in (*CATEGORIES, *OPTIONAL_CATEGORIES) if any(p["live_by_category"].get(c) for p in points)]
    ax.stackplot(x, *[[p["live_by_category"].get(c, 0) / MIB for p in points] for c in cats],
                 labels=[f"live {c}" for c in cats], alpha=0.8)
    ax.step(x, [p["peak_live_bytes_since_previous"] / MIB for p in points], where="pre", color="red",
            linewidth=1, label="peak live since the previous point")
    if points[0].get("cuda_allocated_bytes") is not None:
        ax.plot(x, [p["cuda_allocated_bytes"] / MIB for p in points], color="black", label="CUDA allocated")
        ax.plot(x, [p["cuda_reserved_bytes"] / MIB for p in points], color="black", linestyle="--",
                label="CUDA reserved")
    else:  # host RSS is far above the tensors on CPU (libraries, interpreter): its own axis
        rss_ax = ax.twinx()
        rss_ax.plot(x, [p["host_rss_bytes"] / MIB for p in points], color="black", linestyle="--",
                    label="host RSS (right axis)")
        rss_ax.set_ylabel("host RSS, MiB")
        rss_ax.legend(fontsize=7, loc="upper right")
    for i, p in enumerate(points):
        if p["point"] == "step_start":
            ax.axvline(i, color="grey", linewidth=0.5, linestyle=":")
            ax.annotate(f"step {p['step']}", (i, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                        ha="left", va="top")
        elif p["point"].endswith("_failed"):
            ax.plot([i], [p["live_bytes"] / MIB], "rx", markersize=9)
    top = max(p["peak_live_bytes_since_previous"] for p in points) / MIB
    ax.set_ylim(0, top * 1.35 if top > 0 else 1.0)  # room for the legend and the step labels
    ax.set_xticks(x)
    ax.set_xticklabels([p["point"] for p in points], rotation=90, fontsize=6)
    ax.set_ylabel(f"live tensors on {device}, MiB")
    ax.set_title("memory per step and phase (live tensor bytes by category, counted by LiveBytesTracker)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def check_config(cfg: Any) -> None:
    """Raise UserError naming the ``profile.*`` key whose value cannot work."""
    for key, low in (("start", 1), ("steps", 1), ("top_k", 0), ("module_depth", 1), ("leak_steps", 1),
                     ("snapshot_max_entries", 1)):
        value = cfg[key]
        if value < low:
            raise UserError(f"profile.{key}={value!r} is not valid: it must be an integer >= {low}.")
    if cfg.leak_threshold_mb < 0:
        raise UserError(f"profile.leak_threshold_mb={cfg.leak_threshold_mb!r} is not valid: it must be >= 0 (MiB).")


def build_profiler(cfg: Any, ctx: RunContext) -> NullProfiler | MemoryProfiler:
    """The profiler for ``cfg.profile``: a :class:`NullProfiler` unless ``profile.enabled``."""
    prof = cfg.profile
    check_config(prof)
    if not prof.enabled:
        return NullProfiler()
    if ctx.output_dir is None:
        raise UserError("profile.enabled=true needs an output directory for its files: set output_dir=<folder>.")
    return MemoryProfiler(prof, ctx, ctx.output_dir)
