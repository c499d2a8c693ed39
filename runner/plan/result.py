"""The plan: what one simulated step needs, per phase, device, category and module; its table."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runner.memory.live_bytes_views import CATEGORIES, OPTIONAL_CATEGORIES
from runner.plan.target import DEVICE, HOST, GiB


@dataclass
class PhasePeak:
    """The steady-state peak of one phase of the simulated step, on one device."""

    name: str  # setup | forward | backward | optimizer (with "#2" for the second micro-batch)
    where: str  # innermost phase at the peak (e.g. "encode" inside forward)
    peak_bytes: int
    by_module: dict[str, dict[str, int]]  # top-level module -> category -> bytes


@dataclass
class Plan:
    """The predicted memory of one training step. Bytes are exact counts of live tensor storage."""

    target: str  # "cuda" or "cpu": the device whose autocast and kernels were simulated
    peak_bytes: int  # device
    peak_phase: str
    margin_bytes: int  # kernel workspaces (see CUDA_WORKSPACE_MARGIN_BYTES), added for the fit check
    budget_bytes: int | None
    by_category: dict[str, int]  # at the device peak
    by_module: dict[str, dict[str, int]]  # at the device peak: top-level module -> category -> bytes
    phases: dict[str, int]  # steady-state device peak of each phase
    host_peak_bytes: int
    host_peak_phase: str
    host_steady_bytes: int  # host tensors during training (after setup)
    host_pinned_bytes: int
    optimizer_state_bytes: dict[str, int]  # per device ("meta" = the accelerator, "cpu" = host)
    run: dict[str, Any]  # what was planned: trainer, size, resolution, batch, precision, plugins ...
    notes: dict[str, Any] = field(default_factory=dict)
    suggestions: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    sampling: dict[str, Any] | None = None  # sample.every: the sampling pass's peak beside the step's (runner/plan/sampling.py)
    ema: dict[str, Any] | None = None  # ema.enabled: the EMA copy's bytes on the device and the host (plan/ema.py)
    validation: dict[str, Any] | None = None  # data.val_*: whether the validation pass was planned, and its peak
    step_time: dict[str, Any] | None = None  # predicted s/step and its FLOPs, bytes and copies (runner/plan/speed.py)
    # dist=ddp|fsdp: host RAM per rank, rank 0's (larger when it broadcasts the trained module), per node
    # (dist.ranks_per_node) and how the ranks load the trained module (runner/plan/dist.py host_per_node)
    host_ranks: dict[str, Any] | None = None
    # An encoder cache's pre-pass (offload=park): entries read or a cold cache assumed, parts encoded, peaks
    # (runner/plan/prepass.py:cache_fill_report); None when nothing caches an encode step.
    cache_fill: dict[str, Any] | None = None
    reserved: dict[str, Any] | None = None  # a CUDA target: what the caching allocator reserves (runner/plan/allocator.py)
    timeline: dict[str, Any] | None = None  # memory over the simulated step, thinned: plan.png (runner/plan/timeline.py)
    # Host tensors at their highest in the step's training phases (forward, backward, optimizer) or after it: what
    # offloaded activations and streamed weights hold while training, beside host_steady_bytes between steps.
    host_training_bytes: int = 0

    @property
    def seconds_per_step(self) -> float | None:
        return None if self.step_time is None else float(self.step_time["seconds"])

    @property
    def required_bytes(self) -> int:
        return self.peak_bytes + self.margin_bytes

    @property
    def reserved_required_bytes(self) -> int | None:
        """The caching allocator's reserved peak (no cap) plus the kernel workspaces; None when not planned."""
        return None if self.reserved is None else int(self.reserved["reserved_peak_bytes"]) + self.margin_bytes

    @property
    def fits(self) -> bool:
        """The allocated peak and workspaces are within the budget, and the allocator, capped at the
        budget, never fails a request (it may flush its cache and retry: ``reserved['retries']``)."""
        if self.budget_bytes is None:
            return True
        return self.required_bytes <= self.budget_bytes and not (self.reserved or {}).get("ooms")

    @property
    def host_pageable_bytes(self) -> int:
        return max(self.host_peak_bytes - self.host_pinned_bytes, 0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(required_bytes=self.required_bytes, fits=self.fits, host_pageable_bytes=self.host_pageable_bytes,
                 reserved_required_bytes=self.reserved_required_bytes)
        return d

    def write_json(self, path: Path) -> Path:
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return path

    def format_table(self) -> str:
        return format_plan(self)


def _unit(n: int) -> tuple[float, str]:
    return (GiB, "GiB") if abs(n) >= GiB // 2 else (2**20, "MiB")


def format_size(n: int | float, unit: tuple[float, str] | None = None) -> str:
    div, name = unit or _unit(int(n))
    return f"{n / div:.2f} {name}"


def _size_text(run: dict[str, Any]) -> str:
    """``1024 px``, or ``1152x896 px (the largest of 37 aspect-ratio buckets (data.buckets))``."""
    note = run.get("planned_size_note")
    if not note:
        return f"{run['resolution']} px"
    h, w = run["planned_size"]
    return f"{w}x{h} px ({note})"


def _step_time_line(st: dict[str, Any]) -> str:
    per = ", ".join(f"{k} {v:.3g}" for k, v in st["phases"].items() if v)
    moved = st["h2d_bytes"] + st["d2h_bytes"]
    copies = f", {format_size(moved)} host<->device" if moved else ""
    from runner.plan.speed import comm_text

    use = f", utilisation {st['utilisation']:.1%}, MFU {st['mfu']:.1%}" if st.get("mfu") is not None else ""
    host = (f"; per step {st['card_ops_per_step']:,} card ops, {st['host_syncs_per_step']:,} host syncs"
            if st.get("host_syncs_per_step") is not None else "")
    return (f"step time: {st['seconds']:.3g} s/step predicted on {st['device']} ({per} s; {st['bound']}; "
            f"{st['flops'] / 1e12:.3g} TFLOP{use}{copies}{comm_text(st.get('comm'))}{host})")


def _host_ranks_line(h: dict[str, Any]) -> str:
    """Host RAM per rank and per node of a distributed plan (runner/plan/dist.py host_per_node)."""
    rank0 = (f"; rank 0: {format_size(h['rank0_bytes'])} ({h['why']})" if h["rank0_bytes"] > h["per_rank_bytes"]
             else f" ({h['why']})")
    return (f"  host RAM per rank: {format_size(h['per_rank_bytes'])}{rank0}; per node of {h['ranks_per_node']} "
            f"rank{'s' if h['ranks_per_node'] != 1 else ''} (dist.ranks_per_node): {format_size(h['per_node_bytes'])}")


def _reserved_line(plan: Plan) -> str:
    """What the caching allocator reserves, and what it must do at the budget (runner/plan/allocator.py)."""
    r = plan.reserved or {}
    kind = "expandable segments" if r["expandable_segments"] else "fixed segments (allocator.default.expandable_segments=false)"
    line = (f"  reserved by the caching allocator ({kind}): {format_size(plan.reserved_required_bytes or 0)} "
            f"with the workspaces, {format_size(r['reserved_peak_bytes'] - r['allocated_peak_bytes'])} cached beyond "
            "the allocated peak")
    if r.get("ooms"):
        line += (f"; capped at budget_gb it could not serve {r['ooms']} request(s) even after freeing its cache "
                 "(fragmentation): DOES NOT FIT")
    elif r.get("retries"):
        line += (f"; capped at budget_gb it frees its cache and retries {r['retries']} time(s) per run of the step "
                 "(each a device synchronisation: slower, but it fits)")
    return line


def _host_ram_lines(peak: int) -> list[str]:
    """The host peak against this machine's RAM (where a plan is made is usually where the run trains)."""
    import psutil

    ram = int(psutil.virtual_memory().total)
    if peak <= ram:
        return [f"  fits this machine's RAM ({format_size(ram)})"]
    return [f"  OVER this machine's RAM ({format_size(ram)}) by {format_size(peak - ram)}: the run would swap or be "
            "killed. Lower it with model.path=<weights file> (a file is read tensor by tensor; a random init builds "
            "each model whole), quantization of the frozen base, fewer offloads to the host (offload.*), or "
            "train on a machine with more RAM (fit.host_ram_gb=<GiB> plans for it in mode=fit)."]


def _cache_fill_line(c: dict[str, Any] | None, unit: tuple[float, str]) -> list[str]:
    """The encoder cache's pre-pass: what was read (or that a cold cache is assumed), its peak and the run's."""
    if c is None:
        return []
    return [_cache_fill_text(c, unit)] + ([_fill_time_text(c["fill"])] if c.get("fill") else [])


def _cache_fill_text(c: dict[str, Any], unit: tuple[float, str]) -> str:
    if c["read"]:
        seen = "encoder cache: " + ", ".join(f"{p} {n}/{m}" for p, (n, m) in c["entries"].items()) + " entries cached"
    else:
        seen = "encoder cache not read (mode=plan reads no data): a cold cache assumed"
    if c.get("host_parts"):
        return (f"  {seen}; pre-pass ({', '.join(c['host_parts'])}) on the host: no device bytes, the run's peak "
                "is training's")
    if not c["parts"]:
        return f"  {seen}; no pre-pass: the run's peak is training's"
    return (f"  {seen}; pre-pass ({', '.join(c['parts'])}): peak {format_size(c['peak_bytes'], unit)}, training "
            f"{format_size(c['training_peak_bytes'], unit)}: the run's peak is the {c['run_peak']}'s")


def _fill_time_text(f: dict[str, Any]) -> str:
    """The console line of runner/plan/fill_time.py:fill_time's result."""
    each = ", ".join(f"{p} {s:.3g} s" for p, s in f["seconds_per_batch"].items())
    head = f"  planned fill time on {f['where']}: "
    if f["seconds"] is None:
        head += f"{_duration(f['seconds_per_sample'])} per sample (the data folder is not read: x its samples)"
    else:
        head += f"{_duration(f['seconds'])} for " + " + ".join(f"{n:,} {p}" for p, n in f["entries"].items()) + " entries"
    untimed = f"; not timed: {', '.join(f['untimed'])}" if f["untimed"] else ""
    return f"{head} (per batch of {f['batch_size']}: {each}; {f['bound']}){untimed}"


def _duration(seconds: float) -> str:
    """``0.412 s``, ``12.3 min``, ``4.1 h``."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.3g} min" if seconds < 3600 else f"{seconds / 3600:.3g} h"


def format_plan(plan: Plan) -> str:
    """The plan as a readable table (what ``mode=plan`` prints)."""
    s = plan.run
    unit = _unit(plan.peak_bytes)
    lines = [
        f"Plan: {s['trainer']} ({s['size']}), {s.get('sample') or _size_text(s)}, batch {s['batch_size']} "
        f"({s['micro_batches']} x micro-batch {s['micro_batch_size']}), {s['precision_text']} on a "
        f"{plan.target.upper()} device" + (f"; one rank: {s['rank_text']}" if s.get("rank_text") else ""),
        f"  plugins: {s['plugins']}; optimizer: {s['optimizer']}; trained: {s['trained']}",
        "",
    ]
    need = f"{format_size(plan.peak_bytes)} at the peak ({plan.peak_phase})"
    if plan.margin_bytes:
        need += f" + {plan.margin_bytes / 2**20:.0f} MiB kernel workspaces = {format_size(plan.required_bytes)}"
    if plan.budget_bytes is None:
        verdict = "no budget_gb set: nothing to compare with"
    else:
        over = plan.required_bytes - plan.budget_bytes
        why = f"over by {format_size(over)}" if over > 0 else "the caching allocator cannot serve it: see the next line"
        verdict = f"budget_gb {plan.budget_bytes / GiB:g} -> " + ("FITS" if plan.fits else f"DOES NOT FIT ({why})")
    lines += [f"device memory: {need}", f"  {verdict}"]
    if plan.reserved is not None:
        lines.append(_reserved_line(plan))
    if plan.step_time:
        lines.append(_step_time_line(plan.step_time))
    lines.append("")
    mods = sorted(plan.by_module.items(), key=lambda kv: -sum(kv[1].values()))
    cats = [c for c in (*CATEGORIES, *OPTIONAL_CATEGORIES) if any(per.get(c) for _, per in mods)]
    short = {"optimizer_state": "optimizer", "temporaries": "temporary", "activations": "activation", "ema": "EMA"}
    lines.append(f"  {'at the peak, ' + unit[1]:<22}" + "".join(f"{short.get(c, c):>12}" for c in cats) + f"{'total':>12}")
    for name, per in mods:
        lines.append(f"  {name:<22}" + "".join(f"{per.get(c, 0) / unit[0]:>12.3f}" for c in cats)
                     + f"{sum(per.values()) / unit[0]:>12.3f}")
    lines.append(f"  {'all':<22}" + "".join(f"{plan.by_category.get(c, 0) / unit[0]:>12.3f}" for c in cats)
                 + f"{plan.peak_bytes / unit[0]:>12.3f}")
    lines += ["", "  steady-state peak by phase: " + ", ".join(f"{k} {format_size(v, unit)}" for k, v in plan.phases.items())]
    lines += _cache_fill_line(plan.cache_fill, unit)
    if plan.sampling:
        sp = plan.sampling
        lines.append(f"  sampling pass (sample.every, {sp['resolution']} px, denoiser batch {sp['denoiser_batch']}"
                     f"{', tiled VAE decode' if sp['vae_tiled'] else ''}): peak {format_size(sp['peak_bytes'], unit)}; "
                     f"training step: {format_size(sp['training_step_peak_bytes'], unit)}")
    if plan.ema:
        e = plan.ema
        lines.append(f"  EMA of the trained weights (ema.device={e['device']}, {e['dtype']}): "
                     f"{format_size(e['device_bytes'])} on the device, {format_size(e['host_bytes'])} on the host "
                     "(kept between steps, included above)")
    if plan.validation:
        v = plan.validation
        lines.append(f"  validation pass (val.batch_size {v['batch_size']}): " + (
            f"peak {format_size(v['peak_bytes'], unit)}" if v["planned"] else f"not simulated: {v['why']}"))
    state = ", ".join(f"{'device' if d == DEVICE.type else 'host' if d == HOST.type else d} {format_size(n)}"
                      for d, n in plan.optimizer_state_bytes.items() if n)
    if state:
        lines.append(f"  optimizer state (kept between steps, included above): {state}")
    lines += [
        "",
        f"host RAM (tensors): peak {format_size(plan.host_peak_bytes)} (in {plan.host_peak_phase}), during training "
        f"{format_size(plan.host_steady_bytes)}; pinned {format_size(plan.host_pinned_bytes)}, "
        f"pageable {format_size(plan.host_pageable_bytes)}",
    ]
    lines += _host_ram_lines(plan.host_peak_bytes)
    if plan.host_ranks:
        lines.append(_host_ranks_line(plan.host_ranks))
    elif plan.notes.get("base load"):  # one process: how a quantized LoRA base is loaded (runner/plan/quantized_reads.py)
        lines.append(f"  {plan.notes['base load']}")
    if plan.notes.get("parked on the host"):  # a trained module the trainer keeps on the host (Wan 2.2 A14B's other expert)
        lines.append(f"  {plan.notes['parked on the host']}")
    if plan.suggestions:
        lines += ["", "would save the most (estimates from the breakdown above, not re-planned; "
                      "confirm with mode=plan and the override):"]
        for sug in plan.suggestions:
            after = plan.required_bytes - sug["saves_bytes"]
            ok = plan.budget_bytes is not None and after <= plan.budget_bytes
            bound = "up to " if sug.get("upper_bound") else ""
            lines.append(f"  {sug['override']:<28} saves {bound}{format_size(sug['saves_bytes'])} -> "
                         f"{format_size(after)}, {'fits' if ok else 'still over'}")
            lines.append(f"  {'':<28}   ({sug['how']})")
    timings = plan.notes.get("timings_s") or {}
    detail = f" ({', '.join(f'{k} {v:.1f} s' for k, v in timings.items())})" if timings else ""
    lines += ["", f"simulated in {plan.seconds:.1f} s{detail}"]
    return "\n".join(lines)
